"""The vLLM bridge without vLLM: ``translate`` and ``VllmRuntime`` against fakes shaped like vLLM's
classes (``RequestOutput`` / ``CompletionOutput`` fields, ``AsyncLLM.generate``'s abort-on-close,
its error types). ``make test-engines`` runs the same bridge against the real engine."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from msgspec.structs import replace
from PIL import Image

from dynamo_prep.engines.base import (
    EngineAbortedError,
    EngineContractError,
    EngineDeadError,
    EngineFailedError,
)
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.engines.vllm.runtime import VllmApi, VllmRuntime
from dynamo_prep.engines.vllm.translate import (
    OutputReader,
    engine_argv,
    engine_facts,
    prompt_fields,
    sampling_fields,
    structured_fields,
)
from dynamo_prep.protocol.clock import now_ms
from dynamo_prep.protocol.preprocessed import (
    ImageRef,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
    image_uuid,
)
from dynamo_prep.protocol.wire import Cancel, ErrorReply, Generate, Output, TokenLogprob
from dynamo_prep.tokenizer import Tokenizer
from dynamo_prep.worker.generate import GenerationServer

EOS = 8194


def request(
    *,
    max_tokens: int = 16,
    stop_ids: list[int] | None = None,
    images: list[ImageRef] | None = None,
    ignore_eos: bool = False,
    **sampling: Any,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m",
        token_ids=[1, 2, 3, 4, 5],
        stop_conditions=StopConditions(
            max_tokens=max_tokens,
            stop_token_ids=stop_ids or [],
            stop_token_ids_hidden=[] if ignore_eos else [EOS],
            ignore_eos=ignore_eos,
        ),
        sampling_options=SamplingOptions(**sampling),
        eos_token_ids=[EOS],
        images=images or [],
    )


# -- fakes shaped like vLLM's ----------------------------------------------------------------------


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


def out(
    ids: list[int], finish: str | None = None, *, stop_reason: Any = None, cached: int = 0
) -> RequestOutput:
    completion = CompletionOutput(token_ids=ids, finish_reason=finish, stop_reason=stop_reason)
    return RequestOutput("x", None, [1, 2, 3, 4, 5], None, [completion], finish is not None, cached)


class ClientError(Exception):
    """Stands for vllm.exceptions.VLLMClientError."""


class BusyError(Exception):
    """Stands for vllm.exceptions.GracefulHTTPError."""


class DeadError(Exception):
    """Stands for vllm.v1.engine.exceptions.EngineDeadError."""


FAKE_API = VllmApi(
    sampling_params=lambda **fields: dict(fields),
    structured_outputs=lambda **fields: ("StructuredOutputsParams", fields),
    tokens_prompt=lambda **fields: dict(fields),
    delta="DELTA",
    client_errors=(ClientError, ValueError),
    busy_errors=(BusyError,),
    dead_errors=(DeadError,),
)


class FakeAsyncLLM:
    """``AsyncLLM`` as the bridge uses it: ``generate`` streams the script and, like vLLM's, aborts
    the request itself when its consumer cancels or closes the stream before the end."""

    def __init__(self, script: list[RequestOutput] | BaseException, *, hold: bool = False) -> None:
        self.script = script
        self.hold = hold  # after the script, wait (a request still generating)
        self.calls: list[tuple[Any, Any, str]] = []
        self.aborts: list[str] = []
        self.running: set[str] = set()
        self.errored = False
        self.model_config = SimpleNamespace(get_diff_sampling_param=lambda: {"temperature": 0.6, "top_k": 20})
        self.vllm_config = vllm_config()

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[RequestOutput]:
        self.calls.append((prompt, params, request_id))
        if isinstance(self.script, BaseException):
            raise self.script
        self.running.add(request_id)
        finished = False
        try:
            for output in self.script:
                await asyncio.sleep(0)
                yield output
            finished = True
            if self.hold:
                finished = False
                await asyncio.Event().wait()
        except (asyncio.CancelledError, GeneratorExit):
            self.aborts.append(request_id)
            raise
        finally:
            if finished or request_id in self.aborts:
                self.running.discard(request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running)

    def shutdown(self) -> None:
        self.errored = True


def vllm_config(**kv_events: Any) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=32, num_gpu_blocks=1234),
        scheduler_config=SimpleNamespace(max_num_seqs=16, max_num_batched_tokens=2048),
        model_config=SimpleNamespace(max_model_len=4096),
        parallel_config=SimpleNamespace(data_parallel_rank=None),
        kv_events_config=kv_events or None,
    )


class Replies:
    """A request plane ``reply``: what the worker sent, and an event set by each message."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.arrived = asyncio.Event()

    async def __call__(self, message: Any) -> None:
        self.sent.append(message)
        self.arrived.set()


