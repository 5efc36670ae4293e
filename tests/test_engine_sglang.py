"""The SGLang bridge without SGLang: ``translate`` and ``SglangRuntime`` against fakes shaped like
SGLang's classes (``async_generate``'s chunk dicts and ``meta_info``, the tokenizer manager that
aborts a request whose stream is closed). ``make test-engines`` checks every call against SGLang's
real signatures and ``SamplingParams.verify``; its engine needs a GPU (scripts/gpu_smoke.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from msgspec.structs import replace

from dynamo_prep.engines.base import EngineAbortedError, EngineContractError, EngineFailedError
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.engines.sglang.runtime import SglangApi, SglangRuntime, parse_server_args
from dynamo_prep.engines.sglang.translate import (
    ChunkReader,
    engine_argv,
    engine_facts,
    generate_kwargs,
    sampling_params,
)
from dynamo_prep.protocol.preprocessed import (
    ImageRef,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
)
from dynamo_prep.protocol.wire import TokenLogprob

EOS = 8194


def request(
    *, stop_ids: list[int] | None = None, min_tokens: int | None = None, **sampling: Any
) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m",
        token_ids=[1, 2, 3],
        stop_conditions=StopConditions(
            max_tokens=10, min_tokens=min_tokens, stop_token_ids=stop_ids or [], stop_token_ids_hidden=[EOS]
        ),
        sampling_options=SamplingOptions(**sampling),
        eos_token_ids=[EOS],
    )


def chunk(
    ids: list[int], finish: Any = None, *, completion: int | None = None, cached: int = 0
) -> dict[str, Any]:
    meta = {"finish_reason": finish, "prompt_tokens": 3, "cached_tokens": cached}
    if completion is not None:
        meta["completion_tokens"] = completion
    return {"output_ids": ids, "meta_info": meta}


# -- translate -------------------------------------------------------------------------------------


def test_engine_flags_get_the_model_path_unless_they_name_a_model() -> None:
    assert engine_argv("/m", ["--page-size", "16"]) == ["--model-path", "/m", "--page-size", "16"]
    assert engine_argv("/m", ["--model", "/x", "--tp-size", "2"]) == ["--model", "/x", "--tp-size", "2"]
    assert engine_argv("/m", ["--model=/x"]) == ["--model=/x"]


def test_sampling_params_are_sglang_s_keys() -> None:
    params = sampling_params(
        request(top_k=0, seed=5, temperature=0.3, min_tokens=2, stop_ids=[7]), {"top_p": 0.9}
    )
    assert params == {
        "temperature": 0.3,
        "top_p": 0.9,  # the model's default, under the request's values
        "top_k": -1,  # SGLang raises on 0: -1 is its "off"
        "sampling_seed": 5,  # SGLang raises on seed
        "max_new_tokens": 10,  # always set (SGLang's default is 128)
        "min_new_tokens": 2,
        "stop_token_ids": [7, EOS],
        "ignore_eos": False,
    }


def test_a_structured_output_constraint_is_sglang_s_json_schema_key() -> None:
    """Structured outputs (docs/structured-outputs.md): the schema's JSON text as SGLang's
    ``json_schema``; a JSON object as the schema ``{"type": "object"}`` (SGLang's OpenAI server's)."""
    schema = '{"type": "object", "required": ["a"]}'
    constrained = sampling_params(request(structured=StructuredOutput(json_schema=schema)), {})
    assert constrained["json_schema"] == schema
    json_object = sampling_params(request(structured=StructuredOutput(json_object=True)), {})
    assert json_object["json_schema"] == '{"type": "object"}'
    assert "json_schema" not in sampling_params(request(), {})


def test_images_go_as_decoded_images_with_one_hash_each_in_order() -> None:
    refs = [ImageRef(url="data:a", uuid="aa" * 16), ImageRef(url="data:b", uuid="bb" * 16)]
    req = request()
    req.images = refs
    kwargs = generate_kwargs(req, {}, ["first", "second"], "dp-3", uuids=["aa" * 16, "ab" * 32])
    assert kwargs["image_data"] == ["first", "second"]
    assert kwargs["mm_hashes"] == ["aa" * 16, "ab" * 32]  # the fetcher's, not the frontend's
    assert (kwargs["input_ids"], kwargs["rid"], kwargs["stream"]) == ([1, 2, 3], "dp-3", True)
    assert "image_data" not in generate_kwargs(request(), {}, [], "dp-4")


def test_chunks_become_steps_and_the_stop_id_sglang_includes_is_dropped() -> None:
    reader = ChunkReader(request(stop_ids=[42]))
    steps = [
        reader.step(chunk([11], cached=16)),
        reader.step(chunk([], cached=16)),  # empty non-final chunks occur
        reader.step(chunk([12, 42], {"type": "stop", "matched": 42}, completion=3, cached=16)),
    ]
    assert [s.token_ids for s in steps] == [[11], [], [12]]
    assert [s.finish_reason for s in steps] == [None, None, "stop"]
    assert steps[-1].completion_tokens == 3  # SGLang's own count, the stop id included
    assert {(s.prompt_tokens, s.cached_tokens) for s in steps} == {(3, 16)}
    length = ChunkReader(request()).step(chunk([5, EOS], {"type": "length", "length": 2}, completion=2))
    assert (length.token_ids, length.finish_reason) == ([5, EOS], "length")


@pytest.mark.parametrize(
    ("finish", "error", "code"),
    [
        ({"type": "abort", "message": "Input too long", "status_code": 400}, EngineContractError, 400),
        ({"type": "abort", "message": "Abort before prefill", "status_code": 503}, EngineAbortedError, 503),
        ({"type": "abort", "message": "aborted"}, EngineAbortedError, 503),
        ({"type": "weird"}, EngineFailedError, 500),
    ],
)
def test_aborts_and_unknown_finishes_are_errors(
    finish: dict[str, Any], error: type[Exception], code: int
) -> None:
    with pytest.raises(error) as raised:
        ChunkReader(request()).step(chunk([], finish))
    assert raised.value.code == code  # type: ignore[attr-defined]
    if "message" in finish and code == 400:
        assert str(raised.value) == finish["message"]


def test_engine_facts_are_pages_of_the_scheduler_s_tokens() -> None:
    args = SimpleNamespace(
        page_size=16, max_running_requests=48, max_prefill_tokens=8192, kv_events_config='{"x":1}'
    )
    facts = engine_facts(args, {"max_total_num_tokens": 1000}, 32768)
    assert (facts.block_size, facts.total_kv_blocks, facts.max_num_seqs) == (16, 63, 48)
    assert (facts.max_num_batched_tokens, facts.context_length, facts.kv_events_config) == (
        8192,
        32768,
        '{"x":1}',
    )


# -- runtime ---------------------------------------------------------------------------------------


class FakeTokenizerManager:
    """What the bridge touches: ``rid_to_state``, the handle loop, the model config's defaults."""

    def __init__(self) -> None:
        self.rid_to_state: dict[str, object] = {}
        self.aborted: list[str] = []
        self.handle_loop_started = 0
        self.context_len = 4096
        self.model_config = SimpleNamespace(get_default_sampling_params=lambda: {"temperature": 0.7})
        self.mm_processor = SimpleNamespace(mm_tokens=SimpleNamespace(image_token="<|media_pad|>"))

    def auto_create_handle_loop(self) -> None:
        self.handle_loop_started += 1

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)
        self.rid_to_state.pop(rid, None)


