"""Chat logprobs from a real vLLM (``make test-engines``): one entry per completion token (the test
model has no reasoning or tool-call format: every token is content), each logprob <= 0, the top
alternatives most likely first, and under greedy decoding the sampled token's logprob is vLLM's own
top-1 logprob; streamed entries are the unstreamed ones."""

from __future__ import annotations

from typing import Any

from conftest import MODEL, Cluster

PROMPT = "Tell me about the sea, the wind and the boats."
TOKENS = 12


def ask(cluster: Cluster, **extra: Any) -> Any:
    return cluster.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True},
        **extra,
    )


def test_vllm_logprobs_arrive_one_per_token(vllm_cluster: Cluster) -> None:
    response = ask(vllm_cluster, top_logprobs=5, temperature=0)
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert response.usage.completion_tokens == TOKENS
    assert len(entries) == TOKENS
    assert "".join(entry.token for entry in entries) == (choice.message.content or "")
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 5
        levels = [alternative.logprob for alternative in entry.top_logprobs]
        assert levels == sorted(levels, reverse=True)
        # Greedy: the sampled token is one of vLLM's most likely (the dummy weights tie many ids at
        # the top, so which one vLLM lists first is its choice), and where vLLM lists it, with its
        # own logprob.
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert all(alt.logprob == entry.logprob for alt in entry.top_logprobs if alt.bytes == entry.bytes)


def test_vllm_logprobs_stream_as_they_answer(vllm_cluster: Cluster) -> None:
    whole = ask(vllm_cluster, top_logprobs=2, temperature=0).choices[0].logprobs.content
    streamed = []
    for chunk in ask(vllm_cluster, top_logprobs=2, temperature=0, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [(e.bytes, e.logprob) for e in streamed] == [(e.bytes, e.logprob) for e in whole]


def test_vllm_sampled_logprobs_without_alternatives(vllm_cluster: Cluster) -> None:
    response = ask(vllm_cluster, temperature=1.0, seed=7)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens == TOKENS
    assert all(entry.logprob <= 0 and entry.top_logprobs == [] for entry in entries)
