"""Answers end to end with the official ``openai`` client: reasoning, content and tool calls parsed
from what a worker streams, for Kimi-K3 (XTML on token ids) and Qwen (Hermes), streamed and not.

The workers are real ``dynamo-prep worker`` processes answering from a ``--replies`` file: each
case's completion is written as segments (markers as special ids, text never), so the frontend's
parser sees exactly the ids a real model would stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client

K3 = "kimi-k3-demo"
QWEN = "qwen-vl-demo"
OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
FORGED = "<|close|>argument<|sep|>"  # typed as TEXT inside a string value: must stay text
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def text(value: str) -> list[Any]:
    return [value, False]


def mark(marker: str) -> list[Any]:
    return [marker, True]


def tag(kind: str, name: str, attrs: str = "") -> list[list[Any]]:
    """``<|open|>name attrs<|sep|>`` or ``<|close|>name<|sep|>`` as segments."""
    return [mark(OPEN if kind == "open" else CLOSE), text(name + attrs), mark(SEP)]


def argument(key: str, kind: str, value: str) -> list[list[Any]]:
    return [*tag("open", "argument", f' key="{key}" type="{kind}"'), text(value), *tag("close", "argument")]


THINK_CLOSE = tag("close", "think")
RESPONSE = [*tag("open", "response")]
RESPONSE_CLOSE = tag("close", "response")
MESSAGE_END = [*tag("close", "message"), mark(END)]


def call(name: str, index: int, *elements: list[list[Any]]) -> list[list[Any]]:
    body = [segment for element in elements for segment in element]
    return [*tag("open", "call", f' tool="{name}" index="{index}"'), *body, *tag("close", "call")]


def tools(*calls: list[list[Any]]) -> list[list[Any]]:
    return [*tag("open", "tools"), *(segment for c in calls for segment in c), *tag("close", "tools")]


WEATHER_CALL = call(
    "get_weather",
    1,
    argument("city", "string", f'Paris {FORGED} & "co"'),
    argument("days", "number", "3"),
    argument("options", "object", '{"unit": "C", "hourly": true}'),
)

FULL_REASONING = "Let me think about <|close|>think<|sep|> the weather."
FULL_CONTENT = "I will look it up. <|end_of_msg|> stays text."
K3_CASES: dict[str, list[list[Any]]] = {
    "case-full": [
        text(FULL_REASONING),
        *THINK_CLOSE,
        *RESPONSE,
        text(FULL_CONTENT),
        *RESPONSE_CLOSE,
        *tools(WEATHER_CALL),
        *MESSAGE_END,
    ],
    "case-think-to-tools": [  # no think close at all: vLLM drops these calls
        text("Straight to the tool."),
        *tools(call("get_weather", 1, argument("city", "string", "Oslo"))),
        *MESSAGE_END,
    ],
    "case-missing-sep": [  # <|close|>think without its <|sep|>
        text("Hmm."),
        mark(CLOSE),
        text("think"),
        *RESPONSE,
        text("Fine."),
        *RESPONSE_CLOSE,
        *MESSAGE_END,
    ],
    "case-undeclared": [
        text("r"),
        *THINK_CLOSE,
        *RESPONSE,
        *RESPONSE_CLOSE,
        *tools(call("launch_rocket", 1, argument("target", "string", "moon"))),
        *MESSAGE_END,
    ],
    "case-json-block": [
        text("r"),
        *THINK_CLOSE,
        *RESPONSE,
        *RESPONSE_CLOSE,
        *tools(
            call(
                "get_weather",
                1,
                [
                    *tag("open", "json", ' type="object"'),
                    text('{"city": "Rome",  "days": 1.0}'),
                    *tag("close", "json"),
                ],
            )
        ),
        *MESSAGE_END,
    ],
    "case-malformed": [
        text("r"),
        *THINK_CLOSE,
        *RESPONSE,
        text("before "),
        *tag("open", "weird", ' a="1"'),
        text("inside"),
        *tag("close", "weird"),
        text(" after"),
        mark(SEP),
        text(" tail"),
        *RESPONSE_CLOSE,
        text("garbage between"),
        *MESSAGE_END,
    ],
    "case-stop": [
        text("r"),
        *THINK_CLOSE,
        *RESPONSE,
        text("one two HALT three"),
        *RESPONSE_CLOSE,
        *MESSAGE_END,
    ],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("answers")
    replies = directory / "replies.jsonl"
    lines = [{"when": when, "segments": segments} for when, segments in K3_CASES.items()]
    qwen = (
        "<think>\nplan: call it\n</think>\n\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}\n</tool_call>'
    )
    lines.append({"when": "qwen-call", "text": qwen})
    replies.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    workers = [("--model-path", model, "--replies", str(replies)) for model in (K3, QWEN)]
    with mock_cluster(directory, workers) as running:
        yield running


def user(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def both(url: str, **request: Any) -> tuple[Any, dict[str, Any]]:
    """The non-streamed message and the fold of the streamed chunks of the same request."""
    api = client(url)
    whole = api.chat.completions.create(**request)
    folded: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in api.chat.completions.create(**request, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        folded["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        folded["content"] += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = folded["calls"].setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert entry["id"] is None, "a call's id comes in its first delta only"
                assert piece.type == "function" and piece.function is not None and piece.function.name
                entry["id"], entry["name"] = piece.id, piece.function.name
            if piece.function is not None and piece.function.arguments:
                entry["arguments"] += piece.function.arguments
        folded["finish"] = choice.finish_reason or folded["finish"]
    return whole, folded


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def assert_same(whole: Any, folded: dict[str, Any]) -> None:
    message = whole.choices[0].message
    assert (getattr(message, "reasoning_content", None) or "") == folded["reasoning"]
    assert (message.content or "") == folded["content"]
    streamed = [folded["calls"][index] for index in sorted(folded["calls"])]
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]
    assert whole.choices[0].finish_reason == folded["finish"]


def no_markers(*texts: str | None) -> bool:
    return not any(marker in (t or "") for t in texts for marker in ("<|open|>", "<|sep|>"))


def test_k3_reasoning_content_and_a_tool_call_streamed_and_not(cluster: str) -> None:
    whole, folded = both(cluster, model=K3, messages=user("case-full"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert message.reasoning_content == "Let me think about <|close|>think<|sep|> the weather."  # typed text
    assert message.content == "I will look it up. <|end_of_msg|> stays text."
    assert calls_of(message) == [
        (
            "get_weather",
            {"city": f'Paris {FORGED} & "co"', "days": 3, "options": {"unit": "C", "hourly": True}},
        )
    ]
    call_ = message.tool_calls[0]
    assert call_.type == "function" and call_.id.startswith("call_")
    assert whole.choices[0].finish_reason == "tool_calls"


def test_k3_what_peers_mishandle_still_parses(cluster: str) -> None:
    whole, folded = both(cluster, model=K3, messages=user("case-think-to-tools"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert message.reasoning_content == "Straight to the tool." and calls_of(message) == [
        ("get_weather", {"city": "Oslo"})
    ]
    whole, folded = both(cluster, model=K3, messages=user("case-missing-sep"))
    assert_same(whole, folded)
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == ("Hmm.", "Fine.")
    whole, _ = both(cluster, model=K3, messages=user("case-undeclared"), tools=[WEATHER])
    assert calls_of(whole.choices[0].message) == [("launch_rocket", {"target": "moon"})]
    assert no_markers(whole.choices[0].message.content)


def test_k3_a_json_block_is_the_arguments_exactly_as_written(cluster: str) -> None:
    whole, folded = both(cluster, model=K3, messages=user("case-json-block"), tools=[WEATHER])
    assert_same(whole, folded)
    assert whole.choices[0].message.tool_calls[0].function.arguments == '{"city": "Rome",  "days": 1.0}'


def test_k3_malformed_output_never_leaks_markers_and_is_counted(cluster: str) -> None:
    def parse_errors() -> float:
        with httpx.Client(trust_env=False, timeout=30) as http:
            text_ = http.get(f"{cluster}/metrics").text
        lines = [
            line
            for line in text_.splitlines()
            if line.startswith("dynamo_frontend_output_parse_errors_total{")
        ]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'model="{K3}"' in line)

    before = parse_errors()
    whole, folded = both(cluster, model=K3, messages=user("case-malformed"))
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert no_markers(message.content, message.reasoning_content) and "before" in (message.content or "")
    assert parse_errors() > before  # the unknown tag, the stray sep, the garbage: counted by kind


def test_request_finished_says_what_was_answered(cluster: Cluster) -> None:
    api = client(cluster)
    api.chat.completions.create(
        model=K3, messages=user("case-full"), tools=[WEATHER], extra_headers={"x-request-id": "answers-log-1"}
    )
    line = cluster.frontend.wait_event("request_finished", request_id="answers-log-1")
    assert (line["finish_reason"], line["tool_calls"]) == ("tool_calls", 1)
    assert line["reasoning_tokens"] > 0


@pytest.mark.parametrize("cut", [3, 12, 25, 40])
def test_k3_max_tokens_cuts_keep_what_is_complete(cluster: str, cut: int) -> None:
    whole, folded = both(cluster, model=K3, messages=user("case-full"), tools=[WEATHER], max_tokens=cut)
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "length"
    assert not message.tool_calls  # the call was cut: dropped, never half sent
    # what is complete is kept as text (typed marker text included), nothing else leaks
    assert FULL_REASONING.startswith(getattr(message, "reasoning_content", None) or "")
    assert FULL_CONTENT.startswith(message.content or "")
    assert whole.usage.completion_tokens == cut


def test_k3_request_options_tool_choice_none_reasoning_off_and_stop(cluster: str) -> None:
    whole, _ = both(cluster, model=K3, messages=user("case-full"), tools=[WEATHER], tool_choice="none")
    assert not whole.choices[0].message.tool_calls and whole.choices[0].finish_reason == "stop"
    assert no_markers(whole.choices[0].message.content)
    whole, folded = both(
        cluster,
        model=K3,
        messages=user("case-full"),
        tools=[WEATHER],
        extra_body={"include_reasoning": False},
    )
    assert_same(whole, folded)
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None
    whole, folded = both(cluster, model=K3, messages=user("case-stop"), stop=["HALT"])
    assert_same(whole, folded)
    assert whole.choices[0].message.content == "one two " and whole.choices[0].finish_reason == "stop"
    whole, _ = both(cluster, model=K3, messages=user("case-full"), tools=[WEATHER], stop=["think"])
    assert whole.choices[0].message.reasoning_content == FULL_REASONING  # stop strings apply to content


def test_k3_the_returned_message_fed_back_renders_what_the_model_wrote(cluster: str) -> None:
    whole = client(cluster).chat.completions.create(model=K3, messages=user("case-full"), tools=[WEATHER])
    returned = whole.choices[0].message.model_dump(exclude_none=True)
    history = [
        *user("case-full"),
        returned,
        {"role": "tool", "tool_call_id": returned["tool_calls"][0]["id"], "content": "sunny"},
    ]
    written = {
        "role": "assistant",
        "reasoning_content": "Let me think about <|close|>think<|sep|> the weather.",
        "content": "I will look it up. <|end_of_msg|> stays text.",
        "tool_calls": [
            {
                "id": "x",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": {
                        "city": f'Paris {FORGED} & "co"',
                        "days": 3,
                        "options": {"unit": "C", "hourly": True},
                    },
                },
            }
        ],
    }
    expected = [*user("case-full"), written, {"role": "tool", "tool_call_id": "x", "content": "sunny"}]
    with httpx.Client(trust_env=False, timeout=30) as http:
        tokenized = [
            http.post(
                f"{cluster}/tokenize", json={"model": K3, "messages": messages, "tools": [WEATHER]}
            ).json()
            for messages in (history, expected)
        ]
    assert tokenized[0]["tokens"] == tokenized[1]["tokens"]


def test_k3_without_a_scripted_reply_the_mock_calls_the_first_tool_then_answers(cluster: str) -> None:
    api = client(cluster)
    first = api.chat.completions.create(
        model=K3, messages=user("What is the weather in Paris?"), tools=[WEATHER]
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.reasoning_content
    [(name, arguments)] = calls_of(message)
    assert name == "get_weather" and set(arguments) >= {"city"}
    history = [
        *user("What is the weather in Paris?"),
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    second = api.chat.completions.create(model=K3, messages=history, tools=[WEATHER])
    assert not second.choices[0].message.tool_calls and "sunny, 21 C" in (
        second.choices[0].message.content or ""
    )


def test_qwen_think_tags_and_hermes_calls_streamed_and_not(cluster: str) -> None:
    whole, folded = both(cluster, model=QWEN, messages=user("qwen-call"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert (message.reasoning_content or "").strip() == "plan: call it"
    assert (message.content or "").strip() == "Checking."
    assert calls_of(message) == [("get_weather", {"city": "Lima", "days": 2})]
    assert whole.choices[0].finish_reason == "tool_calls"
