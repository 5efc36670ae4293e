"""What the routing flags mean: one record, handed whole to the router the mode names.

Light on purpose (no ZeroMQ): the CLI and ``frontend/config.py`` read the defaults here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

from dynamo_prep.routing.predicted import DEFAULT_PREDICT_TTL_S

__all__ = [
    "DEFAULT_KV_OVERLAP_SCORE_WEIGHT",
    "DEFAULT_KV_PREDICT_TTL_S",
    "DEFAULT_ROUTER_MODE",
    "DEFAULT_ROUTER_TEMPERATURE",
    "ROUTER_MODES",
    "RouterMode",
    "RouterSettings",
]

RouterMode = Literal["round-robin", "kv"]  # each one a line of ``routing.modes.ROUTERS``
ROUTER_MODES: tuple[RouterMode, ...] = get_args(RouterMode)
DEFAULT_ROUTER_MODE: RouterMode = "round-robin"
# Blocks to prefill weigh twice the blocks running requests hold (Dynamo's default: once); with
# once, a prefix left its instance for a less busy one's (docs/operations.md, "KV routing").
# Temperature 0 (Dynamo's) picks the cheapest.
DEFAULT_KV_OVERLAP_SCORE_WEIGHT: Final = 2.0
DEFAULT_ROUTER_TEMPERATURE: Final = 0.0
DEFAULT_KV_PREDICT_TTL_S: Final = DEFAULT_PREDICT_TTL_S


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """What the routing flags mean (``--router-mode``, ``--kv-overlap-score-weight``,
    ``--router-temperature``, ``--kv-predict-ttl``, ``--kv-endpoint-hosts``: hosts a KV endpoint may
    be on besides its worker's own, ``*`` for any)."""

    mode: RouterMode = DEFAULT_ROUTER_MODE
    kv_overlap_score_weight: float = DEFAULT_KV_OVERLAP_SCORE_WEIGHT
    temperature: float = DEFAULT_ROUTER_TEMPERATURE
    predict_ttl_s: float = DEFAULT_KV_PREDICT_TTL_S
    kv_endpoint_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"--router-mode must be one of {', '.join(ROUTER_MODES)}, got {self.mode!r}")
        if not (self.kv_overlap_score_weight >= 0 and self.temperature >= 0 and self.predict_ttl_s >= 0):
            raise ValueError(
                "--kv-overlap-score-weight, --router-temperature and --kv-predict-ttl must be >= 0"
            )
