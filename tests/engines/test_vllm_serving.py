"""A real vLLM behind two ``dynamo-prep worker --engine vllm`` and a real frontend, through the
official openai client: answers, usage, streams, stop ids, cancel, KV routing, engine errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import BLOCK_SIZE, MODEL, Cluster
from support.plane import wait_for

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.frontend.client import RequestPlaneClient, WorkerError
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.preprocessed import PreprocessedRequest, SamplingOptions
from dynamo_prep.protocol.wire import Output

LONG = 1500  # tokens: several seconds of generation on the CPU, far longer than any check takes


def chat(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def engine_sum(cluster: Cluster, prefix: str) -> float:
    return sum(worker.metric(prefix) for worker in cluster.workers if worker.process.process.poll() is None)


def served_by(cluster: Cluster, completion_id: str) -> dict[str, Any]:
    """The frontend's request_finished line of a response (its id is chatcmpl-<request id>)."""
    request_id = completion_id.removeprefix("chatcmpl-")
    return cluster.frontend.wait_event("request_finished", timeout=30, request_id=request_id)


def test_an_answer_and_its_usage_are_the_engines(vllm_cluster: Cluster) -> None:
    """Usage is what vLLM itself counted (its own vllm:* counters), and a repeated prompt reports
    vLLM's prefix-cache hits as prompt_tokens_details.cached_tokens."""
    prompt = [chat("Tell me about the sea, the wind and the boats. " * 12)]
    before = (
        engine_sum(vllm_cluster, "vllm:prompt_tokens_total"),
        engine_sum(vllm_cluster, "vllm:generation_tokens_total"),
    )
    answer = vllm_cluster.client().chat.completions.create(
        model=MODEL, messages=prompt[0], max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].finish_reason == "length"
    usage = answer.usage
    assert usage is not None and usage.completion_tokens == 24
    assert usage.prompt_tokens > 100
    wait_for(
        lambda: (
            (
                engine_sum(vllm_cluster, "vllm:prompt_tokens_total") - before[0],
                engine_sum(vllm_cluster, "vllm:generation_tokens_total") - before[1],
            )
            == (usage.prompt_tokens, usage.completion_tokens)
        ),
        30,
        message="the engine's own token counters to match the usage",
    )
    hits_before = engine_sum(vllm_cluster, "vllm:prefix_cache_hits_total")
    again = vllm_cluster.client().chat.completions.create(model=MODEL, messages=prompt[0], max_tokens=4)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= BLOCK_SIZE and cached % BLOCK_SIZE == 0
    wait_for(
        lambda: engine_sum(vllm_cluster, "vllm:prefix_cache_hits_total") - hits_before == cached,
        30,
        message="the engine's prefix-cache hit counter to match cached_tokens",
    )