def runtime(engine: FakeAsyncLLM) -> VllmRuntime:
    return VllmRuntime(engine, FAKE_API, ImageFetcher())


async def steps(rt: VllmRuntime, req: PreprocessedRequest) -> list[Any]:
    return [step async for step in rt.generate(req)]


# -- translate -------------------------------------------------------------------------------------


def test_engine_flags_get_the_model_path_unless_they_name_a_model() -> None:
    assert engine_argv("/m", ["--block-size", "32"]) == ["--model", "/m", "--block-size", "32"]
    assert engine_argv("/m", ["--model", "/other"]) == ["--model", "/other"]
    assert engine_argv("/m", ["--model=/other", "--seed", "0"]) == ["--model=/other", "--seed", "0"]
    assert engine_argv("/m", ["--model-impl", "vllm"])[:2] == ["--model", "/m"]


def test_sampling_fields_put_the_request_over_the_generation_config() -> None:
    fields = sampling_fields(request(top_p=0.5, temperature=0.0, seed=7), {"temperature": 0.6, "top_k": 20})
    assert fields == {
        "temperature": 0.0,  # sent: wins over the default, even when falsy
        "top_p": 0.5,
        "top_k": 20,  # left out: the model's generation_config
        "seed": 7,
        "max_tokens": 16,  # always set (vLLM's default is 16 whatever the request)
        "stop_token_ids": [EOS],
        "ignore_eos": False,
        "detokenize": False,  # ids out: stop strings stay in the frontend
    }


def test_stop_ids_are_the_client_s_then_the_model_s_eos_unless_ignored() -> None:
    assert sampling_fields(request(stop_ids=[7, EOS, 7]), {})["stop_token_ids"] == [7, EOS]
    ignored = sampling_fields(request(stop_ids=[7], ignore_eos=True), {})
    assert (ignored["stop_token_ids"], ignored["ignore_eos"]) == ([7], True)


def test_min_tokens_only_when_asked() -> None:
    req = request()
    assert "min_tokens" not in sampling_fields(req, {})
    req.stop_conditions.min_tokens = 3
    assert sampling_fields(req, {})["min_tokens"] == 3


def test_a_structured_output_constraint_is_vllm_s_structured_outputs_params() -> None:
    """Structured outputs (docs/structured-outputs.md): ``json`` (the schema's JSON text) or
    ``json_object``; a free-text request has none (``StructuredOutputsParams`` refuses no constraint)."""
    schema = '{"type": "object", "required": ["a"]}'
    assert structured_fields(request(structured=StructuredOutput(json_schema=schema))) == {"json": schema}
    assert structured_fields(request(structured=StructuredOutput(json_object=True))) == {"json_object": True}
    assert structured_fields(request()) is None


def test_deltas_merged_deltas_and_empty_deltas_become_steps() -> None:
    reader = OutputReader(request())
    got = [
        reader.step(output)
        for output in (
            out([11], cached=32),
            out([12, 13], cached=32),
            out([], cached=32),
            out([14, EOS], "stop", cached=32),
        )
    ]
    assert [s.token_ids for s in got] == [[11], [12, 13], [], [14]]  # the EOS vLLM returns is dropped
    assert [s.completion_tokens for s in got] == [1, 3, 3, 5]  # and counted, as vLLM counts it
    assert [s.finish_reason for s in got] == [None, None, None, "stop"]
    assert {(s.prompt_tokens, s.cached_tokens) for s in got} == {(5, 32)}


