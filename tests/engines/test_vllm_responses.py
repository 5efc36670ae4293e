"""``POST /v1/responses`` in front of a real vLLM (``make test-engines``): the same greedy answer and
usage as ``/v1/chat/completions``, streamed events that add up to it, the length limit."""

from __future__ import annotations

from conftest import MODEL, Cluster

PROMPT = "Tell me about the sea, the wind and the boats."


def test_responses_answers_as_chat_completions_does(vllm_cluster: Cluster) -> None:
    api = vllm_cluster.client()
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    request = {"model": MODEL, "input": PROMPT, "max_output_tokens": 16, "temperature": 0}
    response = api.responses.create(**request, extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 16)
    assert response.output_text == (chat.choices[0].message.content or "")
    events = list(api.responses.create(**request, stream=True, extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete"
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == response.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))
