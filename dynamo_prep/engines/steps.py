"""What every real-engine bridge shares: the step it yields, the stop ids, the sampling values.

Pure: engine outputs are read by attribute or key, engine classes are never imported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from dynamo_prep.engines.base import EngineContractError
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import TokenLogprob

__all__ = [
    "SAMPLING_KEYS",
    "EngineStep",
    "StepCounter",
    "check_n",
    "logprobs_asked",
    "model_argv",
    "sampling_values",
    "stop_ids",
]

# The sampling knobs a request may leave to the model's generation_config (our names).
SAMPLING_KEYS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class EngineStep(msgspec.Struct, frozen=True, gc=False):
    """One streamed step of a real engine, as the worker sends it (an ``EngineOutput``)."""

    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked


def logprobs_asked(request: PreprocessedRequest) -> int | None:
    """How many top alternatives to return per token (0: the sampled token's logprob only), or None
    when the request asked for no logprobs."""
    options = request.output_options
    if not options.logprobs:
        return None
    return max(options.top_logprobs or 0, 0)


def model_argv(model_flag: str, model_dir: str | Path, rest: Sequence[str]) -> list[str]:
    """An engine's own command line: the engine flags, with ``model_flag model_dir`` in front unless
    they name a model themselves (``--model``: vLLM's flag, and SGLang's alias of its
    ``--model-path``, which is the worker's own)."""
    if any(arg == "--model" or arg.startswith("--model=") for arg in rest):
        return list(rest)
    return [model_flag, str(model_dir), *rest]


def check_n(request: PreprocessedRequest) -> None:
    """One choice per request until ``n`` is fanned out: anything else is refused (a 400)."""
    n = request.sampling_options.n
    if n != 1:
        raise EngineContractError(f"n must be 1 on this worker (got {n}): ask for one choice per request")


def stop_ids(request: PreprocessedRequest) -> list[int]:
    """Every id that ends generation: the client's, then the model's EOS ids unless ``ignore_eos``."""
    stop = request.stop_conditions
    ids = [*stop.stop_token_ids, *stop.stop_token_ids_hidden]
    if not stop.ignore_eos:
        ids.extend(request.eos_token_ids)
    return list(dict.fromkeys(ids))


def sampling_values(request: PreprocessedRequest, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The request's sampling knobs (``SAMPLING_KEYS``, our names) over the model's defaults: a
    value the client sent wins, one it left out takes the generation_config's, else it is absent
    (the engine's own default)."""
    options = request.sampling_options
    values: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        value = getattr(options, key, None)
        if value is None:
            value = defaults.get(key)
        if value is not None:
            values[key] = value
    if options.seed is not None:
        values["seed"] = options.seed
    return values


class StepCounter:
    """A request's running completion count over delta steps, and the stop id an engine returns as
    the last id of a stopped stream (the client never sees it; usage counts it, as the engine does)."""

    __slots__ = ("_stops", "completion_tokens")

    def __init__(self, stops: list[int]) -> None:
        self._stops = frozenset(stops)
        self.completion_tokens = 0

    def visible(self, token_ids: list[int], stopped: bool) -> list[int]:
        """``token_ids`` of one delta, counted; a stopped stream's final stop id dropped."""
        self.completion_tokens += len(token_ids)
        if stopped and token_ids and token_ids[-1] in self._stops:
            return token_ids[:-1]
        return token_ids

    @staticmethod
    def aligned(logprobs: list[TokenLogprob] | None, visible: list[int]) -> list[TokenLogprob] | None:
        """A delta's logprobs for its ``visible`` ids (the dropped stop id's record dropped too)."""
        return None if logprobs is None else logprobs[: len(visible)]