@pytest.mark.parametrize("max_tokens", [1, 16, 100])
def test_short_streams_are_whole(vllm_cluster: Cluster, max_tokens: int) -> None:
    stream = vllm_cluster.client().chat.completions.create(
        model=MODEL,
        messages=chat(f"Count to {max_tokens}."),
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == max_tokens


def test_a_stream_s_first_content_arrives_while_the_engine_still_generates(vllm_cluster: Cluster) -> None:
    """The answer is not held back: when the client holds the first visible delta, the engine
    (its own count of unfinished requests) is still generating the rest."""
    for attempt in range(3):
        stream = vllm_cluster.client().chat.completions.create(
            model=MODEL,
            messages=chat(f"Write a long story, number {attempt}."),
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with stream:
            first = next(iter(stream))
            assert first.choices[0].delta.role == "assistant"
            for chunk in stream:
                delta = chunk.choices[0].delta
                if delta.content or delta.tool_calls or getattr(delta, "reasoning_content", None):
                    break
            assert engine_sum(vllm_cluster, "dynamo_worker_engine_unfinished_requests") == 1
        wait_for(lambda: engine_sum(vllm_cluster, "dynamo_worker_engine_unfinished_requests") == 0, 30)


def test_a_cancelled_stream_leaves_the_engine_with_nothing_unfinished(vllm_cluster: Cluster) -> None:
    stream = vllm_cluster.client().chat.completions.create(
        model=MODEL,
        messages=chat("Go on forever."),
        max_tokens=LONG,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    wait_for(lambda: engine_sum(vllm_cluster, "dynamo_worker_engine_unfinished_requests") == 1, 30)
    stream.close()  # the client goes away mid-stream
    wait_for(
        lambda: (
            engine_sum(vllm_cluster, "dynamo_worker_engine_unfinished_requests") == 0
            and engine_sum(vllm_cluster, "vllm:num_requests_running") == 0
        ),
        30,
        message="the engine to abort the cancelled request",
    )


def preprocessed(model_dir: Path, text: str, **fields: Any) -> PreprocessedRequest:
    """The request the frontend would send for a one-message chat (built here, for the request plane)."""
    card = ModelDeploymentCard.from_model_dir(model_dir)
    return OpenAIPreprocessor.new(card, model_dir).preprocess(
        {"model": MODEL, "messages": chat(text), **fields}
    )


def first_endpoint(cluster: Cluster) -> str:
    """The first worker's request-plane endpoint."""
    endpoint: str = cluster.workers[0].process.find("worker_started")[0]["endpoint"]
    return endpoint


async def _greedy_ids(cluster: Cluster, model_dir: Path, text: str, max_tokens: int) -> list[int]:
    """The ids a worker's engine generates greedily, read on the request plane (a worker's endpoint)."""
    request = preprocessed(model_dir, text, max_tokens=max_tokens, temperature=0)
    endpoint = first_endpoint(cluster)
    plane = RequestPlaneClient()
    try:
        outputs: list[Output] = [
            o async for o in plane.generate(endpoint, request, request_id="greedy-ids", timeout_s=60)
        ]
    finally:
        await plane.close()
    return [token for output in outputs for token in output.token_ids]


async def test_a_stop_id_is_trimmed_from_the_answer_and_counted_in_usage(
    vllm_cluster: Cluster, engine_model: Path
) -> None:
    """The same greedy answer with one of its ids as a stop id ends just before it: the id vLLM
    returns as the last one is not content, and usage counts it as the engine does. Both workers
    load the same dummy weights (--seed 0), so it does not matter where a request is routed."""
    text = "Say something, anything."
    ids = await _greedy_ids(vllm_cluster, engine_model, text, 8)
    assert len(ids) == 8
    cut = next(index for index in range(1, 8) if ids[index] not in ids[:index])
    openai_client = vllm_cluster.client()
    shorter = openai_client.chat.completions.create(
        model=MODEL, messages=chat(text), max_tokens=cut, temperature=0, extra_body={"ignore_eos": True}
    )
    stopped = openai_client.chat.completions.create(
        model=MODEL,
        messages=chat(text),
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [ids[cut]]},
    )
    assert (shorter.choices[0].finish_reason, stopped.choices[0].finish_reason) == ("length", "stop")
    assert stopped.choices[0].message.content == shorter.choices[0].message.content
    assert stopped.usage is not None and stopped.usage.completion_tokens == cut + 1


def test_a_repeated_prefix_is_routed_by_the_engines_own_kv_events(vllm_cluster: Cluster) -> None:
    """The first request's prompt lands on one engine; its KV events (vLLM's own publisher, no
    relay) tell the frontend, so follow-ups sharing the prefix go to that engine."""
    preamble = "You are a careful assistant who answers about lighthouses. " * 30
    openai_client = vllm_cluster.client()
    first = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": preamble}, *chat("First question?")],
        max_tokens=2,
    )
    home = served_by(vllm_cluster, first.id)["instance_id"]
    prompt_blocks = served_by(vllm_cluster, first.id)["prompt_blocks"]
    assert prompt_blocks >= 10
    url = vllm_cluster.base_url.removesuffix("/v1") + "/metrics"

    def applied() -> float:
        text = httpx.get(url, timeout=10, trust_env=False).text
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith("dynamo_frontend_kv_blocks_applied_total")
        )

    wait_for(lambda: applied() >= prompt_blocks - 1, 30, message="the engine's BlockStored events")
    for turn in range(4):
        follow = openai_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": preamble}, *chat(f"Question {turn}, another one?")],
            max_tokens=2,
        )
        line = served_by(vllm_cluster, follow.id)
        assert line["instance_id"] == home
        assert line["kv_overlap_blocks"] >= prompt_blocks - 2


async def test_an_engine_validation_error_is_a_400_with_the_engine_s_message(
    vllm_cluster: Cluster, engine_model: Path
) -> None:
    """A request vLLM refuses (here a top_k it does not accept, sent on the request plane past the
    frontend's own checks) comes back as a 400 carrying vLLM's words; the engine keeps serving."""
    good = preprocessed(engine_model, "Hi", max_tokens=2)
    bad = PreprocessedRequest(
        model=good.model,
        token_ids=good.token_ids,
        stop_conditions=good.stop_conditions,
        sampling_options=SamplingOptions(top_k=-5),
        eos_token_ids=good.eos_token_ids,
    )
    endpoint = first_endpoint(vllm_cluster)
    plane = RequestPlaneClient()
    try:
        with pytest.raises(WorkerError) as refused:
            [o async for o in plane.generate(endpoint, bad, request_id="bad-top-k", timeout_s=60)]
        assert refused.value.code == 400
        assert "top_k" in refused.value.message
        outputs = [o async for o in plane.generate(endpoint, good, request_id="after-bad", timeout_s=60)]
        assert outputs[-1].finish_reason == "length"
    finally:
        await plane.close()


def test_the_card_carries_the_engine_s_own_figures(vllm_cluster: Cluster) -> None:
    """Block size, KV blocks, batch limits and context length come from the running engine."""
    started = vllm_cluster.workers[0].process.find("engine_started")[0]
    assert started["block_size"] == BLOCK_SIZE
    assert started["total_kv_blocks"] > 0
    assert started["max_num_seqs"] == 16
    assert started["context_length"] == 4096
    too_long = vllm_cluster.client()
    with pytest.raises(openai.BadRequestError) as refused:
        too_long.chat.completions.create(model=MODEL, messages=chat("word " * 5000), max_tokens=1)
    assert "4096" in str(refused.value)


def test_streams_at_concurrency_all_finish(vllm_cluster: Cluster) -> None:
    """Eight concurrent streams over two engines: every one whole."""
    import concurrent.futures  # noqa: PLC0415

    def one(index: int) -> int:
        stream = vllm_cluster.client().chat.completions.create(
            model=MODEL,
            messages=chat(f"Story {index}: " + "once upon a time " * index),
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        last = None
        for chunk in stream:
            last = chunk
        assert last is not None and last.usage is not None
        return last.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [64] * 8
