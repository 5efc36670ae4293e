"""Answers bounded (issue 25, rows 8 and 16): a budget on what a request's choices together may make
the frontend render and hold, logprobs rendered in slices with the event loop turning between them,
and ``/detokenize``'s ids counted before they are decoded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterator

import httpx
import msgspec
import openai
import pytest
from support.cluster import Cluster, mock_cluster, openai_client

from dynamo_prep.frontend.logprobs import PACE_ENTRIES, Pacer, paced
from dynamo_prep.preprocessor import MAX_ANSWER_ENTRIES, PreprocessError, validate_answer_budget
from dynamo_prep.protocol.openai import MAX_DETOKENIZE_TOKENS, ChatCompletionRequest
from dynamo_prep.protocol.wire import Output, TokenLogprob

QWEN = "qwen-vl-demo"
PROMPTS = [f"write on, part {index}" for index in range(128)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with mock_cluster(tmp_path_factory.mktemp("answers"), [("--model-path", QWEN)]) as running:
        yield running


def test_completions_over_the_answer_budget_are_a_400(cluster: Cluster) -> None:
    """The issue's request (1.9 KB: a 250 MB answer before) is refused before any work, naming
    ``max_tokens`` and the budget; the same batch without logprobs is served."""
    client = openai_client(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=QWEN, prompt=PROMPTS, max_tokens=8000, logprobs=20)
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "max_tokens"
    assert f"{MAX_ANSWER_ENTRIES:,}" in error["message"] and "128 choices" in error["message"]
    served = client.completions.create(model=QWEN, prompt=PROMPTS, max_tokens=8000)
    assert len(served.choices) == 128 and all(choice.text for choice in served.choices)
    with_logprobs = client.completions.create(model=QWEN, prompt=PROMPTS[:16], max_tokens=64, logprobs=5)
    assert all(choice.logprobs and choice.logprobs.tokens for choice in with_logprobs.choices)


def test_chat_choices_share_the_budget(cluster: Cluster) -> None:
    """n choices of a chat count together; no max_tokens counts the whole context."""
    chat = ChatCompletionRequest(model=QWEN, messages=[], n=16, logprobs=True, top_logprobs=20)
    context = MAX_ANSWER_ENTRIES // (16 * 23) + 1
    with pytest.raises(PreprocessError, match="no max_tokens") as raised:
        validate_answer_budget(chat, 16, context)
    assert raised.value.param == "max_tokens"
    validate_answer_budget(chat, 1, 10 * context)  # one choice: bounded by its context alone
    completion = ChatCompletionRequest(model=QWEN, messages=[], max_completion_tokens=context, n=16)
    validate_answer_budget(completion, 16, context)  # no logprobs: one entry a token
    many = msgspec.structs.replace(completion, logprobs=True, top_logprobs=20)
    with pytest.raises(PreprocessError) as raised:
        validate_answer_budget(many, 16, context)
    assert raised.value.param == "max_completion_tokens"
    answer = openai_client(cluster).chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": "hi"}],
        n=4,
        max_tokens=32,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(answer.choices) == 4 and all(choice.logprobs for choice in answer.choices)


def test_detokenize_counts_the_ids_before_decoding_them(cluster: Cluster) -> None:
    """2,000,000 ids (6 MB) are refused by their count: a bad last id is never reached (it used to
    be decoded with all the others, on the event loop); /live answers meanwhile."""
    ids = b",".join(b"%d" % (index % 100) for index in range(2_000_000 - 1))
    body = b'{"model": "' + QWEN.encode() + b'", "tokens": [' + ids + b', "not an id"]}'
    statuses: list[int] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(trust_env=False, timeout=30) as http:
            while not done.is_set():
                statuses.append(http.get(f"{cluster}/live").status_code)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with httpx.Client(trust_env=False, timeout=60) as http:
            answers = [http.post(f"{cluster}/detokenize", content=body) for _ in range(2)]
    finally:
        done.set()
        poller.join()
    for answer in answers:
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "tokens"
        assert f"length <= {MAX_DETOKENIZE_TOKENS}" in error["message"], error["message"]
    assert statuses and set(statuses) == {200}
    with httpx.Client(trust_env=False, timeout=30) as http:
        small = http.post(f"{cluster}/detokenize", json={"model": QWEN, "tokens": [72, 105]})
    assert small.status_code == 200 and small.json()["prompt"]


def test_logprobs_are_rendered_in_slices_the_loop_turning_between() -> None:
    """One worker output of 20,000 tokens with 20 alternatives each, consumed by 4 choices of one
    request: each slice is at most the pacer's share, and another task runs between slices."""
    record = TokenLogprob(-0.5, tuple((index, -1.0) for index in range(20)))
    big = Output(
        request_id="r", token_ids=list(range(20_000)), completion_tokens=20_000, finish_reason="stop"
    )
    big.logprobs = [record] * 20_000

    async def one_output() -> AsyncGenerator[Output, None]:
        yield big

    async def main() -> tuple[list[list[int]], int]:
        pacer = Pacer(3 + 20)
        ticks = 0
        slices: list[list[int]] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async def consume() -> None:
            async for part in paced(one_output(), pacer):
                assert len(part.token_ids) <= pacer.tokens
                assert part.logprobs is not None and len(part.logprobs) == len(part.token_ids)
                slices.append([len(part.token_ids), ticks, part.completion_tokens])

        task = asyncio.ensure_future(ticker())
        await asyncio.gather(*(consume() for _ in range(4)))
        stop.set()
        await task
        return slices, pacer.tokens

    slices, share = asyncio.run(main())
    assert share == PACE_ENTRIES // 23
    assert sum(count for count, _, _ in slices) == 4 * 20_000
    # the ticker ran between the request's turns: at most two slices of the request per tick
    per_tick: dict[int, int] = {}
    for count, tick, _ in slices:
        per_tick[tick] = per_tick.get(tick, 0) + count
    assert max(per_tick.values()) <= 2 * share
    assert [done for _, _, done in slices if done == 20_000] == [20_000] * 4  # usage as of each slice


def test_a_non_streamed_answer_keeps_every_logprob(cluster: Cluster) -> None:
    """Logprobs kept as JSON slice by slice come back whole and aligned (chat and completions)."""
    client = openai_client(cluster)
    chat = client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": "x" * 300}],
        max_tokens=400,
        logprobs=True,
        top_logprobs=2,
    )
    entries = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries and "".join(entry.token for entry in entries) == chat.choices[0].message.content
    text = client.completions.create(model=QWEN, prompt="y" * 300, max_tokens=400, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.text_offset and logprobs.top_logprobs
    assert text.usage is not None and len(logprobs.tokens) == text.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == len(logprobs.text_offset)
