"""Chat logprobs with the official ``openai`` client against a real frontend and mock workers.

The mock worker returns deterministic logprobs (``engines/mock/logprobs.py``: the sampled token is
among its top alternatives); the frontend renders the content tokens' entries from its own
tokenizer, aligned with the parsed answer: reasoning and tool-call tokens are left out
(docs/answers.md, "Logprobs"). Also: the wire keeps one record per token through merges, and the
refusals name ``top_logprobs``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cluster import mock_cluster
from support.cluster import openai_client as client
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint

from dynamo_prep.engines.mock.logprobs import mock_logprob, mock_logprobs
from dynamo_prep.frontend.answers import AnswerStream
from dynamo_prep.frontend.logprobs import ContentLogprobs, LegacyLogprobs, LoggedContent
from dynamo_prep.parsing import ContentDelta, KimiK3AnswerParser
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.protocol.wire import (
    Output,
    TokenLogprob,
    decode_from_worker,
    encode,
    extend_logprobs,
    merged,
)
from dynamo_prep.tokenizer import Tokenizer

K3 = "kimi-k3-demo"
QWEN = "qwen-vl-demo"
QWEN_CALL = (
    "<think>\nplan: call it\n</think>\n\nChecking the w\u00e9ather.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("logprobs")
    replies = directory / "replies.jsonl"
    replies.write_text(json.dumps({"when": "qwen-call", "text": QWEN_CALL}) + "\n", encoding="utf-8")
    workers = [("--model-path", model, "--replies", str(replies)) for model in (K3, QWEN)]
    with mock_cluster(directory, workers) as running:
        yield running


def ask(url: str, **extra: Any) -> Any:
    messages = [{"role": "user", "content": "Say hello in plain words"}]
    return client(url).chat.completions.create(model=K3, messages=messages, **extra)  # type: ignore[arg-type]


def check_entries(entries: list[Any], top: int) -> None:
    """Every entry well formed: bytes exact, logprob <= 0, ``top`` alternatives most likely first,
    the sampled token among them with its own logprob (the mock always ranks it in the top)."""
    for entry in entries:
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == top
        levels = [alternative.logprob for alternative in entry.top_logprobs]
        assert levels == sorted(levels, reverse=True)
        if top:
            assert (entry.token, entry.logprob) in [(alt.token, alt.logprob) for alt in entry.top_logprobs]


def test_content_logprobs_are_the_content_tokens(url: str) -> None:
    response = ask(url, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert reasoning, "the K3 mock answers with a reasoning channel first"
    content = choice.message.content
    assert content and content.isascii()
    entries = choice.logprobs.content
    assert "".join(entry.token for entry in entries) == content  # reasoning and markers left out
    assert len(entries) < response.usage.completion_tokens
    check_entries(entries, 3)


def test_without_logprobs_there_are_none(url: str) -> None:
    assert ask(url).choices[0].logprobs is None


def test_logprobs_without_top_logprobs_give_no_alternatives(url: str) -> None:
    choice = ask(url, logprobs=True).choices[0]
    assert choice.logprobs.content
    check_entries(choice.logprobs.content, 0)


def test_streamed_chunks_carry_their_own_tokens_logprobs(url: str) -> None:
    whole = ask(url, logprobs=True, top_logprobs=2).choices[0]
    stream = ask(url, logprobs=True, top_logprobs=2, stream=True)
    content, entries = [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning_content", None):
                assert choice.logprobs is None
            if delta.content:
                assert choice.logprobs is not None
                assert "".join(entry.token for entry in choice.logprobs.content) == delta.content
                content.append(delta.content)
                entries += choice.logprobs.content
    assert "".join(content) == whole.message.content
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.logprobs.content]
    check_entries(entries, 2)


def test_tool_call_tokens_are_not_content_tokens(url: str) -> None:
    for stream in (False, True):
        response = ask(url, logprobs=True, top_logprobs=1, tools=[WEATHER], stream=stream)
        if stream:
            content, entries, calls = "", [], 0
            for chunk in response:
                for choice in chunk.choices:
                    calls += len(choice.delta.tool_calls or [])
                    content += choice.delta.content or ""
                    entries += choice.logprobs.content if choice.logprobs else []
            assert calls
        else:
            message = response.choices[0].message
            assert message.tool_calls
            content, entries = message.content or "", response.choices[0].logprobs.content
        assert "".join(entry.token for entry in entries) == content
        assert "get_weather" not in content


def test_hidden_reasoning_still_is_no_content(url: str) -> None:
    choice = ask(url, logprobs=True, extra_body={"include_reasoning": False}).choices[0]
    assert getattr(choice.message, "reasoning_content", None) is None
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content


def test_a_stop_string_ends_the_entries_with_the_token_it_cut(url: str) -> None:
    choice = ask(url, logprobs=True, stop=["prompt"]).choices[0]
    content, entries = choice.message.content, choice.logprobs.content
    assert content and "prompt" not in content
    joined = "".join(entry.token for entry in entries)
    assert joined.startswith(content)
    assert len(joined) - len(content) < len(entries[-1].token)  # only the straddling token's rest


def test_hermes_think_and_tool_call_tokens_are_not_content_tokens(url: str) -> None:
    messages = [{"role": "user", "content": "qwen-call"}]
    for stream in (False, True):
        response = client(url).chat.completions.create(
            model=QWEN,
            messages=messages,
            tools=[WEATHER],
            logprobs=True,
            stream=stream,  # type: ignore[list-item]
        )
        if stream:
            content, entries = "", []
            for chunk in response:
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    entries += choice.logprobs.content if choice.logprobs else []
        else:
            choice = response.choices[0]
            assert choice.message.tool_calls and choice.message.reasoning_content
            content, entries = choice.message.content, choice.logprobs.content
        assert "Checking the w\u00e9ather." in content
        joined = bytes(b for entry in entries for b in entry.bytes).decode()
        # The demo vocabulary merges "</think>"'s ">" with the content's "\n\n": that token's text
        # is partly content, so it is a content token, and the entries start with its ">".
        assert joined == ">" + content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ],
)
def test_bad_logprobs_are_a_400_naming_the_parameter(url: str, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(url, **extra)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert param in error["message"]


def test_records_stay_aligned_through_merges_and_the_wire() -> None:
    records = mock_logprobs([5, 6, 7], 0, 2, 1000)
    one = Output(request_id="r", token_ids=[5], logprobs=records[:1])
    two = Output(request_id="r", token_ids=[6, 7], logprobs=records[1:])
    end = Output(request_id="r", token_ids=[], finish_reason="stop")
    joined = merged([one, two, end])
    assert joined.token_ids == [5, 6, 7] and joined.logprobs == records
    assert decode_from_worker(encode(joined)) == joined
    assert merged([one, Output(request_id="r", token_ids=[6])]).logprobs is None  # a gap misaligns
    assert merged([Output(request_id="r", token_ids=[6]), end]).logprobs is None
    grown = Output(request_id="r", token_ids=[], logprobs=None)
    for part in (one, two, end):
        extend_logprobs(grown, part)
        grown.token_ids += part.token_ids
    assert grown.logprobs == records
    extend_logprobs(grown, Output(request_id="r", token_ids=[8]))
    assert grown.logprobs is None


def test_the_record_is_a_compact_array_on_the_wire() -> None:
    record = TokenLogprob(-0.5, ((5, -0.5), (9, -1.5)))
    frame = msgspec.msgpack.decode(encode(Output(request_id="r", token_ids=[5], logprobs=[record])))
    assert frame["logprobs"] == [[-0.5, [[5, -0.5], [9, -1.5]]]]


def test_the_mock_is_deterministic_and_ranks_the_sampled_token() -> None:
    record = mock_logprob(42, 3, 4, 1000)
    assert record == mock_logprob(42, 3, 4, 1000)
    assert [level for _, level in record.top] == sorted((level for _, level in record.top), reverse=True)
    assert (42, record.logprob) in record.top and len({other for other, _ in record.top}) == 4
    assert mock_logprob(42, 3, 0, 1000).top == ()


def test_legacy_completion_logprobs_shape() -> None:
    tokenizer = Tokenizer.from_model_dir(K3)
    ids = tokenizer.encode("Hello world")
    renderer = LegacyLogprobs(tokenizer, 2, offset=3)
    first = renderer.render(ids[:1], mock_logprobs(ids[:1], 0, 2, tokenizer.n_vocab))
    rest = renderer.render(ids[1:], None)
    assert "".join(first.tokens + rest.tokens) == "Hello world"
    assert first.text_offset == [3] and rest.text_offset[0] == 3 + len(first.tokens[0])
    assert first.token_logprobs[0] is not None and first.token_logprobs[0] <= 0
    top = first.top_logprobs[0]
    assert top is not None and top[first.tokens[0]] == first.token_logprobs[0]  # the sampled token's
    assert 2 <= len(top) <= 3  # and the 2 most likely (the mock ranks the sampled token among them)
    assert rest.token_logprobs == [None] * len(rest.tokens)


def test_a_migrated_stream_keeps_its_logprobs(tmp_path: Any) -> None:
    """The worker streaming is SIGKILLed after 3 content chunks: the continuation on the other one
    carries on, and the client reads the entries of an uninterrupted answer (the mock's logprobs
    are a function of the position in the reply, which the continuation keeps)."""
    port, discovery = free_port(), tcp_endpoint()
    procs: list[DynamoProcess] = []
    try:
        frontend = start_dynamo(
            "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
            "--cache-dir", str(tmp_path / "cache"), log_level="debug",
        )  # fmt: skip
        procs.append(frontend)
        options = ("--token-delay", "0.04", "--heartbeat", "0.2", "--ttl-ms", "800", "--migration-limit", "1")
        workers = [
            start_dynamo("worker", "--model-path", K3, "--discovery", discovery, *options) for _ in "ab"
        ]
        procs += workers
        by_instance = {proc.wait_event("worker_started", timeout=20)["instance_id"]: proc for proc in workers}
        for instance in by_instance:
            frontend.wait_event("instance_added", timeout=30, instance_id=instance)
        frontend.wait_event("model_added", timeout=30)  # served once built, a moment after its instance
        url = f"http://127.0.0.1:{port}"
        text = "please keep talking for a while, so that this stream lasts long enough to be interrupted"
        body = {
            "model": K3,
            "messages": [{"role": "user", "content": text}],
            "logprobs": True,
            "top_logprobs": 2,
        }
        with httpx.Client(trust_env=False, timeout=30) as http:
            reference = http.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]
            content, entries, done = "", [], False
            with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                        break
                    if not line.startswith("data: "):
                        continue
                    event = msgspec.json.decode(line[6:])
                    assert "error" not in event, event
                    choice = event["choices"][0] if event["choices"] else {}
                    if choice.get("delta", {}).get("content"):
                        content += choice["delta"]["content"]
                        entries += choice["logprobs"]["content"]
                        if len(entries) == 3:
                            routed = frontend.find("request_routed")[-1]
                            by_instance[routed["instance_id"]].kill()
        assert done and frontend.find("request_migrated")
        assert content == reference["message"]["content"]
        assert entries == reference["logprobs"]["content"]
    finally:
        for proc in procs:
            proc.stop()


# -- alignment, in process -----------------------------------------------------------------------

TEXT = st.text(alphabet=st.sampled_from('ab \n<>/{}"é日🙂'), max_size=40)


def k3_ids(tokenizer: Tokenizer, reasoning: str, content: str) -> list[int]:
    marker = tokenizer.special_tokens
    close, sep, open_ = marker["<|close|>"], marker["<|sep|>"], marker["<|open|>"]
    text = tokenizer.encode
    return [*text(reasoning), close, *text("think"), sep, open_, *text("response"), sep, *text(content)]


def entries_of(
    tokenizer: Tokenizer, ids: list[int], cuts: list[int], **options: Any
) -> tuple[str, list[Any]]:
    """The content and its entries, the ids pushed in the pieces ``cuts`` makes."""
    answer = AnswerStream(KimiK3AnswerParser(vocab_of(tokenizer), thinking=True), **options)
    logged = ContentLogprobs(answer, tokenizer, 1)
    records = mock_logprobs(ids, 0, 1, tokenizer.n_vocab)
    bounds = [0, *sorted(cut % (len(ids) + 1) for cut in cuts), len(ids)]
    deltas = []
    for low, high in itertools.pairwise(bounds):
        deltas += logged.push(ids[low:high], records[low:high])
    deltas += logged.finish("stop")
    content = "".join(delta.text for delta in deltas if isinstance(delta, ContentDelta))
    return content, [
        entry for delta in deltas if isinstance(delta, LoggedContent) for entry in delta.logprobs
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reasoning=TEXT, content=TEXT, cuts=st.lists(st.integers(0, 200), max_size=4), hide=st.booleans())
def test_k3_content_entries_are_the_content_bytes_however_ids_arrive(
    k3_demo_tokenizer: Tokenizer, reasoning: str, content: str, cuts: list[int], hide: bool
) -> None:
    ids = k3_ids(k3_demo_tokenizer, reasoning, content)
    got, entries = entries_of(k3_demo_tokenizer, ids, cuts, include_reasoning=not hide)
    assert got == content
    assert bytes(b for entry in entries for b in entry.bytes).decode() == content
    assert (got, entries) == entries_of(k3_demo_tokenizer, ids, [])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(-5, 9000), max_size=60), cuts=st.lists(st.integers(0, 100), max_size=3))
def test_any_ids_render_without_failing(
    k3_demo_tokenizer: Tokenizer, ids: list[int], cuts: list[int]
) -> None:
    _, entries = entries_of(k3_demo_tokenizer, ids, cuts, stops=["a"])
    assert len(entries) <= len(ids)
