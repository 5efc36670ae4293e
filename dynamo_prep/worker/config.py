"""The worker's options, validated once: what every ``dynamo-prep worker`` flag means.

Light on purpose (no ZeroMQ, no tokenizer, no formatter): the CLI reads its defaults here. What
needs the model (the engine, the card, a replies file) is loaded when the process starts. A real
engine (``--engine vllm|sglang``) gets every flag the worker does not know (``engine_args``),
parsed by the engine's own parser when it starts; the mock's own options are refused there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from dynamo_prep.discovery.announcing import Announcing
from dynamo_prep.engines.base import DEFAULT_REPLY_FORMAT, REPLY_FORMATS, ReplyFormat
from dynamo_prep.engines.media_policy import MediaPolicy
from dynamo_prep.engines.registry import DEFAULT_ENGINE, DEFAULT_FLAVOR, ENGINES, FLAVORS, bridge
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.discovery import DEFAULT_HEARTBEAT_S, DEFAULT_NAMESPACE, DEFAULT_TTL_MS

if TYPE_CHECKING:  # loaded on demand: reading the defaults must not import ZeroMQ
    from dynamo_prep.discovery.trust import ClientCurve

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_ENDPOINT_HOST",
    "DEFAULT_ENGINE_STALL_TIMEOUT_S",
    "DEFAULT_KV_BLOCKS",
    "DEFAULT_PREFILL_MS_PER_1K",
    "DEFAULT_TOKEN_DELAY_S",
    "ENGINES",
    "WorkerConfig",
]

DEFAULT_ENDPOINT_HOST = "127.0.0.1"
DEFAULT_TOKEN_DELAY_S = 0.02
DEFAULT_DRAIN_TIMEOUT_S = 5.0
# Requests in flight and no engine step for this long: the engine is hung (worker.watchdog). Far
# above a real engine's longest step (a chunked prefill, a batch of image encodes) and below the
# frontend's --stream-stall-timeout, so the worker, which knows, speaks first.
DEFAULT_ENGINE_STALL_TIMEOUT_S = 30.0
DEFAULT_KV_BLOCKS = 2048
DEFAULT_PREFILL_MS_PER_1K = 0.0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Validated worker options (what the CLI flags mean, checked once).

    ``kv_events``: the mock engine keeps a paged prefix cache of ``kv_blocks`` blocks (the card's
    ``kv_cache_block_size`` tokens each), publishes its KV events and charges ``prefill_ms_per_1k``
    per 1000 prompt tokens it does not hold. ``media``: where request images may be fetched from
    (every engine, the mock included). ``slots``: the mock runs at most that many requests at once
    (its card's ``max_num_seqs``), the others wait. ``engine_stall_timeout_s``: the watchdog's
    (0: off).
    """

    model_dir: Path
    discovery: tuple[str, ...]
    served_name: str | None = None
    declared_image_token: str | None = None
    legacy_expands_image_pad_token: bool = False
    namespace: str = DEFAULT_NAMESPACE
    endpoint_host: str = DEFAULT_ENDPOINT_HOST
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    ttl_ms: int = DEFAULT_TTL_MS
    curve: ClientCurve | None = None
    engine: str = DEFAULT_ENGINE
    flavor: str = DEFAULT_FLAVOR
    token_delay_s: float = DEFAULT_TOKEN_DELAY_S
    replies: Path | None = None
    reply_format: ReplyFormat = DEFAULT_REPLY_FORMAT
    migration_limit: int = 0
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    metrics_port: int | None = None
    kv_events: bool = False
    kv_blocks: int = DEFAULT_KV_BLOCKS
    prefill_ms_per_1k: float = DEFAULT_PREFILL_MS_PER_1K
    media: MediaPolicy = field(default_factory=MediaPolicy)
    slots: int | None = None
    engine_stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S
    engine_args: tuple[str, ...] = ()
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def real_engine(self) -> bool:
        return bridge(self.engine).real

    @property
    def legacy_runtime(self) -> dict[str, bool] | None:
        """The pre-declaration runtime_config key a legacy worker publishes, or None."""
        return {"expands_image_pad_token": True} if self.legacy_expands_image_pad_token else None

    @property
    def announcing(self) -> Announcing:
        """How the worker announces its card, passed whole to its ``CardPublisher``."""
        return Announcing(
            discovery=self.discovery,
            namespace=self.namespace,
            heartbeat_s=self.heartbeat_s,
            ttl_ms=self.ttl_ms,
            legacy_runtime=self.legacy_runtime,
            curve=self.curve,
        )

    @classmethod
    def from_options(
        cls,
        *,
        model_path: str | Path,
        discovery: Sequence[str],
        served_name: str | None = None,
        declared_image_token: str | None = None,
        legacy_expands_image_pad_token: bool = False,
        namespace: str = DEFAULT_NAMESPACE,
        endpoint_host: str = DEFAULT_ENDPOINT_HOST,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        ttl_ms: int = DEFAULT_TTL_MS,
        curve_secret_key: Path | None = None,
        curve_server_key: Path | None = None,
        engine: str = DEFAULT_ENGINE,
        flavor: str | None = None,
        token_delay_s: float | None = None,
        replies: str | Path | None = None,
        reply_format: str | None = None,
        migration_limit: int = 0,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        metrics_port: int | None = None,
        kv_events: bool = False,
        kv_blocks: int | None = None,
        prefill_ms_per_1k: float | None = None,
        allowed_media_domains: Sequence[str] | None = None,
        allowed_media_networks: Sequence[str] = (),
        slots: int | None = None,
        engine_stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S,
        engine_args: Sequence[str] = (),
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> WorkerConfig:
        """Raises ValueError (TrustError for CURVE key files) naming the option that is wrong.

        ``flavor``, ``token_delay_s``, ``replies``, ``reply_format``, ``slots`` and ``kv_events`` are
        the mock engine's (None: its default); ``kv_blocks`` and ``prefill_ms_per_1k`` options of
        ``kv_events``. ``allowed_media_domains`` (None: any) and ``allowed_media_networks`` are
        the image fetcher's ``MediaPolicy``. ``engine_args`` go to a real engine's own parser (the
        mock takes none). ``tool_call_parser`` / ``reasoning_parser``: vLLM's names, for every engine
        (the card carries them; the frontend parses the answers).
        """
        if not discovery:
            raise ValueError("--discovery needs at least one address")
        if declared_image_token is not None and legacy_expands_image_pad_token:
            raise ValueError("--declare-image-token and --legacy-expands-image-pad-token exclude each other")
        if declared_image_token == "":
            raise ValueError("--declare-image-token must not be empty")
        engine_bridge = bridge(engine)
        engine_bridge.check_options(
            engine_args,
            {
                "--flavor": flavor,
                "--token-delay": token_delay_s,
                "--replies": replies,
                "--reply-format": reply_format,
                "--slots": slots,
                "--kv-events": kv_events or None,
            },
        )
        flavor = flavor or (engine if engine_bridge.real else DEFAULT_FLAVOR)
        reply_format = reply_format or DEFAULT_REPLY_FORMAT
        token_delay_s = DEFAULT_TOKEN_DELAY_S if token_delay_s is None else token_delay_s
        # A real engine is its own flavor; the mock's must be an engine it can emulate.
        flavors = (engine,) if engine_bridge.real else FLAVORS
        for option, value, known in (
            ("--flavor", flavor, flavors),
            ("--reply-format", reply_format, REPLY_FORMATS),
        ):
            if value not in known:
                raise ValueError(f"unknown {option} {value!r} (known: {', '.join(known)})")
        for option, number in (("--heartbeat", heartbeat_s), ("--ttl-ms", ttl_ms)):
            if not number > 0:
                raise ValueError(f"{option} must be > 0, got {number}")
        for option, number in (
            ("--token-delay", token_delay_s),
            ("--migration-limit", migration_limit),
            ("--drain-timeout", drain_timeout_s),
            ("--engine-stall-timeout", engine_stall_timeout_s),
        ):
            if not number >= 0:
                raise ValueError(f"{option} must be >= 0, got {number}")
        if slots is not None and not slots >= 1:
            raise ValueError(f"--slots must be >= 1, got {slots}")
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535, got {metrics_port}")
        _check_kv_options(kv_events, kv_blocks, prefill_ms_per_1k)
        media = MediaPolicy.from_options(allowed_media_domains, allowed_media_networks)
        _check_parsers(tool_call_parser, reasoning_parser)
        return cls(
            model_dir=resolve_model_dir(model_path),
            discovery=tuple(discovery),
            served_name=served_name,
            declared_image_token=declared_image_token,
            legacy_expands_image_pad_token=legacy_expands_image_pad_token,
            namespace=namespace,
            endpoint_host=endpoint_host,
            heartbeat_s=heartbeat_s,
            ttl_ms=ttl_ms,
            curve=_client_curve(curve_secret_key, curve_server_key),
            engine=engine,
            flavor=flavor,
            token_delay_s=token_delay_s,
            replies=Path(replies) if replies is not None else None,
            reply_format=cast(ReplyFormat, reply_format),
            migration_limit=migration_limit,
            drain_timeout_s=drain_timeout_s,
            metrics_port=metrics_port,
            kv_events=kv_events,
            kv_blocks=DEFAULT_KV_BLOCKS if kv_blocks is None else kv_blocks,
            prefill_ms_per_1k=DEFAULT_PREFILL_MS_PER_1K if prefill_ms_per_1k is None else prefill_ms_per_1k,
            media=media,
            slots=slots,
            engine_stall_timeout_s=engine_stall_timeout_s,
            engine_args=tuple(engine_args),
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )


def _check_kv_options(kv_events: bool, kv_blocks: int | None, prefill_ms_per_1k: float | None) -> None:
    for option, value in (("--kv-blocks", kv_blocks), ("--prefill-ms-per-1k", prefill_ms_per_1k)):
        if value is not None and not kv_events:
            raise ValueError(f"{option} needs --kv-events")
    if kv_blocks is not None and not kv_blocks >= 1:
        raise ValueError(f"--kv-blocks must be >= 1, got {kv_blocks}")
    if prefill_ms_per_1k is not None and not 0 <= prefill_ms_per_1k < math.inf:
        raise ValueError(f"--prefill-ms-per-1k must be a finite number >= 0, got {prefill_ms_per_1k}")


def _check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Registered names only (the registry is loaded here, not when the CLI reads its defaults)."""
    if tool_call_parser is None and reasoning_parser is None:
        return
    from dynamo_prep.parsing import check_parser_names  # noqa: PLC0415 - the parsers load with the model

    check_parser_names(tool_call_parser, reasoning_parser)


def _client_curve(secret_key: Path | None, server_key: Path | None) -> ClientCurve | None:
    if secret_key is None and server_key is None:
        return None
    if secret_key is None or server_key is None:
        raise ValueError("CURVE needs both --curve-secret-key and --curve-server-key")
    from dynamo_prep.discovery.trust import ClientCurve  # noqa: PLC0415 - ZeroMQ only when keyed

    return ClientCurve.load(secret_key, server_key)
