"""The mock engine: each flavor's real image contract on real preprocessed requests, and its reply."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from support.logs import until

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.base import EngineContractError
from dynamo_prep.engines.mock.engine import MockEngine, MockOutput
from dynamo_prep.engines.mock.prompt import count_occurrences
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.preprocessed import PreprocessedRequest

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
QUESTION = "What differs between these two pictures?"
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "An earlier question."},
    {"role": "assistant", "content": "An earlier answer."},
    {"role": "user", "content": [IMAGE, {"type": "text", "text": QUESTION}, IMAGE]},
]


@pytest.fixture(scope="module")
def engines() -> dict[tuple[str, str], MockEngine]:
    return {
        (model, flavor): MockEngine(model, flavor=flavor, reply_format="echo")
        for model in ("kimi-k3-demo", "qwen-vl-demo")
        for flavor in ("sglang", "vllm")
    }


def preprocess(
    model: str, declared: str | None, messages: list[dict[str, Any]] = MESSAGES, **fields: Any
) -> PreprocessedRequest:
    """A real request, rendered for a worker that declares ``declared``."""
    card = ModelDeploymentCard.from_model_dir(
        model, runtime_config=ModelRuntimeConfig(image_placeholder_token=declared)
    )
    preprocessor = OpenAIPreprocessor.new(card, model)
    return preprocessor.preprocess({"model": model, "messages": messages, **fields})


def rendered_for(engine: MockEngine, **fields: Any) -> PreprocessedRequest:
    return preprocess(engine.name, engine.declared_image_token, **fields)


async def collect(engine: MockEngine, request: PreprocessedRequest) -> list[MockOutput]:
    return [output async for output in engine.generate(request)]


def reply_of(engine: MockEngine, outputs: list[MockOutput]) -> str:
    return engine.tokenizer.decode([token_id for output in outputs for token_id in output.token_ids])


# --- declarations --------------------------------------------------------------------------------


def test_declared_tokens(engines: dict[tuple[str, str], MockEngine]) -> None:
    assert engines["kimi-k3-demo", "sglang"].declared_image_token == "<|media_pad|>"
    assert engines["kimi-k3-demo", "vllm"].declared_image_token is None
    assert engines["qwen-vl-demo", "sglang"].declared_image_token == (
        "<|vision_start|><|image_pad|><|vision_end|>"
    )
    assert engines["qwen-vl-demo", "vllm"].declared_image_token is None


def test_unknown_flavor_reply_format_and_negative_delay_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown mock engine flavor"):
        MockEngine("kimi-k3-demo", flavor="trtllm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_delay_s"):
        MockEngine("kimi-k3-demo", flavor="vllm", token_delay_s=-1)
    with pytest.raises(ValueError, match="unknown reply format 'xml'"):
        MockEngine("kimi-k3-demo", flavor="vllm", reply_format="xml")  # type: ignore[arg-type]


# --- the contracts -------------------------------------------------------------------------------


async def test_sglang_accepts_media_pad_and_rejects_the_checkpoint_default(
    engines: dict[tuple[str, str], MockEngine],
) -> None:
    engine = engines["kimi-k3-demo", "sglang"]
    engine.check_contract(preprocess("kimi-k3-demo", "<|media_pad|>"))
    wrong = preprocess("kimi-k3-demo", None)
    with structlog.testing.capture_logs() as logs, pytest.raises(EngineContractError) as raised:
        engine.check_contract(wrong)
    assert str(raised.value) == "Expected 2 image placeholder token(s), found 0"
    assert logs == [
        {
            "event": "mock_contract_violation",
            "log_level": "warning",
            "flavor": "sglang",
            "model": "kimi-k3-demo",
            "expected": 2,
            "found": 0,
        }
    ]
    with pytest.raises(EngineContractError, match=r"^Expected 2 image placeholder token\(s\), found 0$"):
        await collect(engine, wrong)


async def test_vllm_accepts_the_checkpoint_default_and_rejects_media_pad(
    engines: dict[tuple[str, str], MockEngine],
) -> None:
    engine = engines["kimi-k3-demo", "vllm"]
    engine.check_contract(preprocess("kimi-k3-demo", None))
    wrong = preprocess("kimi-k3-demo", "<|media_pad|>")
    with structlog.testing.capture_logs() as logs, pytest.raises(EngineContractError) as raised:
        engine.check_contract(wrong)
    message = str(raised.value)
    assert message.startswith(
        "Expected 2 occurrence(s) of the image placeholder '<|kimi_image_placeholder|>'"
    )
    assert message.endswith("found 0")
    assert [(entry["event"], entry["expected"], entry["found"]) for entry in logs] == [
        ("mock_contract_violation", 2, 0)
    ]
    with pytest.raises(EngineContractError):
        await collect(engine, wrong)


def test_vllm_counts_the_shattered_placeholder_sequence(
    engines: dict[tuple[str, str], MockEngine],
) -> None:
    engine = engines["kimi-k3-demo", "vllm"]
    request = preprocess("kimi-k3-demo", None)
    pattern = engine.tokenizer.encode("<|kimi_image_placeholder|>")
    assert len(pattern) > 1
    assert count_occurrences(request.token_ids, pattern) == 2
    three_images = msgspec.structs.replace(request, images=[*request.images, request.images[0]])
    with pytest.raises(EngineContractError, match=r"found 2$"):
        engine.check_contract(three_images)


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_qwen_vl_is_accepted_by_both_flavors(
    engines: dict[tuple[str, str], MockEngine], flavor: str
) -> None:
    engine = engines["qwen-vl-demo", flavor]
    request = rendered_for(engine)
    engine.check_contract(request)
    assert reply_of(engine, await collect(engine, request)).endswith(f"You said: {QUESTION}")
    missing_image = msgspec.structs.replace(request, images=request.images[:1])
    with pytest.raises(EngineContractError, match=r"Expected 1 .*found 2"):
        engine.check_contract(missing_image)


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_a_text_only_model_rejects_any_image(tmp_path: Path, flavor: str) -> None:
    model_dir = tmp_path / "qwen-text"
    shutil.copytree(DEMO_MODELS_DIR / "qwen-vl-demo", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    engine = MockEngine(model_dir, flavor=flavor, reply_format="echo")
    assert engine.declared_image_token is None
    text_only = preprocess("qwen-vl-demo", None, [{"role": "user", "content": "hi"}])
    engine.check_contract(text_only)
    with pytest.raises(EngineContractError, match="takes no images"):
        engine.check_contract(preprocess("qwen-vl-demo", None))


# --- the reply -----------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_reply_is_deterministic_and_states_what_arrived(
    engines: dict[tuple[str, str], MockEngine], flavor: str
) -> None:
    engine = engines["kimi-k3-demo", flavor]
    request = rendered_for(engine)
    first = await collect(engine, request)
    assert await collect(engine, request) == first
    prompt_tokens = len(request.token_ids)
    assert reply_of(engine, first) == (
        f"[mock {flavor}] 2 image(s), {prompt_tokens} prompt tokens. You said: {QUESTION}"
    )
    assert all(len(output.token_ids) == 1 for output in first)
    assert [output.finish_reason for output in first] == [None] * (len(first) - 1) + ["stop"]
    assert [output.completion_tokens for output in first] == list(range(1, len(first) + 1))
    assert {output.prompt_tokens for output in first} == {prompt_tokens}


def test_echo_keeps_typed_control_text_and_drops_only_real_image_tokens(
    engines: dict[tuple[str, str], MockEngine],
) -> None:
    typed = "look: <|media_pad|> and <|close|> are just text"
    messages = [{"role": "user", "content": [IMAGE, {"type": "text", "text": typed}]}]
    engine = engines["kimi-k3-demo", "sglang"]
    request = preprocess("kimi-k3-demo", "<|media_pad|>", messages)
    engine.check_contract(request)
    assert engine.reply_text(request).endswith(f"You said: {typed}")


def test_echo_is_truncated(engines: dict[tuple[str, str], MockEngine]) -> None:
    engine = engines["kimi-k3-demo", "vllm"]
    request = preprocess("kimi-k3-demo", None, [{"role": "user", "content": "word " * 100}])
    said = engine.reply_text(request).split("You said: ", 1)[1]
    assert len(said) == 200
    assert said.endswith("...")


async def test_max_tokens_finishes_with_length(engines: dict[tuple[str, str], MockEngine]) -> None:
    engine = engines["kimi-k3-demo", "sglang"]
    outputs = await collect(engine, rendered_for(engine, max_tokens=5))
    assert len(outputs) == 5
    assert sum(len(output.token_ids) for output in outputs) == 5
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].completion_tokens == 5


def with_stop_strings(request: PreprocessedRequest, stop: list[str]) -> PreprocessedRequest:
    """Dynamo's ``stop`` field set by hand: this frontend applies stop strings itself and leaves it
    empty, but an engine (the mock included) honours it."""
    conditions = msgspec.structs.replace(request.stop_conditions, stop=stop)
    return msgspec.structs.replace(request, stop_conditions=conditions)


async def test_a_stop_string_cuts_the_reply(engines: dict[tuple[str, str], MockEngine]) -> None:
    engine = engines["kimi-k3-demo", "vllm"]
    request = with_stop_strings(rendered_for(engine), ["You said"])
    outputs = await collect(engine, request)
    reply = reply_of(engine, outputs)
    full = engine.reply_text(request)
    assert "You said" not in reply
    assert full.startswith(reply)
    assert reply.startswith("[mock vllm] 2 image(s)")
    assert outputs[-1].finish_reason == "stop"


async def test_a_stop_string_inside_a_token_drops_that_token(
    engines: dict[tuple[str, str], MockEngine],
) -> None:
    engine = engines["qwen-vl-demo", "sglang"]
    outputs = await collect(engine, with_stop_strings(rendered_for(engine), ["mag"]))  # inside "image"
    reply = reply_of(engine, outputs)
    assert "mag" not in reply
    assert reply.startswith("[mock sglang] 2")
    assert outputs[-1].finish_reason == "stop"


async def test_cancellation_stops_the_generator_promptly() -> None:
    engine = MockEngine("kimi-k3-demo", flavor="sglang", token_delay_s=0.05, reply_format="echo")
    request = rendered_for(engine)
    received: list[MockOutput] = []

    async def consume() -> None:
        async for output in engine.generate(request):
            received.append(output)

    task = asyncio.create_task(consume())
    await until(lambda: received, "a token from the mock engine")  # the generator is running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=30)
    count = len(received)
    await asyncio.sleep(0.12)  # an observation window of two token delays
    assert len(received) == count


async def test_cancellation_without_delay_is_still_honoured(
    engines: dict[tuple[str, str], MockEngine],
) -> None:
    engine = engines["kimi-k3-demo", "vllm"]
    request = rendered_for(engine)
    received: list[MockOutput] = []

    async def consume() -> None:
        async for output in engine.generate(request):
            received.append(output)

    task = asyncio.create_task(consume())
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(received) < len(engine.tokenizer.encode(engine.reply_text(request)))
