"""OpenAI chat message lists in the shapes clients send, for tests of how messages reach a template
(and templates whose content format vLLM detects in different ways).

String or part-list content (text parts with or without text, with extra keys, plain string parts,
image_url parts), assistant tool calls whose ``arguments`` are a JSON object string, an object, empty,
malformed or a JSON non-object, tool results as strings or text parts, developer and system roles
(Claude Code's billing header line included), names, reasoning, and keys vLLM drops.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

BILLING = "x-anthropic-billing-header: cc_version=1; cch=ab12"
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
TEXTS = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8),
    st.sampled_from(["hi", "", "<|im_end|>", "a\nb", BILLING, f"{BILLING}\nrest", " spaced "]),
)
ARGUMENTS = st.one_of(
    st.builds(
        json.dumps, st.dictionaries(st.sampled_from(["city", "n"]), st.integers(0, 9) | TEXTS, max_size=2)
    ),
    st.dictionaries(st.sampled_from(["city", "n"]), st.integers(0, 9), max_size=2),
    st.sampled_from(["", "{", "[1, 2]", "42", "null", '"s"', "{}", '{"a": {"b": [1]}}', "{'a': 1}"]),
    st.none(),
    st.just([1]),
)


@st.composite
def text_parts(draw: st.DrawFn) -> Any:
    """A text part (text may be missing or null; an extra key kept by vLLM) or a bare string part."""
    if draw(st.integers(0, 5)) == 0:
        return draw(TEXTS)
    part: dict[str, Any] = {"type": "text"}
    if draw(st.integers(0, 6)):
        part["text"] = draw(st.none() | TEXTS) if draw(st.integers(0, 4)) == 0 else draw(TEXTS)
    if draw(st.integers(0, 3)) == 0:
        part["cache_control"] = {"type": "ephemeral"}
    return part


@st.composite
def contents(draw: st.DrawFn, *, images: bool) -> Any:
    kind = draw(st.sampled_from(["none", "string", "string", "parts"]))
    if kind == "none":
        return None
    if kind == "string":
        return draw(TEXTS)
    part = st.one_of(text_parts(), st.just(IMAGE_PART)) if images else text_parts()
    return draw(st.lists(part, max_size=3))


@st.composite
def tool_calls(draw: st.DrawFn) -> list[dict[str, Any]]:
    calls = []
    for index in range(draw(st.integers(0, 2))):
        function: dict[str, Any] = {"name": draw(st.sampled_from(["get_weather", "f"]))}
        if (arguments := draw(st.one_of(ARGUMENTS, st.just("absent")))) != "absent":
            function["arguments"] = arguments
        call: dict[str, Any] = {"id": f"call_{index}", "function": function}
        if draw(st.booleans()):
            call["type"] = "function"
        calls.append(call)
    return calls


@st.composite
def messages(draw: st.DrawFn, *, images: bool) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
    message: dict[str, Any] = {"role": role}
    if draw(st.integers(0, 5)):
        message["content"] = draw(contents(images=images and role in ("user", "tool")))
    if draw(st.integers(0, 4)) == 0:
        message["name"] = draw(st.sampled_from(["bob", "", 7]))
    if role == "assistant" and draw(st.booleans()):
        message["tool_calls"] = draw(tool_calls())
    if role in ("assistant", "user") and draw(st.integers(0, 3)) == 0:
        message["reasoning"] = draw(TEXTS)
    if draw(st.integers(0, 4)) == 0:
        message["reasoning_content"] = draw(st.sampled_from(["thought", None]))
    if role in ("tool", "user") and draw(st.booleans()):
        message["tool_call_id"] = "call_0"
    if role == "developer" and draw(st.booleans()):
        message["tools"] = [{"type": "function", "function": {"name": "f"}}]
    if draw(st.integers(0, 6)) == 0:
        message["task"] = "summary"
    if draw(st.integers(0, 6)) == 0:
        message["extra"] = {"dropped": True}
    return message


def message_lists(*, images: bool) -> st.SearchStrategy[list[dict[str, Any]]]:
    """1 to 6 messages; ``images`` lets user and tool messages hold image_url parts."""
    return st.lists(messages(images=images), min_size=1, max_size=6)


def ordered(value: Any) -> Any:
    """``value`` with every dict as its list of items: equal only if key order is equal too."""
    if isinstance(value, dict):
        return [(key, ordered(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [ordered(item) for item in value]
    return value


# (template, vLLM's content format): loops over message content through aliases, slices, filters,
# macro parameters (positional or keyword) and the name ``content``; what vLLM's walk cannot name.
DETECTION_CASES = [
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    (
        "{% set rest = messages[1:] %}{% set loop_messages = rest %}{% for m in loop_messages %}"
        "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{% endfor %}{% endfor %}",
        "openai",
    ),
    (
        "{% for m in messages if m.content is not string %}{% for p in m.content[1:] %}{% endfor %}"
        "{% endfor %}",
        "openai",
    ),
    (
        "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
        "openai",
    ),
    (
        "{% macro show(x, c=none) %}{% for p in c %}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(1, c=m.content) }}{% endfor %}",
        "openai",
    ),
    (
        "{% macro show(c) %}{% for p in c %}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.role) }}{% endfor %}",
        "string",
    ),
    (
        "{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}{% endfor %}",
        "openai",
    ),
    ("{% macro f(content) %}{% for p in content %}{% endfor %}{% endmacro %}", "string"),
    ("{% for i, m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{% for k, v in m.content %}{% endfor %}{% endfor %}", "string"),
    (
        "{% set ns = namespace() %}{% set ns.m = messages %}{% for m in messages %}{% for p in m.content %}"
        "{% endfor %}{% endfor %}",
        "string",
    ),
    ("{% for m in messages %}{% for p in m.parts %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{% for w in m.content.split() %}{% endfor %}{% endfor %}", "string"),
]

# Names assigned from each other in a cycle: vLLM 0.32's walk over aliases never ends on it (a hang
# when the template is loaded); ours visits each name once.
ALIAS_CYCLE = (
    "{% set a = messages %}{% set b = a %}{% set a = b %}{% for m in b %}{% for p in m.content %}"
    "{% endfor %}{% endfor %}"
)