def test_a_client_stop_id_is_dropped_but_not_a_length_cut_or_a_repetition_stop() -> None:
    assert OutputReader(request(stop_ids=[42])).step(out([9, 42], "stop", stop_reason=42)).token_ids == [9]
    assert OutputReader(request()).step(out([9, EOS], "length")).token_ids == [9, EOS]
    repetition = OutputReader(request()).step(out([9, 9], "repetition"))
    assert (repetition.token_ids, repetition.finish_reason) == ([9, 9], "stop")


@pytest.mark.parametrize(
    ("reason", "error", "code"),
    [("abort", EngineAbortedError, 503), ("error", EngineFailedError, 500), ("new", EngineFailedError, 500)],
)
def test_finish_reasons_that_are_no_answer_are_errors(reason: str, error: type[Exception], code: int) -> None:
    with pytest.raises(error) as raised:
        OutputReader(request()).step(out([], reason))
    assert raised.value.code == code  # type: ignore[attr-defined]


def test_images_go_in_prompt_order_with_their_uuids() -> None:
    refs = [ImageRef(url="data:a", uuid="u1"), ImageRef(url="data:b", uuid="u2")]
    fields = prompt_fields(request(images=refs), ["first", "second"], ["u1", "u2-bytes"])
    assert fields == {
        "prompt_token_ids": [1, 2, 3, 4, 5],
        "multi_modal_data": {"image": ["first", "second"]},
        "multi_modal_uuids": {"image": ["u1", "u2-bytes"]},  # the fetcher's, not the frontend's
    }
    assert prompt_fields(request(), [], []) == {"prompt_token_ids": [1, 2, 3, 4, 5]}


def test_engine_facts_are_read_from_the_running_engine_s_config() -> None:
    facts = engine_facts(vllm_config(enable_kv_cache_events=True))
    assert (facts.block_size, facts.total_kv_blocks, facts.max_num_seqs) == (32, 1234, 16)
    assert (facts.max_num_batched_tokens, facts.context_length, facts.data_parallel_rank) == (2048, 4096, 0)
    assert facts.kv_events_config == {"enable_kv_cache_events": True}


# -- runtime ---------------------------------------------------------------------------------------


async def test_a_request_becomes_one_generate_call_with_delta_output() -> None:
    engine = FakeAsyncLLM([out([11]), out([12, EOS], "stop")])
    got = await steps(runtime(engine), request(max_tokens=8))
    assert [s.token_ids for s in got] == [[11], [12]]
    ((prompt, params, request_id),) = engine.calls
    assert prompt == {"prompt_token_ids": [1, 2, 3, 4, 5]}
    assert params["output_kind"] == "DELTA" and params["max_tokens"] == 8
    assert params["temperature"] == 0.6  # the model's generation_config, under the request
    assert request_id.startswith("dp-")


async def test_a_constrained_request_s_sampling_params_carry_vllm_s_structured_outputs() -> None:
    engine = FakeAsyncLLM([out([11, EOS], "stop")])
    await steps(runtime(engine), request(structured=StructuredOutput(json_schema='{"type": "object"}')))
    ((_, params, _),) = engine.calls
    assert params["structured_outputs"] == ("StructuredOutputsParams", {"json": '{"type": "object"}'})
    free = FakeAsyncLLM([out([11, EOS], "stop")])
    await steps(runtime(free), request())
    assert "structured_outputs" not in free.calls[0][1]


async def test_request_ids_are_never_reused_in_a_process() -> None:
    engine = FakeAsyncLLM([out([1], "length")])
    rt = runtime(engine)
    for _ in range(3):
        await steps(rt, request())
    assert len({call[2] for call in engine.calls}) == 3


async def test_closing_the_stream_aborts_the_request_in_the_engine_exactly_once() -> None:
    engine = FakeAsyncLLM([out([11]), out([12])], hold=True)
    stream = runtime(engine).generate(request())
    assert (await anext(stream)).token_ids == [11]
    assert engine.get_num_unfinished_requests() == 1
    await stream.aclose()
    assert engine.aborts == [engine.calls[0][2]]
    assert engine.get_num_unfinished_requests() == 0