class FakeEngine:
    """``Engine.async_generate(stream=True)``: a generator that, like SGLang's, aborts a dispatched
    request when it is closed before its end (``_release_req_states_on_failure``)."""

    def __init__(self, chunks: list[dict[str, Any]] | Exception, *, hold: bool = False) -> None:
        self.chunks = chunks
        self.hold = hold
        self.calls: list[dict[str, Any]] = []
        self.tokenizer_manager = FakeTokenizerManager()
        self.server_args = SimpleNamespace(
            page_size=16, max_running_requests=8, max_prefill_tokens=4096, kv_events_config=None
        )
        self._scheduler_init_result = SimpleNamespace(scheduler_infos=[{"max_total_num_tokens": 160}])
        self.shut = False

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(kwargs)
        if isinstance(self.chunks, Exception):
            raise self.chunks
        return self._stream(kwargs["rid"], self.chunks)

    async def _stream(self, rid: str, chunks: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        manager = self.tokenizer_manager
        manager.rid_to_state[rid] = object()
        try:
            for item in chunks:
                await asyncio.sleep(0)
                yield item
            if self.hold:
                await asyncio.Event().wait()
            manager.rid_to_state.pop(rid, None)
        except BaseException:
            if rid in manager.rid_to_state:
                manager.abort_request(rid)
            raise

    def shutdown(self) -> None:
        self.shut = True


def runtime(engine: FakeEngine) -> SglangRuntime:
    return SglangRuntime(engine, ImageFetcher())


async def test_the_runtime_declares_the_loaded_processor_s_token_and_its_figures() -> None:
    rt = runtime(FakeEngine([]))
    assert rt.declared_image_token == "<|media_pad|>"
    assert (rt.facts.block_size, rt.facts.total_kv_blocks, rt.facts.context_length) == (16, 10, 4096)


async def test_a_request_is_one_async_generate_with_the_model_s_defaults_and_a_fresh_rid() -> None:
    engine = FakeEngine([chunk([11]), chunk([12, EOS], {"type": "stop", "matched": EOS}, completion=2)])
    rt = runtime(engine)
    for _ in range(2):
        steps = [step async for step in rt.generate(request())]
        assert [s.token_ids for s in steps] == [[11], [12]]
    first, second = engine.calls
    assert first["sampling_params"]["temperature"] == 0.7 and first["stream"] is True
    assert first["rid"] != second["rid"]  # a migrated request never reuses an id SGLang may hold
    assert rt.unfinished_requests() == 0


async def test_closing_the_stream_aborts_the_request_exactly_once() -> None:
    engine = FakeEngine([chunk([11])], hold=True)
    rt = runtime(engine)
    stream = rt.generate(request())
    assert (await anext(stream)).token_ids == [11]
    assert rt.unfinished_requests() == 1
    await stream.aclose()
    assert engine.tokenizer_manager.aborted == [engine.calls[0]["rid"]]
    assert rt.unfinished_requests() == 0


async def test_sglang_s_request_checks_are_400s_with_its_words() -> None:
    rt = runtime(FakeEngine(ValueError("Expected 2 image placeholder token(s), found 1.")))
    with pytest.raises(EngineContractError, match="Expected 2 image placeholder"):
        [step async for step in rt.generate(request())]


async def test_start_parses_the_engine_flags_with_sglang_s_parser_in_streaming_deltas() -> None:
    seen: dict[str, Any] = {}

    class ServerArgs:
        @staticmethod
        def add_cli_args(parser: Any) -> None:
            parser.add_argument("--model-path")
            parser.add_argument("--page-size", type=int)

        @classmethod
        def from_cli_args(cls, namespace: Any) -> Any:
            seen.update(vars(namespace))
            return SimpleNamespace(**vars(namespace))

    def make_engine(server_args: Any) -> FakeEngine:
        seen["server_args"] = server_args
        return FakeEngine([])

    api = SglangApi(engine=make_engine, server_args=ServerArgs)
    assert parse_server_args(api, ["--model-path", "/m", "--page-size", "16"]).page_size == 16
    assert seen["incremental_streaming_output"] is True
    with pytest.raises(SystemExit):
        parse_server_args(api, ["--no-such-flag"])
    rt = SglangRuntime.start(["--model-path", "/m"], ImageFetcher(), "/m", api=api)
    assert rt._manager.handle_loop_started == 1  # SGLang's handlers go in at start-up, not later
    await rt.shutdown()


async def test_sigquit_from_a_failed_child_is_the_engine_s_death_not_the_process_s() -> None:
    loop = asyncio.get_running_loop()
    rt = runtime(FakeEngine([]))
    rt.take_signals()
    try:
        assert signal.getsignal(signal.SIGQUIT) not in (signal.SIG_DFL, None)  # ours is installed
        os.kill(os.getpid(), signal.SIGQUIT)
        assert await asyncio.wait_for(rt.wait_dead(), 5) == "engine_child_failed"
    finally:
        loop.remove_signal_handler(signal.SIGQUIT)


# -- logprobs --------------------------------------------------------------------------------------


def logprob_request(top: int | None) -> PreprocessedRequest:
    asked = OutputOptions(logprobs=top is not None, top_logprobs=top)
    return replace(request(stop_ids=[42]), output_options=asked)


def test_logprobs_are_asked_as_return_logprob_and_top_logprobs_num() -> None:
    assert "return_logprob" not in generate_kwargs(request(), {}, [], rid="r")
    kwargs = generate_kwargs(logprob_request(3), {}, [], rid="r")
    assert (kwargs["return_logprob"], kwargs["top_logprobs_num"]) == (True, 3)
    assert generate_kwargs(logprob_request(0), {}, [], rid="r")["top_logprobs_num"] == 0


def test_meta_info_logprobs_become_one_record_per_visible_token() -> None:
    reader = ChunkReader(logprob_request(2))
    first = chunk([11])
    first["meta_info"].update(
        output_token_logprobs=[(-0.5, 11, None)],
        output_top_logprobs=[[(-1.5, 7, None), (-0.5, 11, None), (-0.25, 9, None)]],
    )
    last = chunk([12, 42], {"type": "stop", "matched": 42}, completion=3)
    last["meta_info"].update(
        output_token_logprobs=[(-1.0, 12, None), (-0.1, 42, None)],
        output_top_logprobs=[[(-1.0, 12, None), (-2.0, 3, None)], [(-0.1, 42, None), (-3.0, 4, None)]],
    )
    steps = [reader.step(first), reader.step(last)]
    assert steps[0].logprobs == [TokenLogprob(-0.5, ((9, -0.25), (11, -0.5)))]  # sorted, cut at 2
    assert steps[1].token_ids == [12]
    assert steps[1].logprobs == [TokenLogprob(-1.0, ((12, -1.0), (3, -2.0)))]  # the stop id's dropped
    assert ChunkReader(request()).step(first).logprobs is None  # not asked: none


def test_logprobs_sglang_did_not_align_are_none() -> None:
    reader = ChunkReader(logprob_request(0))
    shifted = chunk([11, 12])
    shifted["meta_info"]["output_token_logprobs"] = [(-0.5, 11, None)]
    assert reader.step(shifted).logprobs is None
    assert reader.step(chunk([13])).logprobs is None  # SGLang gave none
    fine = chunk([14])
    fine["meta_info"]["output_token_logprobs"] = [(-0.5, 14, None)]
    assert reader.step(fine).logprobs == [TokenLogprob(-0.5, ())]
