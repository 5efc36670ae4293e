"""``POST /v1/responses`` with the official ``openai`` client against a real frontend and mock workers:
text, instructions, reasoning items, a function tool called and its output sent back (an agent
loop), the same call as ``/v1/chat/completions``, the typed SSE events the SDK parses, the length
limit, refusals naming ``param``, and a fuzz of the request body (never a 500).

The workers are real ``dynamo-prep worker`` processes: Kimi-K3 answers in its own format (reasoning,
content, a call of the first declared tool, then what the tool returned), Qwen from a ``--replies``
line written in Hermes' format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.plane import free_port, start_dynamo, tcp_endpoint

from dynamo_prep.frontend.responses_request import to_chat
from dynamo_prep.protocol.openai import RequestError
from dynamo_prep.protocol.responses import ResponsesRequest

K3 = "kimi-k3-demo"
QWEN = "qwen-vl-demo"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
# Responses' flat shape, and the chat shape
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
QWEN_CALL = (
    "<think>\nplan: call it\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("responses")
    replies = directory / "replies.jsonl"
    replies.write_text(json.dumps({"when": "qwen-call", "text": QWEN_CALL}) + "\n", encoding="utf-8")
    workers = [("--model-path", model, "--replies", str(replies)) for model in (K3, QWEN)]
    with mock_cluster(directory, workers) as running:
        yield running


def items(response: Any, kind: str) -> list[Any]:
    return [item for item in response.output if item.type == kind]


def reasoning_of(response: Any) -> str:
    return "".join(part.text for item in items(response, "reasoning") for part in item.content or [])


def streamed(url: str, **request: Any) -> tuple[list[Any], Any]:
    """Every event of the streamed request (as the SDK parsed it) and its final response."""
    events = list(client(url).responses.create(**request, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


# -- answers ---------------------------------------------------------------------------------------


def test_text_with_reasoning_usage_and_output_text(cluster: str) -> None:
    api = client(cluster)
    response = api.responses.create(model=K3, input="Say hello")
    assert (
        response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert reasoning_of(response) == "I will echo the last user message."
    assert response.output_text.endswith("You said: Say hello") and response.output_text.startswith("[mock")
    message = items(response, "message")[0]
    assert message.role == "assistant" and message.status == "completed"
    usage = response.usage
    assert usage is not None and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens > 0
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens


def test_instructions_are_a_leading_system_message(cluster: str) -> None:
    """The prompt the worker got is the chat of [system: instructions, user: input], token for token."""
    response = client(cluster).responses.create(model=QWEN, instructions="Be terse.", input="Say hello")
    with httpx.Client(trust_env=False, timeout=30) as http:
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hello"}]
        tokenized = http.post(f"{cluster}/tokenize", json={"model": QWEN, "messages": messages}).json()
    assert response.usage is not None and response.usage.input_tokens == tokenized["count"]
    assert f"{tokenized['count']} prompt tokens" in response.output_text
    assert response.instructions == "Be terse."


def test_message_items_with_content_parts_and_developer_role(cluster: str) -> None:
    conversation = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hi"}],
        },
    ]
    response = client(cluster).responses.create(model=K3, input=conversation)
    assert response.output_text.endswith("You said: Say hi")


def test_an_agent_loop_calls_the_tool_then_answers_from_its_output(cluster: str) -> None:
    """Plain SDK calls, as an agent does: the function_call item, then its function_call_output sent
    back with the whole conversation (stateless), then an answer that uses it."""
    api = client(cluster)
    conversation: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = api.responses.create(model=K3, input=conversation, tools=[WEATHER])
    [call] = items(first, "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "mock", "days": 1}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert first.status == "completed" and reasoning_of(first) == "I will call get_weather."
    conversation += [item.model_dump(exclude_none=True) for item in first.output]
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"})
    second = api.responses.create(model=K3, input=conversation, tools=[WEATHER])
    assert not items(second, "function_call")
    assert "sunny, 21 C" in second.output_text


def test_the_returned_items_fed_back_render_as_the_chat_history_does(cluster: str) -> None:
    """reasoning + message + function_call items merge into one assistant message, as the chat
    client's returned message does: the second request's prompt has the same tokens either way."""
    api = client(cluster)
    user = {"role": "user", "content": "What is the weather in Paris?"}
    first = api.responses.create(model=K3, input=[user], tools=[WEATHER])
    chat = api.chat.completions.create(model=K3, messages=[user], tools=[CHAT_WEATHER])
    message = chat.choices[0].message.model_dump(exclude_none=True)
    [call] = items(first, "function_call")
    message["tool_calls"][0]["id"] = call.call_id
    output = {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    back = [*(item.model_dump(exclude_none=True) for item in first.output)]
    back.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    by_responses = api.responses.create(model=K3, input=[user, *back], tools=[WEATHER])
    by_chat = api.chat.completions.create(
        model=K3,
        messages=[user, message, output],
        tools=[CHAT_WEATHER],
    )
    assert by_responses.usage is not None and by_chat.usage is not None
    assert by_responses.usage.input_tokens == by_chat.usage.prompt_tokens


NAMED = (
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "name": "get_weather"},
)


@pytest.mark.parametrize(
    ("model", "prompt", "choices"),
    [
        (K3, "What is the weather?", ("auto", "auto")),
        (QWEN, "qwen-call", ("auto", "auto")),
        (K3, "Say hello", ("required", "required")),  # a forced call: the engine's constrained decoding
        (QWEN, "Say hello", NAMED),
    ],
)
def test_the_same_tool_call_through_chat_completions_and_responses(
    cluster: str, model: str, prompt: str, choices: tuple[Any, Any]
) -> None:
    api = client(cluster)
    chat = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        tools=[CHAT_WEATHER],
        tool_choice=choices[0],
    )
    response = api.responses.create(model=model, input=prompt, tools=[WEATHER], tool_choice=choices[1])
    chat_calls = [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls or []]
    calls = [(c.name, c.arguments) for c in items(response, "function_call")]
    assert calls == chat_calls and len(calls) == 1
    assert reasoning_of(response) == (getattr(chat.choices[0].message, "reasoning_content", None) or "")
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )


def metric(url: str, name: str, model: str, **labels: str) -> float:
    """The value of one series of the frontend's /metrics (0 when absent)."""
    with httpx.Client(trust_env=False, timeout=30) as http:
        text = http.get(f"{url}/metrics").text
    wanted = {f'model="{model}"', *(f'{key}="{value}"' for key, value in labels.items())}
    for line in text.splitlines():
        if line.startswith(name + "{") and wanted <= set(line[len(name) + 1 : line.index("}")].split(",")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_responses_requests_are_counted_and_leave_the_inflight_gauge(cluster: str) -> None:
    """The chat path's request metrics, for this path too: counted by status, in flight while served."""
    api = client(cluster)
    before = metric(cluster, "dynamo_frontend_requests_total", QWEN, status="200")
    api.responses.create(model=QWEN, input="count me")
    list(api.responses.create(model=QWEN, input="count me", stream=True))
    assert metric(cluster, "dynamo_frontend_requests_total", QWEN, status="200") == before + 2
    assert metric(cluster, "dynamo_frontend_inflight_requests", QWEN) == 0


def test_max_output_tokens_ends_incomplete_with_the_reason(cluster: str) -> None:
    api = client(cluster)
    response = api.responses.create(model=K3, input="Say hello", max_output_tokens=12)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 12
    assert response.output[-1].status == "incomplete"
    events, final = streamed(cluster, model=K3, input="Say hello", max_output_tokens=12)
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert [item.model_dump() for item in final.output] == [
        item.model_dump() for item in _without_ids(response, final)
    ]


def _without_ids(response: Any, like: Any) -> list[Any]:
    """``response``'s items with ``like``'s ids (each response numbers its own items)."""
    copied = response.model_copy(deep=True)
    for item, other in zip(copied.output, like.output, strict=True):
        item.id = other.id
    return list(copied.output)


def test_text_format_becomes_the_chat_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    form = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    chat = to_chat(ResponsesRequest(model="m", input="x", text={"format": form}))
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    chat = to_chat(ResponsesRequest(model="m", input="x", text={"format": {"type": "json_object"}}))
    assert chat.response_format == {"type": "json_object"}
    assert (
        to_chat(ResponsesRequest(model="m", input="x", text={"format": {"type": "text"}})).response_format
        is None
    )


@pytest.mark.parametrize("form", ["json_object", "json_schema"])
def test_text_format_answers_as_response_format_does_on_chat(cluster: str, form: str) -> None:
    """Whatever the chat path does with ``response_format`` (the engine's constrained decoding),
    ``text.format`` gets the same answer."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    if form == "json_object":
        text, response_format = {"format": {"type": "json_object"}}, {"type": "json_object"}
    else:
        named = {"name": "place", "schema": schema, "strict": True}
        text, response_format = (
            {"format": {"type": "json_schema", **named}},
            {"type": "json_schema", "json_schema": named},
        )
    api = client(cluster)
    prompt = "Where? Answer in JSON."
    chat = api.chat.completions.create(
        model=K3,
        messages=[{"role": "user", "content": prompt}],
        response_format=response_format,
    )
    response = api.responses.create(model=K3, input=prompt, text=text)
    assert response.output_text == chat.choices[0].message.content
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == form


def test_input_items_map_to_chat_messages_as_vllm_merges_them() -> None:
    image = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"}
    request = ResponsesRequest(
        model="m",
        instructions="sys",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "look"}, image]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "r"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "two"}],
            },
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
        ],
        tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        max_output_tokens=5,
        reasoning={"effort": "low", "summary": "auto"},
    )
    chat = to_chat(request)
    assert chat.messages == [
        {"role": "system", "content": "sys"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "reasoning_content": "r",
            "content": "c",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "assistant", "reasoning_content": "s"},
    ]
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert (chat.requested_max_tokens, chat.reasoning_effort) == (5, "low")


# -- streaming --------------------------------------------------------------------------------------


def test_streamed_events_parse_in_the_sdk_and_add_up_to_the_response(cluster: str) -> None:
    request: dict[str, Any] = {"model": K3, "input": "What is the weather?", "tools": [WEATHER]}
    whole = client(cluster).responses.create(**request)
    events, final = streamed(cluster, **request)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert type(events[0]).__name__ == "ResponseCreatedEvent" and events[0].response.status == "in_progress"
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    reasoning = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    arguments = "".join(
        event.delta for event in events if event.type == "response.function_call_arguments.delta"
    )
    assert text == final.output_text == whole.output_text and text
    assert reasoning == reasoning_of(final) == reasoning_of(whole) and reasoning
    [call] = items(final, "function_call")
    assert arguments == call.arguments == items(whole, "function_call")[0].arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [arguments]
    assert [e.text for e in events if e.type == "response.output_text.done"] == [text]
    # every item is added, then done, in output order; text parts open and close inside their item
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == list(range(len(final.output))) == list(range(len(done)))
    assert [item.model_dump() for item in done] == [item.model_dump() for item in final.output]
    assert kinds.count("response.content_part.added") == kinds.count("response.content_part.done") == 2
    assert final.status == "completed" and final.usage is not None
    assert final.usage.output_tokens == (whole.usage.output_tokens if whole.usage else None)


def test_the_sdk_stream_helper_gets_the_final_response(cluster: str) -> None:
    with client(cluster).responses.stream(model=QWEN, input="qwen-call", tools=[WEATHER]) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text and "Checking." in final.output_text
    [call] = items(final, "function_call")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Lima", "days": 2})
    assert reasoning_of(final).strip() == "plan: call it"


# -- refusals -------------------------------------------------------------------------------------------


REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": 3}, "input"),
    ({"temperature": 7}, "temperature"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_refusals_are_400s_naming_the_param(cluster: str, fields: dict[str, Any], param: str) -> None:
    api = client(cluster)
    request = {"model": K3, "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(**request)
    assert refused.value.status_code == 400 and refused.value.param == param, refused.value.body
    assert isinstance(refused.value.body, dict) and refused.value.body["message"]


def test_a_missing_model_or_input_is_named(cluster: str) -> None:
    with httpx.Client(trust_env=False, timeout=30) as http:
        for body, param in (({"input": "hi"}, "model"), ({"model": K3}, "input")):
            answer = http.post(f"{cluster}/v1/responses", json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_unknown_and_stateless_fields_are_accepted(cluster: str) -> None:
    """OpenAI servers ignore fields they do not know; store is accepted and nothing is stored."""
    response = client(cluster).responses.create(
        model=K3,
        input="hi",
        store=True,
        metadata={"k": "v"},
        truncation="auto",
        parallel_tool_calls=False,
        service_tier="auto",
        include=["reasoning.encrypted_content"],
        extra_body={"something_new": {"a": 1}},
    )
    assert response.status == "completed" and response.metadata == {"k": "v"}
    assert response.previous_response_id is None and response.model_dump().get("store") is False


def test_a_refusal_via_the_chat_path_names_the_responses_param(cluster: str) -> None:
    """What the chat path refuses names the Responses field: no messages is ``input``, an image URL
    the preprocessor refuses is ``input``, a context overflow is ``max_output_tokens``."""
    api = client(cluster)
    image = {"type": "input_image", "image_url": "ftp://example.com/a.png"}
    for request, param in (
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [image]}]}, "input"),
        ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(model=K3, **request)
        assert refused.value.param == param, refused.value.body


def test_to_chat_refuses_by_name() -> None:
    with pytest.raises(RequestError) as refused:
        to_chat(ResponsesRequest(model="m", input=[{"type": "reasoning", "encrypted_content": "x"}]))
    assert refused.value.param == "input"


# -- fuzz --------------------------------------------------------------------------------------------------

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_json = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", "input_file", "x"])},
    optional={
        "text": _json,
        "image_url": st.sampled_from(["https://e.com/a.png", "data:x", "", 3]),
        "refusal": _json,
    },
)
_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["message", "reasoning", "function_call", "function_call_output", "item_reference", "x"]
        ),
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool", 3]),
        "content": st.one_of(st.text(max_size=12), st.lists(_part, max_size=3), _json),
        "call_id": st.one_of(st.sampled_from(["call_1", ""]), _json),
        "name": st.one_of(st.sampled_from(["get_weather", ""]), _json),
        "arguments": st.one_of(st.sampled_from(["{}", '{"city": "x"}', "nope"]), _json),
        "output": st.one_of(st.text(max_size=8), st.lists(_part, max_size=2), _json),
        "summary": st.lists(
            st.fixed_dictionaries({"type": st.just("summary_text"), "text": _json}), max_size=2
        ),
        "encrypted_content": st.one_of(st.none(), st.text(max_size=3)),
    },
)
_tool = st.one_of(
    st.just(WEATHER),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search", "custom"])}, optional={"name": _json}
    ),
    _json,
)
# Any field, as the fuzz may set it: the valid shape's neighbours and arbitrary JSON.
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([K3, QWEN, "nope", ""]) | _json,
    "input": st.one_of(st.text(max_size=20), st.lists(_item, max_size=4), _json),
    "instructions": st.one_of(st.text(max_size=10), _json),
    "tools": st.one_of(st.lists(_tool, max_size=2), _json),
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required", "x"]),
        st.fixed_dictionaries({"type": st.sampled_from(["function", "allowed_tools"]), "name": _json}),
        _json,
    ),
    "max_output_tokens": st.one_of(st.integers(-2, 40), _json),
    "temperature": st.one_of(st.floats(-1, 3), _json),
    "top_p": st.one_of(st.floats(-1, 2), _json),
    "text": st.one_of(
        st.fixed_dictionaries(
            {
                "format": st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                    optional={"schema": _json, "name": _json},
                )
            }
        ),
        _json,
    ),
    "reasoning": st.one_of(st.fixed_dictionaries({"effort": st.sampled_from(["low", "high", 3])}), _json),
    "stream": st.booleans() | _json,
    "store": _json,
    "previous_response_id": st.one_of(st.none(), st.text(max_size=4)),
    "background": st.one_of(st.none(), st.booleans()),
    "include": _json,
    "metadata": _json,
    "stop": _json,
}
_valid_item = st.sampled_from(
    [
        {"role": "user", "content": "What is the weather?"},
        {"role": "user", "content": [{"type": "input_text", "text": "qwen-call"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
    ]
)
# A request the server answers, with up to two fields set as the fuzz likes.
_body = st.builds(
    lambda valid, changes: {**valid, **dict(changes)},
    st.fixed_dictionaries(
        {
            "model": st.sampled_from([K3, QWEN]),
            "input": st.one_of(st.text(max_size=20), st.lists(_valid_item, min_size=1, max_size=4)),
        },
        optional={
            "tools": st.just([WEATHER]),
            "instructions": st.text(max_size=10),
            "max_output_tokens": st.integers(1, 40),
            "stream": st.booleans(),
            "temperature": st.floats(0, 2),
        },
    ),
    st.lists(
        st.sampled_from(sorted(_FIELDS)).flatmap(lambda k: _FIELDS[k].map(lambda v: (k, v))), max_size=2
    ),
)


def test_fuzzed_bodies_are_answered_or_refused_never_a_500(cluster: Cluster) -> None:
    statuses: dict[int, int] = {}
    with httpx.Client(trust_env=False, timeout=30) as http:

        @settings(
            max_examples=150,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(_body)
        def run(body: dict[str, Any]) -> None:
            answer = http.post(f"{cluster}/v1/responses", json=body)
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
            assert answer.status_code in (200, 400, 404), (body, answer.text)
            if answer.status_code == 400:
                assert answer.json()["error"]["message"]
            elif answer.status_code == 200 and not body.get("stream"):
                assert answer.json()["status"] in ("completed", "incomplete")
            elif answer.status_code == 200:
                assert "event: response.created" in answer.text and "event: error" not in answer.text

        run()
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 20, statuses
    assert not cluster.frontend.find("request_crashed")


def test_a_worker_lost_mid_stream_ends_in_an_error_event_and_response_failed(tmp_path: Path) -> None:
    """No migration budget and the only worker SIGKILLed after 3 deltas: the stream, already 200,
    ends with an ``error`` event and ``response.failed`` (the items so far, the error), as parsed."""
    port, discovery = free_port(), tcp_endpoint()
    frontend = start_dynamo(
        "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
        "--cache-dir", str(tmp_path / "cache"), log_level="info",
    )  # fmt: skip
    options = ("--token-delay", "0.04", "--heartbeat", "0.2", "--ttl-ms", "800", "--migration-limit", "0")
    worker = start_dynamo("worker", "--model-path", K3, "--discovery", discovery, *options, log_level="info")
    try:
        frontend.wait_event("model_added", timeout=30)
        events: list[Any] = []
        stream = client(f"http://127.0.0.1:{port}").responses.create(
            model=K3,
            input="please keep talking for a while, so that this stream can be interrupted",
            stream=True,
        )
        for event in stream:
            events.append(event)
            if sum(e.type.endswith("_text.delta") for e in events) == 3 and event.type.endswith(
                "_text.delta"
            ):
                worker.kill()
        kinds = [event.type for event in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert "lost" in events[-2].message and events[-2].code == "server_error"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error is not None and "lost" in failed.error.message
        assert [event.sequence_number for event in events] == list(range(len(events)))
    finally:
        worker.stop()
        frontend.stop()


# -- the openai Agents SDK -----------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agents_sdk_loop_calls_the_tool_and_answers_from_it(cluster: str, api: str) -> None:
    """An agent written for the openai Agents SDK (Responses API by default, chat completions as the
    alternative) runs its tool loop against the frontend: the same call either way, then the answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK's traces would go to OpenAI's servers
    http = httpx.AsyncClient(trust_env=False, timeout=30)
    sdk_client = openai.AsyncOpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, http_client=http)
    model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    called: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for the next days."""
        called.append((city, days))
        return "sunny, 21 C"

    agent = agents.Agent(
        name="weather", instructions="Use the tools.", tools=[get_weather], model=model_class(K3, sdk_client)
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert called == [("mock", 1)]
    assert "sunny, 21 C" in result.final_output