async def test_a_cancel_on_the_request_plane_aborts_the_right_request_once() -> None:
    engine = FakeAsyncLLM([out([11])], hold=True)
    rt = runtime(engine)
    server = GenerationServer(rt.generate, check=rt.check)
    reply = Replies()
    sent, first = reply.sent, reply.arrived
    other = FakeAsyncLLM([out([11])], hold=True)
    bystander = GenerationServer(runtime(other).generate)
    await bystander.on_generate(
        Generate(request_id="keep", request=request(), deadline_ms=now_ms() + 60_000), reply
    )
    await server.on_generate(
        Generate(request_id="r1", request=request(), deadline_ms=now_ms() + 60_000), reply
    )
    await asyncio.wait_for(first.wait(), 5)
    await asyncio.wait_for(_until(lambda: len(engine.calls) == 1 and len(other.calls) == 1), 5)
    await server.on_cancel(Cancel(request_id="r1"), reply)
    await asyncio.wait_for(_until(lambda: server.in_flight == 0), 5)
    assert engine.aborts == [engine.calls[0][2]]
    assert other.aborts == [] and bystander.in_flight == 1
    final = [m for m in sent if isinstance(m, Output) and m.request_id == "r1" and m.finish_reason]
    assert [m.finish_reason for m in final] == ["cancelled"]
    await bystander.drain(0)


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.001)  # polling a condition (deadline: the caller's wait_for)


@pytest.mark.parametrize(
    ("raised", "error", "code"),
    [
        (ClientError("top_k must be 0 (disable), or at least 1, got -5."), EngineContractError, 400),
        (
            ValueError("The decoder prompt (length 9000) is longer than the maximum model length"),
            EngineContractError,
            400,
        ),
        (BusyError("queue full"), EngineAbortedError, 503),
        (DeadError(), EngineDeadError, 503),
    ],
)
async def test_engine_errors_become_the_worker_s_statuses(
    raised: Exception, error: type[Exception], code: int
) -> None:
    engine = FakeAsyncLLM(raised)
    rt = runtime(engine)
    with pytest.raises(error) as got:
        await steps(rt, request())
    assert got.value.code == code  # type: ignore[attr-defined]
    if code == 400:
        assert str(got.value) == str(raised)  # the engine's own words
    if isinstance(raised, DeadError):
        assert await asyncio.wait_for(rt.wait_dead(), 5) == "engine_core_dead"


async def test_an_engine_refusal_reaches_the_frontend_as_a_400_with_its_message() -> None:
    rt = runtime(FakeAsyncLLM(ClientError("min_p must be in [0, 1], got 2.")))
    server = GenerationServer(rt.generate, check=rt.check)
    reply = Replies()
    sent, done = reply.sent, reply.arrived
    await server.on_generate(
        Generate(request_id="r", request=request(), deadline_ms=now_ms() + 60_000), reply
    )
    await asyncio.wait_for(done.wait(), 5)
    assert sent == [ErrorReply(request_id="r", code=400, message="min_p must be in [0, 1], got 2.")]


def test_n_other_than_one_is_refused_before_the_engine() -> None:
    rt = runtime(FakeAsyncLLM([]))
    with pytest.raises(EngineContractError, match="n must be 1"):
        rt.check(request(n=2))
    rt.check(request())


async def test_images_are_fetched_decoded_and_handed_over_in_order() -> None:
    urls = [_png_url(3, 2), _png_url(5, 4)]
    refs = [ImageRef(url=url, uuid=image_uuid(url)) for url in urls]
    engine = FakeAsyncLLM([out([1], "length")])
    await steps(runtime(engine), request(images=refs))
    prompt = engine.calls[0][0]
    assert [image.size for image in prompt["multi_modal_data"]["image"]] == [(3, 2), (5, 4)]
    # data: URLs are their own bytes: the engine gets the frontend's uuid of each
    assert prompt["multi_modal_uuids"] == {"image": [image_uuid(url) for url in urls]}


