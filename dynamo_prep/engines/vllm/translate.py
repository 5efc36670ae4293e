"""vLLM as the worker speaks to it: a request as ``AsyncLLM.generate``'s arguments, each
``RequestOutput`` as an ``EngineStep``, the engine's figures as ``EngineFacts``.

Pure: vLLM's objects are read by attribute and its classes are built by ``runtime`` from the plain
values made here. Fixed choices (docs/engines.md): DELTA outputs, no detokenization (stop strings
stay in the frontend), ``max_tokens`` always set, the model's generation_config under the
request's values, the stop or EOS id vLLM returns as the last id dropped, a structured-output
constraint as ``StructuredOutputsParams`` (``json`` or ``json_object``), logprobs as
``logprobs=k`` (the sampled token's and the top k), read from each delta's ``logprobs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from dynamo_prep.engines.base import EngineAbortedError, EngineFacts, EngineFailedError
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
    "OutputReader",
    "engine_argv",
    "engine_facts",
    "logprob_records",
    "prompt_fields",
    "sampling_fields",
    "structured_fields",
]

# vLLM's finish reasons that end a stream normally, as the request plane names them.
_FINISHED: Final = {"stop": "stop", "length": "length", "repetition": "stop"}


def engine_argv(model_dir: str | Path, rest: Sequence[str]) -> list[str]:
    """vLLM's own command line: the operator's engine flags, and ``--model`` unless they name one."""
    return model_argv("--model", model_dir, rest)


def sampling_fields(request: PreprocessedRequest, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``SamplingParams`` keywords for a request (``runtime`` adds DELTA output and builds it).

    ``defaults`` is ``model_config.get_diff_sampling_param()`` (vLLM does not apply it itself).
    """
    stop = request.stop_conditions
    fields = sampling_values(request, defaults)
    fields.update(
        max_tokens=stop.max_tokens,
        stop_token_ids=stop_ids(request),
        ignore_eos=stop.ignore_eos,
        detokenize=False,
    )
    if stop.min_tokens is not None:
        fields["min_tokens"] = stop.min_tokens
    top = logprobs_asked(request)
    if top is not None:
        fields["logprobs"] = top
    return fields


def structured_fields(request: PreprocessedRequest) -> dict[str, Any] | None:
    """``StructuredOutputsParams`` keywords of a constrained request (None: free text); ``runtime``
    builds it as ``SamplingParams.structured_outputs``. The schema goes as the client's JSON text."""
    structured = request.sampling_options.structured
    if structured is None:
        return None
    if structured.json_schema is not None:
        return {"json": structured.json_schema}
    return {"json_object": True}


def prompt_fields(
    request: PreprocessedRequest, images: Sequence[object], uuids: Sequence[str]
) -> dict[str, Any]:
    """``TokensPrompt`` keys: the ids, and the decoded images with their uuids in prompt order (the
    fetcher's: the image's bytes key vLLM's caches, its URL's part names it to the router)."""
    fields: dict[str, Any] = {"prompt_token_ids": request.token_ids}
    if images:
        fields["multi_modal_data"] = {"image": list(images)}
        fields["multi_modal_uuids"] = {"image": list(uuids)}
    return fields


class OutputReader:
    """One request's ``RequestOutput``s (DELTA) as ``EngineStep``s."""

    __slots__ = ("_counter", "_top")

    def __init__(self, request: PreprocessedRequest) -> None:
        self._counter = StepCounter(stop_ids(request))
        self._top = logprobs_asked(request)

    def step(self, output: Any) -> EngineStep:
        """Raises ``EngineAbortedError`` when vLLM aborted the request by itself (our own cancel
        closes the stream and reads nothing more), ``EngineFailedError`` for vLLM's ``error``."""
        completion = output.outputs[0]
        reason = completion.finish_reason
        if reason == "abort":
            raise EngineAbortedError("the engine aborted the request")
        if reason is not None and reason not in _FINISHED:
            raise EngineFailedError(f"the engine ended the request with {reason!r}")
        finish = _FINISHED.get(reason) if reason is not None else None
        all_ids = list(completion.token_ids)
        token_ids = self._counter.visible(all_ids, finish == "stop")
        records = None if self._top is None else logprob_records(all_ids, completion.logprobs, self._top)
        return EngineStep(
            token_ids=token_ids,
            finish_reason=finish,
            prompt_tokens=len(output.prompt_token_ids or ()),
            completion_tokens=self._counter.completion_tokens,
            cached_tokens=output.num_cached_tokens or 0,
            logprobs=StepCounter.aligned(records, token_ids),
        )


def logprob_records(token_ids: Sequence[int], positions: Any, top: int) -> list[TokenLogprob] | None:
    """A delta's ``CompletionOutput.logprobs`` (one ``{id: Logprob(logprob, rank)}`` per position: the
    sampled id and the top ``top`` ids; a list or vLLM's ``FlatLogprobs``) as records; None when
    vLLM gave none for some position."""
    if positions is None or len(positions) != len(token_ids):
        return None
    records: list[TokenLogprob] = []
    for token_id, position in zip(token_ids, positions, strict=True):
        if not position or token_id not in position:
            return None
        ranked = sorted(position.items(), key=lambda item: (_rank(item[1]), -item[1].logprob))
        best = [(other, float(entry.logprob)) for other, entry in ranked if _rank(entry) <= top][:top]
        records.append(TokenLogprob(float(position[token_id].logprob), tuple(best)))
    return records


def _rank(entry: Any) -> float:
    """vLLM's rank of an entry (1: the most likely); an entry without one sorts last."""
    rank = entry.rank
    return float("inf") if rank is None else float(rank)


def engine_facts(vllm_config: Any) -> EngineFacts:
    """What the card says of the running engine (read after start: KV blocks are sized then)."""
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    return EngineFacts(
        block_size=cache.block_size,
        total_kv_blocks=cache.num_gpu_blocks,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        context_length=vllm_config.model_config.max_model_len,
        data_parallel_rank=vllm_config.parallel_config.data_parallel_rank or 0,
        kv_events_config=vllm_config.kv_events_config,
    )
