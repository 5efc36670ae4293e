"""A real vLLM's streams arrive as they are made (issue 28): one stream after another, of 100 and
400 tokens, each comes as several SSE events, its first text before its last token, and a long
one's first text before half its tokens. Tokens per event are counted from the events' own
logprobs, so nothing here reads a clock (a token that is no text, a special id of the dummy
weights, carries no entry: counts are of the tokens with text)."""

from __future__ import annotations

from typing import Any

from conftest import MODEL, Cluster

STREAMS = (100, 400) * 3  # the sequential streams, one client, nothing else running
LONG_FROM = 400  # streams this long show their first text before half their tokens


def token_events(cluster: Cluster, index: int, max_tokens: int) -> list[int]:
    """The tokens each text event of one stream carries, in the order they arrived."""
    stream: Any = cluster.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me story number {index}, a long one."}],
        max_tokens=max_tokens,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    events: list[int] = []
    usage = None
    with stream:
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.content:
                    events.append(len(choice.logprobs.content))
    assert usage is not None and usage.completion_tokens == max_tokens
    return events


def test_every_stream_arrives_in_order_as_it_is_generated(vllm_cluster: Cluster) -> None:
    for index, max_tokens in enumerate(STREAMS):
        events = token_events(vllm_cluster, index, max_tokens)
        total = sum(events)
        assert len(events) >= 3, f"stream {index} ({max_tokens} tokens) came in {events}"
        assert events[0] < total, f"stream {index} came whole at once"
        if max_tokens >= LONG_FROM:
            assert events[0] <= total // 2, f"stream {index}'s first text came after half: {events[:5]}"