async def test_a_bad_image_is_a_400_naming_it_before_the_engine_sees_anything() -> None:
    engine = FakeAsyncLLM([out([1], "length")])
    refs = [ImageRef(url=_png_url(2, 2), uuid="a"), ImageRef(url="file:///etc/passwd", uuid="b")]
    with pytest.raises(EngineContractError, match="image 2 of 2") as raised:
        await steps(runtime(engine), request(images=refs))
    assert raised.value.code == 400
    assert engine.calls == []


def _png_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_kimi_k3_worker_counts_the_placeholder_runs_against_the_images() -> None:
    """vLLM's Kimi-K3 processor expands the checkpoint placeholder; the worker refuses a prompt whose
    runs of its ids differ from the images (tests/test_k3_vllm_placeholder.py has the shapes)."""
    rt = VllmRuntime(FakeAsyncLLM([]), FAKE_API, ImageFetcher(), "kimi-k3-demo")
    pattern = Tokenizer.from_model_dir("kimi-k3-demo").encode(
        "<|kimi_image_placeholder|>", allow_special=False
    )
    one_image = [ImageRef(url=_png_url(2, 2), uuid="a")]
    rt.check(replace(request(images=one_image), token_ids=[1, *pattern, 2]))
    with pytest.raises(EngineContractError, match="Expected 1 occurrence"):
        rt.check(replace(request(images=one_image), token_ids=[1, *pattern, *pattern]))
    runtime(FakeAsyncLLM([])).check(replace(request(images=one_image), token_ids=[1, 2]))  # not K3


# -- logprobs --------------------------------------------------------------------------------------


@dataclass
class Logprob:
    """vLLM's ``Logprob``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_request(top: int | None) -> PreprocessedRequest:
    asked = OutputOptions(logprobs=top is not None, top_logprobs=top)
    return replace(request(stop_ids=[42]), output_options=asked)


def test_logprobs_are_asked_as_logprobs_k() -> None:
    assert "logprobs" not in sampling_fields(request(), {})
    assert sampling_fields(logprob_request(3), {})["logprobs"] == 3
    assert sampling_fields(logprob_request(0), {})["logprobs"] == 0  # the sampled token's only


def test_delta_logprobs_become_one_record_per_visible_token() -> None:
    reader = OutputReader(logprob_request(2))
    first = out([11])
    # vLLM's dict per position: the sampled id (its own rank, 4 here: outside the top 2) and the top k
    first.outputs[0].logprobs = [{11: Logprob(-2.0, 4), 7: Logprob(-0.5, 1), 9: Logprob(-1.0, 2)}]
    last = out([12, 42], "stop", stop_reason=42)
    last.outputs[0].logprobs = [
        {12: Logprob(-0.25, 1), 3: Logprob(-2.0, 2)},
        {42: Logprob(-0.1, 1), 4: Logprob(-3.0, 2)},
    ]
    steps = [reader.step(first), reader.step(last)]
    assert steps[0].logprobs == [TokenLogprob(-2.0, ((7, -0.5), (9, -1.0)))]
    assert (steps[1].token_ids, steps[1].logprobs) == ([12], [TokenLogprob(-0.25, ((12, -0.25), (3, -2.0)))])
    assert OutputReader(request()).step(first).logprobs is None  # not asked: none


def test_logprobs_vllm_did_not_give_for_every_token_are_none() -> None:
    reader = OutputReader(logprob_request(0))
    short = out([11, 12])
    short.outputs[0].logprobs = [{11: Logprob(-0.5, 1)}]
    assert reader.step(short).logprobs is None
    assert reader.step(out([13])).logprobs is None
    wrong = out([14])
    wrong.outputs[0].logprobs = [{15: Logprob(-0.5, 1)}]  # not the sampled id
    assert reader.step(wrong).logprobs is None
    fine = out([16])
    fine.outputs[0].logprobs = [{16: Logprob(-0.5, 3)}]
    assert reader.step(fine).logprobs == [TokenLogprob(-0.5, ())]
