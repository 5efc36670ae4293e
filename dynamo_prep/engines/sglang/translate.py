"""SGLang as the worker speaks to it: a request as ``Engine.async_generate``'s keywords, each
streamed chunk as an ``EngineStep``, the engine's figures as ``EngineFacts``.

Pure: SGLang's objects are read by attribute or key. Fixed choices (docs/engines.md): incremental
(delta) chunks, ``max_new_tokens`` always set, the model's sampling defaults under the request's
values, ``top_k`` 0 sent as -1 (SGLang's "off"; 0 raises), the seed as ``sampling_seed``, the stop or
EOS id SGLang includes in ``output_ids`` dropped, decoded images with their uuids as ``mm_hashes``, a
structured-output constraint as the ``json_schema`` key (a JSON object as ``{"type": "object"}``),
logprobs as ``return_logprob`` and ``top_logprobs_num``, read from each chunk's ``meta_info``
``output_token_logprobs`` and ``output_top_logprobs`` (``(logprob, id, text)`` triples, the chunk's own).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from dynamo_prep.engines.base import EngineAbortedError, EngineContractError, EngineFacts, EngineFailedError
from dynamo_prep.engines.steps import (
    EngineStep,
    StepCounter,
    logprobs_asked,
    model_argv,
    sampling_values,
    stop_ids,
)
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import TokenLogprob

__all__ = [
    "ChunkReader",
    "engine_argv",
    "engine_facts",
    "generate_kwargs",
    "logprob_records",
    "sampling_params",
]

_TOP_K_OFF: Final = -1
_FINISHED: Final = {"stop": "stop", "length": "length"}
_BAD_REQUEST: Final = 400
_JSON_OBJECT: Final = '{"type": "object"}'


def engine_argv(model_dir: str | Path, rest: Sequence[str]) -> list[str]:
    """SGLang's own command line: the engine flags, and ``--model-path`` unless they name a model."""
    return model_argv("--model-path", model_dir, rest)


def sampling_params(request: PreprocessedRequest, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The ``sampling_params`` dict of a request (SGLang's keys)."""
    stop = request.stop_conditions
    params = sampling_values(request, defaults)
    if params.get("top_k") == 0:
        params["top_k"] = _TOP_K_OFF
    if "seed" in params:
        params["sampling_seed"] = params.pop("seed")
    params.update(
        max_new_tokens=stop.max_tokens,
        stop_token_ids=stop_ids(request),
        ignore_eos=stop.ignore_eos,
    )
    if stop.min_tokens is not None:
        params["min_new_tokens"] = stop.min_tokens
    structured = request.sampling_options.structured
    if structured is not None:  # SGLang's OpenAI server sends a JSON object as this schema too
        params["json_schema"] = structured.json_schema or _JSON_OBJECT
    return params


def generate_kwargs(
    request: PreprocessedRequest,
    defaults: Mapping[str, Any],
    images: Sequence[object],
    rid: str,
    *,
    uuids: Sequence[str] = (),
) -> dict[str, Any]:
    """``async_generate``'s keywords: ids in, a stream of deltas out, decoded images (never a URL
    or a string SGLang would read as a path) with one hash per image (the fetcher's ``uuids``)."""
    kwargs: dict[str, Any] = {
        "input_ids": request.token_ids,
        "sampling_params": sampling_params(request, defaults),
        "rid": rid,
        "stream": True,
    }
    if images:
        if len(uuids) != len(images):
            raise ValueError(f"{len(images)} images and {len(uuids)} uuids")
        kwargs["image_data"] = list(images)
        kwargs["mm_hashes"] = list(uuids)
    top = logprobs_asked(request)
    if top is not None:
        kwargs.update(return_logprob=True, top_logprobs_num=top)
    return kwargs


class ChunkReader:
    """One request's incremental chunks (``{"output_ids", "meta_info"}``) as ``EngineStep``s."""

    __slots__ = ("_counter", "_top")

    def __init__(self, request: PreprocessedRequest) -> None:
        self._counter = StepCounter(stop_ids(request))
        self._top = logprobs_asked(request)

    def step(self, chunk: Mapping[str, Any]) -> EngineStep:
        """Raises ``EngineContractError`` for SGLang's 400 aborts (its message), ``EngineAbortedError``
        for other aborts (retryable), ``EngineFailedError`` for a finish it does not name."""
        meta = chunk.get("meta_info") or {}
        finish = _finish(meta.get("finish_reason"))
        all_ids = list(chunk.get("output_ids") or ())
        token_ids = self._counter.visible(all_ids, finish == "stop")
        records = None if self._top is None else logprob_records(all_ids, meta, self._top)
        return EngineStep(
            token_ids=token_ids,
            finish_reason=finish,
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            completion_tokens=int(meta.get("completion_tokens") or self._counter.completion_tokens),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            logprobs=StepCounter.aligned(records, token_ids),
        )


def logprob_records(token_ids: Sequence[int], meta: Mapping[str, Any], top: int) -> list[TokenLogprob] | None:
    """A chunk's ``output_token_logprobs`` (one ``(logprob, id, text)`` per id) and, with ``top``,
    ``output_top_logprobs`` (a list of such triples per id) as records, most likely first; None when
    SGLang's lists do not match the chunk's ids."""
    sampled = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [] if top else [[] for _ in token_ids]
    if len(sampled) != len(token_ids) or len(tops) != len(token_ids):
        return None
    records: list[TokenLogprob] = []
    for token_id, (logprob, sampled_id, *_), alternatives in zip(token_ids, sampled, tops, strict=True):
        if sampled_id != token_id or logprob is None:
            return None
        best = sorted(((int(entry[1]), float(entry[0])) for entry in alternatives or ()), key=lambda e: -e[1])
        records.append(TokenLogprob(float(logprob), tuple(best[:top])))
    return records


def _finish(reason: Any) -> str | None:
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind in _FINISHED:
        return _FINISHED[kind]
    if kind == "abort":
        message = str(reason.get("message") or "the engine aborted the request")
        if reason.get("status_code") == _BAD_REQUEST:
            raise EngineContractError(message)
        raise EngineAbortedError(message)
    raise EngineFailedError(f"the engine ended the request with {reason!r}")


def engine_facts(server_args: Any, scheduler_info: Mapping[str, Any], context_length: int) -> EngineFacts:
    """What the card says of the running engine: its page size and KV pages, batch limits, context.

    ``scheduler_info`` is the scheduler's hand-shake (``max_total_num_tokens``); total KV blocks are
    its tokens over the page size, rounded up.
    """
    page_size = int(server_args.page_size or 1)
    total_tokens = scheduler_info.get("max_total_num_tokens")
    return EngineFacts(
        block_size=page_size,
        total_kv_blocks=math.ceil(total_tokens / page_size) if total_tokens else None,
        max_num_seqs=server_args.max_running_requests,
        max_num_batched_tokens=server_args.max_prefill_tokens,
        context_length=context_length,
        data_parallel_rank=0,
        kv_events_config=server_args.kv_events_config,
    )
