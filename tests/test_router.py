"""Routing: round robin, one preprocessor per declaration, and a real mixed vLLM + SGLang pool.

The pool test runs a ``dynamo-prep frontend`` with one sglang-flavored and one vllm-flavored mock
worker of kimi-k3-demo. The mocks enforce each engine's real contract, so every image request
that succeeds proves its worker got exactly its own placeholder; the prompt token counts in the
replies are checked against what each declaration renders locally.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.images import png_data_url
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.discovery.catalog import LiveModel
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.routing.round_robin import RoundRobin

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
KIMI_DEFAULT = "<|kimi_image_placeholder|>"
IMAGE = {"type": "image_url", "image_url": {"url": png_data_url()}}  # a real picture: workers decode it
REPLY = re.compile(r"^\[mock (\w+)\] (\d+) image\(s\), (\d+) prompt tokens\.")


def live_model(declared: str | None, instances: dict[str, str | None]) -> LiveModel:
    """kimi-k3-demo built for ``declared`` (the canonical card), with instances declaring their own."""
    directory = resolve_model_dir(DEMO)
    card = ModelDeploymentCard.from_model_dir(
        directory, runtime_config=ModelRuntimeConfig(image_placeholder_token=declared)
    )
    records = {
        instance_id: Instance(
            instance_id=instance_id, endpoint=f"tcp://127.0.0.1:{9000 + index}", declared_token=token
        )
        for index, (instance_id, token) in enumerate(instances.items())
    }
    return LiveModel(
        DEMO, card, card.mdcsum(), OpenAIPreprocessor.new(card, directory), records, model_dir=directory
    )


def test_round_robin_over_live_instances_skipping_excluded() -> None:
    model = live_model(MEDIA_PAD, {"a": MEDIA_PAD, "b": MEDIA_PAD, "c": MEDIA_PAD})
    router = RoundRobin()
    picks = [router.pick(model) for _ in range(6)]
    assert [pick.instance_id for pick in picks if pick] == ["a", "b", "c", "a", "b", "c"]
    assert {router.pick(model, excluded={"a", "b"}).instance_id for _ in range(3)} == {"c"}  # type: ignore[union-attr]
    assert router.pick(model, excluded=set(model.instances)) is None


def test_a_mixed_pool_renders_each_declaration_with_a_shared_tokenizer() -> None:
    model = live_model(MEDIA_PAD, {"sg": MEDIA_PAD, "vl": None})
    router = RoundRobin()
    declarations = DeclarationPreprocessors()
    assert model.composition() == {MEDIA_PAD: 1, "checkpoint default": 1}
    assert {router.pick(model).declared_token for _ in range(2)} == {MEDIA_PAD, None}  # type: ignore[union-attr]
    sglang = declarations.build(model, MEDIA_PAD)
    assert declarations.get(model, None) is None  # not built yet
    vllm = declarations.build(model, None)
    assert sglang is model.preprocessor  # the canonical declaration needs no build
    assert declarations.get(model, None) is vllm  # cached
    assert vllm.tokenizer is sglang.tokenizer
    tokenizer = sglang.tokenizer
    pad_id = tokenizer.special_tokens[MEDIA_PAD]
    shattered = tokenizer.encode(KIMI_DEFAULT)
    assert len(shattered) > 1
    body = {
        "model": DEMO,
        "messages": [{"role": "user", "content": [IMAGE, IMAGE, {"type": "text", "text": "x"}]}],
    }
    to_sglang = sglang.preprocess(body).token_ids
    to_vllm = vllm.preprocess(body).token_ids
    assert to_sglang.count(pad_id) == 2 and pad_id not in to_vllm
    assert _occurrences(to_vllm, shattered) == 2 and _occurrences(to_sglang, shattered) == 0


def _occurrences(ids: list[int], pattern: list[int]) -> int:
    return sum(
        1 for start in range(len(ids) - len(pattern) + 1) if ids[start : start + len(pattern)] == pattern
    )


# -- a real mixed pool ------------------------------------------------------------------------------


@pytest.fixture
def mixed_pool(tmp_path: Path) -> Iterator[tuple[str, DynamoProcess, dict[str, DynamoProcess]]]:
    port, discovery = free_port(), tcp_endpoint()
    procs: list[DynamoProcess] = []
    try:
        frontend = start_dynamo(
            "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
            "--cache-dir", str(tmp_path / "cache"), log_level="info",
        )  # fmt: skip
        procs.append(frontend)
        workers = {}
        for flavor in ("sglang", "vllm"):
            args = ("--model-path", DEMO, "--discovery", discovery, "--flavor", flavor, "--token-delay", "0")
            worker = start_dynamo("worker", *args, log_level="debug")
            procs.append(worker)
            workers[flavor] = worker
        frontend.wait_event("pool_composition_changed", timeout=20, mixed=True)
        yield f"http://127.0.0.1:{port}", frontend, workers
    finally:
        for proc in procs:
            proc.stop()


def test_mixed_pool_alternates_and_each_worker_gets_its_contract(
    mixed_pool: tuple[str, DynamoProcess, dict[str, DynamoProcess]],
) -> None:
    url, frontend, workers = mixed_pool
    [mixed] = frontend.find("pool_composition_changed", mixed=True)
    assert mixed["composition"] == {MEDIA_PAD: 1, "checkpoint default": 1}
    assert mixed["model"] == DEMO
    model = live_model(MEDIA_PAD, {})
    declarations = DeclarationPreprocessors()
    body = {
        "model": DEMO,
        "messages": [{"role": "user", "content": [IMAGE, IMAGE, {"type": "text", "text": "two"}]}],
    }
    expected = {
        "sglang": len(declarations.build(model, MEDIA_PAD).preprocess(body).token_ids),
        "vllm": len(declarations.build(model, None).preprocess(body).token_ids),
    }
    assert expected["vllm"] > expected["sglang"]  # each image is one pad id vs a shattered placeholder
    flavors = []
    with httpx.Client(base_url=url, timeout=20, trust_env=False) as http:
        wait_for(lambda: DEMO in http.get("/health").json()["models"], 10, message="model live")
        for _ in range(6):
            answer = http.post("/v1/chat/completions", content=json.dumps(body))
            assert answer.status_code == 200, answer.text
            content = answer.json()["choices"][0]["message"]["content"]
            match = REPLY.match(content)
            assert match is not None, content
            flavor, images, prompt_tokens = match[1], int(match[2]), int(match[3])
            assert images == 2
            assert prompt_tokens == expected[flavor] == answer.json()["usage"]["prompt_tokens"]
            flavors.append(flavor)
    assert flavors in (["sglang", "vllm"] * 3, ["vllm", "sglang"] * 3)
    for worker in workers.values():
        # the worker's log lines are read on a thread of their own: wait for them, do not race them
        wait_for(lambda w=worker: len(w.find("mock_generate_started", images=2)) >= 3, 20, message="logs")
        assert not worker.find("mock_contract_violation")
        assert len(worker.find("mock_generate_started", images=2)) == 3
    sglang_prompt = workers["sglang"].find("mock_generate_started")[0]["prompt_tokens"]
    assert sglang_prompt == expected["sglang"]
