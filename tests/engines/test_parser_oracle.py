"""Our answer parsers against vLLM's own (``parser_oracle``): generated outputs of each family, whole
and streamed id by id, truncated at every position. A family is one ``Family`` line in ``FAMILIES``
(its vLLM names, its model directory, its output strategy, vLLM's known bugs)."""

from __future__ import annotations

import json
import keyword
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_mistral import (
    HELD,
    JSON_FORM_DIVERGENCES,
    NEMO,
    REASONING_DIVERGENCES,
    SMALL3,
    TYPED_JSON_FORM,
    V3,
    V11_DIVERGENCES,
    json_form_outputs,
    mistral_prompt,
    think_outputs,
    v11_outputs,
)
from parser_oracle import (
    _KEY,
    ARGUMENTS,
    JSON_VALUES,
    MODES,
    TOOL_NAMES,
    Divergence,
    Family,
    Mode,
    Output,
    PromptEnd,
    Segment,
    Writer,
    differences,
    json_text,
    our_answers,
    our_tokenizer,
    vllm_answer,
    words,
)
from support.hf_models import built_models

from dynamo_prep.parsing import REASONING_PARSERS, TOOL_CALL_PARSERS

EXAMPLES = int(os.environ.get("DYN_ORACLE_EXAMPLES", "60"))
"""Generated outputs per family (``DYN_ORACLE_EXAMPLES`` for a longer run); truncated: an eighth."""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


LLAMA3, LLAMA4, QWEN3, DEEPSEEK = "llama3", "llama4", "qwen3", "deepseek_v3"  # tests/support/hf_models
GPT_OSS, KIMI_K2, GLM45 = "gpt_oss", "kimi_k2", "glm45"


@pytest.fixture(scope="session")
def models() -> dict[str, Path]:
    return built_models()


# -- prompts -----------------------------------------------------------------------------------------


def chatml_prompt(end: PromptEnd) -> list[Segment]:
    head: list[Segment] = [("<|im_start|>", True), ("user\nhi", False), ("<|im_end|>", True), ("\n", False)]
    head += [("<|im_start|>", True), ("assistant\n", False)]
    if end == "open":
        return [*head, (THINK_OPEN, True), ("\n", False)]
    if end == "closed":
        return [*head, (THINK_OPEN, True), ("\n\n", False), (THINK_CLOSE, True), ("\n\n", False)]
    return head


def deepseek_prompt(end: PromptEnd) -> list[Segment]:
    """DeepSeek-R1's template opens the think block after the assistant marker; V3.1's opens it with
    thinking on and closes it (``</think>``) with thinking off."""
    head: list[Segment] = [("<｜begin▁of▁sentence｜>", True), ("<｜User｜>", True), ("hi", False)]
    head += [("<｜Assistant｜>", True)]
    if end == "open":
        return [*head, (THINK_OPEN, True), ("\n", False)]
    return [*head, (THINK_CLOSE, True)] if end == "closed" else head


def llama3_prompt(end: PromptEnd) -> list[Segment]:
    header = [("<|start_header_id|>", True), ("{}", False), ("<|end_header_id|>", True)]
    user = [(text.format("user") if not marker else text, marker) for text, marker in header]
    assistant = [(text.format("assistant") if not marker else text, marker) for text, marker in header]
    return [
        ("<|begin_of_text|>", True),
        *user,
        ("\n\nhi", False),
        ("<|eot_id|>", True),
        *assistant,
        ("\n\n", False),
    ]


# -- outputs -----------------------------------------------------------------------------------------


def harmony_prompt(end: PromptEnd) -> list[Segment]:
    """GPT-OSS: the prompt opens the assistant's message; the model writes its header."""
    user: list[Segment] = [("<|start|>", True), ("user", False), ("<|message|>", True), ("hi", False)]
    return [*user, ("<|end|>", True), ("<|start|>", True), ("assistant", False)]


def kimi_k2_prompt(end: PromptEnd) -> list[Segment]:
    user: list[Segment] = [("<|im_user|>", True), ("user", False), ("<|im_middle|>", True), ("hi", False)]
    assistant: list[Segment] = [("<|im_assistant|>", True), ("assistant", False), ("<|im_middle|>", True)]
    return [*user, ("<|im_end|>", True), *assistant]


def glm45_prompt(end: PromptEnd) -> list[Segment]:
    """GLM-4.5: thinking on leaves the model to open its block; off closes an empty one."""
    head: list[Segment] = [("[gMASK]", True), ("<sop>", True), ("<|user|>", True), ("\nhi", False)]
    head.append(("<|assistant|>", True))
    closed: list[Segment] = [("\n", False), (THINK_OPEN, True), (THINK_CLOSE, True)]
    return [*head, *closed] if end == "closed" else head


# -- outputs -----------------------------------------------------------------------------------------


def llama4_prompt(end: PromptEnd) -> list[Segment]:
    return [
        ("<|begin_of_text|>", True),
        ("<|header_start|>", True),
        ("user", False),
        ("<|header_end|>", True),
        ("\n\nhi", False),
        ("<|eot|>", True),
        ("<|header_start|>", True),
        ("assistant", False),
        ("<|header_end|>", True),
        ("\n\n", False),
    ]


# -- outputs -----------------------------------------------------------------------------------------


def think(draw: st.DrawFn, writer: Writer, prompts: tuple[PromptEnd, ...]) -> PromptEnd:
    """Reasoning as the prompt left it: continued up to the close (open), the model's own block
    (plain, sometimes), or none (closed). No ``prompts``: no reasoning parser, no reasoning."""
    if not prompts:
        return "plain"
    prompt = draw(st.sampled_from(prompts))
    if prompt == "open":
        writer.text(draw(words())).marker(THINK_CLOSE).text(draw(st.sampled_from(["\n\n", "\n", ""])))
    elif prompt == "plain" and draw(st.booleans()):
        writer.shapes.add("model_opens_think")
        writer.marker(THINK_OPEN).text(draw(words())).marker(THINK_CLOSE).text("\n\n")
    elif prompt == "plain":
        writer.shapes.add("no_think_block")
    return prompt


BAD_BODIES = (
    '{"name": "f", "arguments": {"x": }',
    '{"arguments": {}}',
    "not json",
    '{"name": "f", "arguments": [1]}',
)


@st.composite
def hermes_call(draw: st.DrawFn, writer: Writer) -> None:
    """A call, now and then one without arguments or one that is no call at all."""
    kind = draw(st.sampled_from(["call"] * 6 + ["call_without_arguments", "invalid_call"]))
    name = draw(st.sampled_from(TOOL_NAMES))
    if kind == "call":
        body = draw(json_text({"name": name, "arguments": draw(ARGUMENTS)}))
    elif kind == "call_without_arguments":
        body = draw(json_text({"name": name}))
    else:
        body = draw(st.sampled_from(BAD_BODIES))
    if kind != "call":
        writer.shapes.add(kind)
    writer.call((CALL_OPEN, True), (f"\n{body}\n", False), (CALL_CLOSE, True))


@st.composite
def hermes_outputs(draw: st.DrawFn, prompts: tuple[PromptEnd, ...] = ()) -> Output:
    """[reasoning] text <tool_call>{"name", "arguments"}</tool_call> ... text."""
    writer = Writer()
    prompt = think(draw, writer, prompts)
    before = draw(words(min_size=0))
    writer.text(before)
    if draw(st.integers(0, 9)) == 0:  # the model spells a tag as text (its pieces, not its token)
        writer.shapes.add("typed_marker")
        writer.typed(draw(st.sampled_from([CALL_OPEN, CALL_CLOSE, THINK_CLOSE])))
    count = draw(st.integers(0, 3))
    for _ in range(count):
        writer.text("\n")
        draw(hermes_call(writer))
    after = draw(words(min_size=0)) if count else ""
    writer.text(after)
    writer.shapes.update(
        shape
        for shape, present in (
            ("calls", count > 0),
            ("text_before_calls", count > 0 and before.strip()),
            ("text_after_calls", after.strip()),
        )
        if present
    )
    return writer.output(prompt)


@st.composite
def reasoning_outputs(draw: st.DrawFn, prompts: tuple[PromptEnd, ...]) -> Output:
    """[reasoning] text (no tool parser)."""
    writer = Writer()
    prompt = think(draw, writer, prompts)
    writer.text(draw(words(min_size=0)))
    return writer.output(prompt)


LLAMA_TEXT = "abcxyz ,.!?:\n\t'\"\\<>()#*-你好é😀"  # no brackets: text is never taken for JSON


@st.composite
def llama3_outputs(draw: st.DrawFn) -> Output:
    """A text answer, an answer in JSON, or [<|python_tag|>] {"name", "parameters"} [; {...}]* [text]."""
    writer = Writer()
    kind = draw(st.sampled_from(["text", "json_answer", "calls", "calls"]))
    if kind == "text":
        writer.text(draw(words(LLAMA_TEXT).filter(lambda text: text.strip())))
        return writer.output()
    if kind == "json_answer":
        writer.shapes.add("json_answer")  # a call until it closes (a cut inside it is not compared)
        writer.call((draw(json_text(draw(ARGUMENTS.filter(lambda value: "name" not in value)))), False))
        return writer.output()
    if draw(st.booleans()):
        writer.shapes.add("python_tag")
        writer.marker(PYTHON_TAG)
    count = draw(st.integers(1, 3))
    writer.shapes.update(["calls"] + (["several_calls"] if count > 1 else []))
    key = draw(st.sampled_from(["parameters", "arguments"]))
    separator = draw(st.sampled_from(["; ", ";", " ; ", ";\n"]))
    for index in range(count):
        if index:
            writer.text(separator)
            if separator != "; ":
                writer.shapes.add("other_separator")
        body = {"name": draw(st.sampled_from(TOOL_NAMES)), key: draw(ARGUMENTS)}
        if not body[key]:
            writer.shapes.add("empty_arguments")
        writer.call((draw(json_text(body)), False))
    after = draw(words(LLAMA_TEXT, min_size=0))
    if after.strip():
        writer.shapes.add("text_after_calls")
        writer.text(" " + after)
    return writer.output()


CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)


@st.composite
def deepseek_call(draw: st.DrawFn, writer: Writer, v3: bool) -> None:
    """One call in V3's fenced form or V3.1's; now and then pretty-printed or no call at all."""
    kind = draw(st.sampled_from(["call"] * 6 + ["multiline_arguments", "invalid_call"]))
    name = draw(st.sampled_from(TOOL_NAMES))
    arguments = draw(ARGUMENTS)
    if kind == "multiline_arguments":
        body = json.dumps(arguments, ensure_ascii=draw(st.booleans()), indent=2)
    elif kind == "invalid_call":
        body = draw(st.sampled_from(BAD_BODIES[:1] + BAD_BODIES[2:]))
    else:
        body = draw(json_text(arguments))
    if kind != "call":
        writer.shapes.add(kind)
    if not arguments:
        writer.shapes.add("empty_arguments")
    head, body = ("function", f"{name}\n```json\n{body}\n```") if v3 else (name, body)
    writer.call((CALL_BEGIN, True), (head, False), (TOOL_SEP, True), (body, False), (CALL_END, True))


@st.composite
def deepseek_outputs(draw: st.DrawFn, v3: bool, prompts: tuple[PromptEnd, ...] = ()) -> Output:
    """[reasoning] text [<｜tool▁calls▁begin｜> call ([ws] call)* <｜tool▁calls▁end｜>] [text]."""
    writer = Writer()
    prompt = think(draw, writer, prompts)
    before = draw(words(min_size=0))
    writer.text(before)
    if draw(st.integers(0, 9)) == 0:  # the model spells a marker as text (its pieces, not its token)
        writer.shapes.add("typed_marker")
        writer.typed(draw(st.sampled_from([*DEEPSEEK_MARKERS, THINK_CLOSE])))
    count = draw(st.integers(0, 3))
    if count:
        writer.marker(CALLS_BEGIN)
    spaced = False
    for index in range(count):
        if index:
            between = draw(st.sampled_from(["", "\n", " "]))
            spaced = spaced or bool(between)
            writer.text(between)
        draw(deepseek_call(writer, v3))
    if count:
        writer.marker(CALLS_END)
    after = draw(words(min_size=0)) if count else ""
    writer.text(after)
    writer.shapes.update(
        shape
        for shape, present in (
            ("calls", count > 0),
            ("several_calls", count > 1),
            ("text_before_calls", count > 0 and before.strip()),
            ("text_after_calls", after.strip()),
            ("text_around_calls", spaced and after.strip()),
        )
        if present
    )
    return writer.output(prompt)


FUNCTION, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER, PARAMETER_CLOSE = "<parameter=", "</parameter>"
CODER_TEXT_MARKERS = (FUNCTION, FUNCTION_CLOSE, PARAMETER, PARAMETER_CLOSE)
CODER_PROPERTIES = {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "ratio": {"type": "number"},
    "flag": {"type": "boolean"},
    "options": {"type": "object"},
    "items": {"type": "array"},
    "maybe": {"type": ["integer", "null"]},
    "unit": {"enum": ["c", "f", 1]},
}
"""Qwen3-Coder's values are text typed by the tool's schema: these properties, and free keys."""
_NUMBERS = st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, allow_infinity=False, width=32)
CODER_VALUES = {
    "city": words(),
    "days": st.integers(-(10**9), 10**9).map(str) | words(),
    "ratio": _NUMBERS.map(str),
    "flag": st.sampled_from(["true", "false", "True", "0", "1", "yes"]),
    "options": st.dictionaries(st.text("abc", max_size=3), JSON_VALUES, max_size=3).map(json.dumps),
    "items": st.lists(JSON_VALUES, max_size=3).map(json.dumps),
    "maybe": st.sampled_from(["null", "7", "x"]),
    "unit": st.sampled_from(["c", "f", "1", "k"]),
}


@st.composite
def coder_call(draw: st.DrawFn, writer: Writer) -> str:
    """<tool_call>\n<function=NAME>\n(<parameter=KEY>\nVALUE\n</parameter>\n)*</function>\n</tool_call>,
    now and then without the wrapper, a value without its close, a function without its close, or
    JSON (Hermes' body) inside the wrapper."""
    kind = draw(
        st.sampled_from(["call"] * 6 + ["no_wrapper", "unclosed_value", "unclosed_function", "json_body"])
    )
    name = draw(st.sampled_from(TOOL_NAMES))
    keys = draw(st.lists(st.sampled_from(sorted(CODER_VALUES)) | _FREE_KEY, unique=True, max_size=4))
    body = f"\n{FUNCTION}{name}>\n"
    for index, key in enumerate(keys):
        value = draw(CODER_VALUES.get(key, words(min_size=0)))
        close = "" if kind == "unclosed_value" and index == len(keys) - 1 else PARAMETER_CLOSE
        body += f"{PARAMETER}{key}>\n{value}\n{close}\n"
    body += "" if kind == "unclosed_function" else f"{FUNCTION_CLOSE}\n"
    if kind == "json_body":
        body = "\n" + draw(json_text({"name": name, "arguments": draw(ARGUMENTS)})) + "\n"
    if kind != "call" and (kind != "unclosed_value" or keys):
        writer.shapes.add(kind)
    if kind == "no_wrapper":
        writer.call((body.lstrip("\n"), False))
    else:
        writer.call((CALL_OPEN, True), (body, False), (CALL_CLOSE, True))
    return kind


_FREE_KEY = st.text(alphabet="abdxz_é你 ", min_size=1, max_size=8).filter(lambda key: key.strip() == key)


@st.composite
def coder_outputs(draw: st.DrawFn, prompts: tuple[PromptEnd, ...] = ()) -> Output:
    """[reasoning] text <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</tool_call> ... text."""
    writer = Writer()
    prompt = think(draw, writer, prompts)
    before = draw(words(min_size=0))
    writer.text(before)
    if draw(st.integers(0, 9)) == 0:  # the model spells a tag as text (its pieces, not its token)
        writer.shapes.add("typed_marker")
        writer.typed(draw(st.sampled_from([CALL_OPEN, CALL_CLOSE, THINK_CLOSE])))
    count = draw(st.integers(0, 3))
    kinds = [draw(coder_call(writer.text("\n"))) for _ in range(count)]
    after = draw(words(min_size=0)) if count else ""
    writer.text(after)
    around = after.strip() and (count > 1 or "no_wrapper" in kinds[-1:])
    writer.shapes.update(
        shape
        for shape, present in (
            ("calls", count > 0),
            ("text_around_calls", around),
            ("text_before_calls", count > 0 and before.strip()),
            ("text_after_calls", after.strip()),
        )
        if present
    )
    return writer.output(prompt)


H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
H_END, H_CALL, H_RETURN = "<|end|>", "<|call|>", "<|return|>"
HARMONY_ENDS = {"analysis": H_END, "preamble": H_END, "final": H_RETURN, "call": H_CALL}


def harmony_call_header(draw: st.DrawFn, name: str) -> list[Segment]:
    """The header of a call, in one of the forms gpt-oss writes (recipient before or after the
    channel, with or without a content type)."""
    recipient = f"to=functions.{name}"
    form = draw(st.sampled_from(["after", "before", "plain", "json"]))
    if form == "before":
        return [
            (f" {recipient}", False),
            (H_CHANNEL, True),
            ("commentary ", False),
            (H_CONSTRAIN, True),
            ("json", False),
        ]
    tail: list[Segment] = [(" ", False), (H_CONSTRAIN, True), ("json", False)] if form == "after" else []
    return [
        (H_CHANNEL, True),
        (f"commentary {recipient}" + (" json" if form == "json" else ""), False),
        *tail,
    ]


@st.composite
def harmony_outputs(draw: st.DrawFn) -> Output:
    """Messages: [analysis] [commentary preamble] then a final answer or calls; the last message's
    end token now and then left out (it is a stop id an engine may strip). Headers and call bodies
    are spans: a cut inside one is not compared."""
    writer = Writer()
    kinds = draw(st.lists(st.sampled_from(["analysis", "preamble", "call", "final"]), min_size=1, max_size=4))
    for index, kind in enumerate(kinds):
        header: list[Segment] = [(H_START, True), ("assistant", False)] if index else []
        if kind == "call":
            header += harmony_call_header(draw, draw(st.sampled_from(TOOL_NAMES)))
        else:
            channel = {"analysis": "analysis", "preamble": "commentary", "final": "final"}[kind]
            header += [(H_CHANNEL, True), (channel, False)]
        ended = index < len(kinds) - 1 or draw(st.booleans())
        end: list[Segment] = [(HARMONY_ENDS[kind], True)] if ended else []
        if kind != "call":
            writer.call(*header, (H_MESSAGE, True))
            writer.text(draw(words()))
            if ended:
                writer.marker(HARMONY_ENDS[kind])
            continue
        if draw(st.integers(0, 7)) == 0:
            writer.shapes.add("invalid_call")
            body = draw(st.sampled_from(BAD_BODIES))
        else:
            body = draw(json_text(draw(ARGUMENTS)))
        writer.call(*header, (H_MESSAGE, True), (body, False), *end)
        if not ended:  # a cut even at the very end leaves this call unfinished: not compared
            start, stop = writer.spans[-1]
            writer.spans[-1] = (start, stop + 1)
    for repeated in ("analysis", "preamble", "final"):
        if kinds.count(repeated) + (repeated == "final" and "preamble" in kinds) > 1:
            writer.shapes.add("several_text_messages")
    writer.shapes.add("calls" if "call" in kinds else "no_calls")
    return writer.output()


K2_SECTION_OPEN, K2_SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K2_CALL_OPEN, K2_ARGUMENTS, K2_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


@st.composite
def kimi_k2_outputs(draw: st.DrawFn) -> Output:
    """text [<|tool_calls_section_begin|> (<|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>)+ <|tool_calls_section_end|>] [text]."""
    writer = Writer()
    before = draw(words(min_size=0))
    writer.text(before)
    count = draw(st.integers(0, 3))
    if count:
        writer.shapes.update(["calls"] + (["text_before_calls"] if before.strip() else []))
        writer.marker(K2_SECTION_OPEN)
        for index in range(count):
            name = draw(st.sampled_from(TOOL_NAMES))
            if draw(st.integers(0, 7)) == 0:
                writer.shapes.add("invalid_call")
                body = draw(st.sampled_from(BAD_BODIES[:1] + BAD_BODIES[2:]))
            else:
                body = draw(json_text(draw(ARGUMENTS)))
            header = (f"functions.{name}:{index}", False)
            writer.call(
                (K2_CALL_OPEN, True), header, (K2_ARGUMENTS, True), (body, False), (K2_CALL_END, True)
            )
        writer.marker(K2_SECTION_CLOSE)
        after = draw(words(min_size=0))
        if after.strip():
            writer.shapes.add("text_after_calls")
        writer.text(after)
    return writer.output()


GLM_CALL_OPEN, GLM_CALL_CLOSE = "<tool_call>", "</tool_call>"
GLM_PAIR = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


@st.composite
def glm45_outputs(draw: st.DrawFn, prompts: tuple[PromptEnd, ...] = ()) -> Output:
    """[reasoning] text (<tool_call>NAME\n(<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n)*
    </tool_call>)* [text]: values are text (the request's tools declare no types: strings)."""
    writer = Writer()
    prompt = think(draw, writer, prompts)
    before = draw(words(min_size=0))
    writer.text(before)
    count = draw(st.integers(0, 3))
    for _ in range(count):
        writer.text("\n")
        pieces: list[Segment] = [(GLM_CALL_OPEN, True), (draw(st.sampled_from(TOOL_NAMES)) + "\n", False)]
        for key in draw(st.lists(_KEY, max_size=3, unique_by=str.strip)):
            key_open, key_close, value_open, value_close = GLM_PAIR
            pieces += [(key_open, True), (key, False), (key_close, True), ("\n", False), (value_open, True)]
            pieces += [(draw(words(min_size=0)), False), (value_close, True), ("\n", False)]
        writer.call(*[piece for piece in pieces if piece[0]], (GLM_CALL_CLOSE, True))
    after = draw(words(min_size=0)) if count else ""
    writer.text(after)
    writer.shapes.update(
        shape
        for shape, present in (
            ("calls", count > 0),
            ("text_before_calls", count > 0 and before.strip()),
            ("text_after_calls", after.strip()),
            ("text_after_several_calls", count > 1 and after.strip()),
        )
        if present
    )
    return writer.output(prompt)


TYPED_PARAMETERS = {
    "type": "object",
    "properties": {
        "s": {"type": "string"},
        "i": {"type": "integer"},
        "n": {"type": "number"},
        "b": {"type": "boolean"},
        "o": {"type": "object"},
        "a": {"type": "array"},
        "z": {"type": ["integer", "null"]},
        "e": {"enum": ["x", 1, True]},
        "u": {"anyOf": [{"type": "number"}, {"type": "string"}]},
        "free": {},
    },
}
"""Parameters of every type a GLM value is read as (the request's schema types it, as vLLM does)."""
TYPED_TEXT = st.one_of(
    JSON_VALUES.map(lambda value: value if isinstance(value, str) else json.dumps(value)),
    st.sampled_from(
        ["1", "-2", "3.0", "1e3", "0.5", "true", "False", "0", "null", "NaN", "1e999", "[1]", " 7 ", "x"]
    ),
)


@st.composite
def glm45_typed_outputs(draw: st.DrawFn) -> Output:
    """One call whose values (JSON as the template writes non-strings, or any text) go to typed
    parameters."""
    writer = Writer()
    pieces: list[Segment] = [(GLM_CALL_OPEN, True), (draw(st.sampled_from(TOOL_NAMES)) + "\n", False)]
    for key in draw(
        st.lists(st.sampled_from(sorted(TYPED_PARAMETERS["properties"])), max_size=5, unique=True)
    ):
        key_open, key_close, value_open, value_close = GLM_PAIR
        pieces += [(key_open, True), (key, False), (key_close, True), ("\n", False), (value_open, True)]
        pieces += [(draw(TYPED_TEXT), False), (value_close, True), ("\n", False)]
    writer.call(*[piece for piece in pieces if piece[0]], (GLM_CALL_CLOSE, True))
    writer.shapes.add("calls")
    return writer.output()


PY_KEYS = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True).filter(lambda key: not keyword.iskeyword(key))
PY_ARGUMENTS = st.dictionaries(PY_KEYS, JSON_VALUES, max_size=4)


@st.composite
def python_literal(draw: st.DrawFn, value: Any, shapes: set[str]) -> str:
    """``value`` as a model may write it in Python: repr or JSON spellings, tuples for lists."""
    if value is None or isinstance(value, bool):
        return draw(st.sampled_from([repr(value), json.dumps(value)]))  # None or null, True or true
    if isinstance(value, int | float):
        if isinstance(value, float):
            shapes.add("float")
        return repr(value)
    if isinstance(value, str):
        return draw(st.sampled_from([repr(value), json.dumps(value, ensure_ascii=False)]))
    if isinstance(value, list):
        items = [draw(python_literal(item, shapes)) for item in value]
        if len(items) > 1 and draw(st.booleans()):
            return "(" + ", ".join(items) + ")"
        return "[" + ", ".join(items) + "]"
    pairs = [
        f"{draw(python_literal(key, shapes))}: {draw(python_literal(item, shapes))}"
        for key, item in value.items()
    ]
    return "{" + ", ".join(pairs) + "}"


@st.composite
def python_call(draw: st.DrawFn, writer: Writer) -> str:
    """``name(key=literal, ...)``, now and then one that is no call (a positional argument, a name)."""
    name = draw(st.sampled_from(TOOL_NAMES))
    kind = draw(st.sampled_from(["call"] * 8 + ["invalid_call"]))
    if kind == "invalid_call":
        writer.shapes.add(kind)
        return draw(st.sampled_from([f"{name}(1)", f"{name}(a=x)", f"{name}(a=1, a=2)", f"{name}(a=b'x')"]))
    arguments = draw(PY_ARGUMENTS)
    spelled = [f"{key}={draw(python_literal(value, writer.shapes))}" for key, value in arguments.items()]
    return f"{name}({', '.join(spelled)})"


@st.composite
def pythonic_outputs(draw: st.DrawFn, tags: bool = False) -> Output:
    """A text answer, a Python list answer, or [text <|python_start|>] [f(a=1), ...] [<|python_end|>]
    [text] (``tags``: Llama 4's python tags)."""
    writer = Writer()
    kind = draw(st.sampled_from(["text", "list_answer", "calls", "calls", "calls"]))
    if kind == "text":
        writer.text(draw(words(LLAMA_TEXT).filter(lambda text: text.strip())))
        return writer.output()
    if kind == "list_answer":
        writer.shapes.add("list_answer")  # a call until it is no call (a cut inside it is not compared)
        value = draw(st.lists(JSON_VALUES, min_size=1, max_size=3))
        writer.call(
            ("[" + ", ".join(draw(python_literal(item, writer.shapes)) for item in value) + "]", False)
        )
        return writer.output()
    tagged = tags and draw(st.booleans())
    if tagged and draw(st.integers(0, 4)) == 0:
        writer.shapes.add("text_before_python_start")
        writer.text(draw(words(LLAMA_TEXT)))
    elif draw(st.integers(0, 9)) == 0:
        writer.shapes.add("leading_whitespace")
        writer.text(draw(st.sampled_from([" ", "\n", "\n\n  "])))
    count = draw(st.integers(1, 3))
    writer.shapes.update(["calls"] + (["several_calls"] if count > 1 else []))
    separator = draw(st.sampled_from([", ", ","]))
    listed = "[" + separator.join(draw(python_call(writer)) for _ in range(count)) + "]"
    pieces: list[Segment] = [(PYTHON_START, True)] if tagged else []
    pieces.append((listed, False))
    if tagged and draw(st.booleans()):
        pieces.append((PYTHON_END, True))
    writer.call(*pieces)
    after = draw(words(LLAMA_TEXT, min_size=0)) if draw(st.integers(0, 3)) == 0 else ""
    if after.strip():
        writer.shapes.add("text_after_calls")
        writer.text(" " + after)
    return writer.output()


def example(
    *segments: Segment,
    prompt: PromptEnd = "plain",
    shapes: tuple[str, ...] = (),
    typed: str = "",
    after: str = "",
) -> Output:
    """An output of these segments; ``typed``: then a marker the model wrote as text, piece by piece,
    and ``after`` it."""
    writer = Writer()
    for text, marker in segments:
        writer.marker(text) if marker else writer.text(text)
    if typed:
        writer.typed(typed)
    writer.text(after)
    writer.shapes.update(shapes)
    return writer.output(prompt)


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'

HERMES_HELD = (CALL_OPEN,)
HERMES_DIVERGENCES = (
    Divergence(
        "text_after_calls",
        MODES,
        "vLLM's hermes parser drops the text after the first <tool_call> (content is what precedes it)",
        example((CALL_OPEN, True), (WEATHER, False), (CALL_CLOSE, True), (" and more text", False)),
    ),
    Divergence(
        "typed_marker",
        MODES,
        "vLLM's parsers read decoded text: a tag the model spelled in pieces (no tag token) is taken "
        "for the tag; ours match tag tokens by id, so spelled text stays text",
        example(("I would write ", False), typed=CALL_OPEN, after=WEATHER),
    ),
    Divergence(
        "invalid_call",
        MODES,
        "vLLM's hermes parser, whole, returns every call as content when one block is no call; streaming, "
        "it sends the broken block as a call with arguments that are not JSON. Ours: that block (tags "
        "included) is content, the other calls are calls",
        example(
            (CALL_OPEN, True),
            (WEATHER, False),
            (CALL_CLOSE, True),
            (CALL_OPEN, True),
            ('{"name": "f", "arguments": {"x": }', False),
            (CALL_CLOSE, True),
        ),
    ),
    Divergence(
        "call_without_arguments",
        MODES,
        'vLLM\'s hermes parser needs "arguments": without it, whole, every call becomes content; '
        'streaming, the call has arguments "". Ours: arguments {}',
        example((CALL_OPEN, True), ('{"name": "f"}', False), (CALL_CLOSE, True)),
    ),
    Divergence(
        "ends_in_tag_prefix",
        ("streamed",),
        "vLLM's hermes parser, streaming, holds back an end of the answer that could still become "
        "<tool_call> ('<', '<tool') and never releases it when the answer ends",
        example(("Use a < b", False), (" or x <", False)),
    ),
)

QWEN3_DIVERGENCES = (
    Divergence(
        "no_think_block",
        MODES,
        "vLLM's qwen3 parser (thinking enabled) reads an answer as reasoning up to a </think> even when "
        "neither the prompt nor the answer opened a think block; we read the prompt: no open block and no "
        "<think> at the start of the answer is content",
        example(("Paris is sunny.", False), shapes=("no_think_block",)),
    ),
)

LLAMA3_DIVERGENCES = (
    Divergence(
        "text_after_calls",
        MODES,
        "vLLM's llama3_json parser drops text after the calls (whole: content is None once a call is "
        "found; streaming: the text fails to parse as JSON and is never sent). Ours: it is content",
        example((LLAMA_WEATHER, False), (" Done.", False)),
    ),
    Divergence(
        "json_answer",
        ("streamed",),
        "vLLM's llama3_json parser, streaming, sends nothing for an answer that is a JSON object without "
        '"name" (the client gets no content). Ours: it is content, as vLLM\'s whole answer has it',
        example(('{"answer": 42}', False)),
    ),
    Divergence(
        "empty_arguments",
        ("streamed",),
        "vLLM's llama3_json parser never streams the arguments of a call whose arguments are {} "
        "(the client assembles arguments '')",
        example((LLAMA_WEATHER.replace('{"city": "Paris"}', "{}"), False), shapes=("empty_arguments",)),
    ),
    Divergence(
        "other_separator",
        ("streamed",),
        "vLLM's llama3_json parser streams the calls after the first only when they are separated by "
        "exactly '; ' (it skips two characters after each object); ';' alone loses them",
        example((LLAMA_WEATHER, False), (";", False), (LLAMA_WEATHER, False), shapes=("other_separator",)),
    ),
)


def deepseek_calls(*calls: tuple[str, str], v3: bool = False, between: str = "") -> tuple[Segment, ...]:
    """A calls section of (name, arguments) in V3's form or V3.1's."""
    segments: list[Segment] = [(CALLS_BEGIN, True)]
    for index, (name, arguments) in enumerate(calls):
        if index and between:
            segments.append((between, False))
        head, body = ("function", f"{name}\n```json\n{arguments}\n```") if v3 else (name, arguments)
        segments += [(CALL_BEGIN, True), (head, False), (TOOL_SEP, True), (body, False), (CALL_END, True)]
    return (*segments, (CALLS_END, True))


CODER_CALL = ((CALL_OPEN, True), ("\n<function=f>\n</function>\n", False), (CALL_CLOSE, True))
CODER_DIVERGENCES = (
    Divergence(
        "text_after_calls",
        ("whole",),
        "vLLM's qwen3_coder parser, whole, drops the text after the last call (it is deferred and never "
        "released once calls were found). Ours: it is content, as vLLM's streaming sends it",
        example(*CODER_CALL, ("ok", False)),
    ),
    Divergence(
        "text_around_calls",
        ("streamed",),
        "vLLM's qwen3_coder parser, streaming, sends the whitespace between calls as content, and drops "
        "the text after a call without <tool_call> around it. Ours: whitespace between calls is "
        "dropped, text after any call is content",
        example(("a", False), *CODER_CALL, ("\n", False), *CODER_CALL, ("b", False)),
    ),
    Divergence(
        "json_body",
        MODES,
        "vLLM's qwen3_coder parser drops whatever stands in <tool_call> before a <function=: a JSON "
        "(Hermes) body vanishes. Ours: the block is no call, its text content, counted",
        example((CALL_OPEN, True), ("\n" + WEATHER + "\n", False), (CALL_CLOSE, True)),
    ),
    Divergence(
        "unclosed_function",
        MODES,
        "vLLM's qwen3_coder parser reads a </tool_call> inside a function as argument text: a function "
        "without </function> swallows the rest of the answer, later calls included. Ours: </tool_call> "
        "ends the call (counted), what follows is read as usual",
        example(
            (CALL_OPEN, True),
            ("\n<function=f>\n", False),
            (CALL_CLOSE, True),
            ("\n", False),
            *CODER_CALL,
        ),
    ),
    Divergence(
        "unclosed_value",
        MODES,
        "vLLM's qwen3_coder parser drops a value without </parameter> before </function>; ours keeps it "
        "(counted)",
        example(
            (CALL_OPEN, True), ("\n<function=f>\n<parameter=a>\n1\n</function>\n", False), (CALL_CLOSE, True)
        ),
    ),
    Divergence(
        "typed_marker",
        ("whole",),
        "vLLM's qwen3_coder parser, whole, reads the content as text: a tag the model spelled in pieces "
        "(no tag token) is taken for the tag; ours (and vLLM's streaming) match tag tokens by id",
        example(("I would write ", False), typed=CALL_OPEN, after="text"),
    ),
)


def deepseek_divergences(v3: bool, prompt: PromptEnd = "plain") -> tuple[Divergence, ...]:
    weather = ("get_weather", '{"city": "Paris"}')
    return (
        Divergence(
            "text_after_calls",
            ("whole",),
            "vLLM's deepseek parsers, whole, drop the text after <｜tool▁calls▁begin｜> that is no call "
            "(content is what precedes it). Ours: it is content, as vLLM's streaming sends it",
            example(*deepseek_calls(weather, v3=v3), (" and more text", False), prompt=prompt),
        ),
        Divergence(
            "text_around_calls",
            ("streamed",),
            "vLLM's deepseek parsers, streaming, send the whitespace between calls as content. Ours: it "
            "is dropped",
            example(
                ("a", False),
                *deepseek_calls(weather, weather, v3=v3, between="\n"),
                ("b", False),
                prompt=prompt,
            ),
        ),
        Divergence(
            "typed_marker",
            ("whole",),
            "vLLM's deepseek parsers, whole, look for <｜tool▁calls▁begin｜> in the decoded text: a marker "
            "the model spelled in pieces (no marker token) is taken for it; ours (and vLLM's streaming) "
            "match marker tokens by id",
            example(("I would write ", False), typed=CALLS_BEGIN, after="text", prompt=prompt),
        ),
        Divergence(
            "multiline_arguments",
            MODES,
            "vLLM's deepseek parsers match a call's arguments with '.' (no newline): pretty-printed "
            "arguments lose the call (whole) or send a partial one (streaming). Ours: the call",
            example(*deepseek_calls(("get_weather", '{\n  "city": "Paris"\n}'), v3=v3), prompt=prompt),
        ),
        Divergence(
            "invalid_call",
            MODES,
            "vLLM's deepseek parsers return a call whose arguments are not a JSON object as a call with "
            "those arguments; ours: its text (markers spelled) is content, counted",
            example(*deepseek_calls(("f", '{"x": }'), v3=v3), prompt=prompt),
        ),
    )


HARMONY_DIVERGENCES = (
    Divergence(
        "several_text_messages",
        ("streamed",),
        "vLLM's HarmonyParser joins the texts of several analysis (or content) messages with a newline "
        "in a whole answer but streams them with nothing between; ours joins them with the newline both ways",
        example(
            (H_CHANNEL, True),
            ("analysis", False),
            (H_MESSAGE, True),
            ("first", False),
            (H_END, True),
            (H_START, True),
            ("assistant", False),
            (H_CHANNEL, True),
            ("analysis", False),
            (H_MESSAGE, True),
            ("second", False),
        ),
    ),
    Divergence(
        "invalid_call",
        MODES,
        "vLLM's HarmonyParser returns a call whose body is not JSON with that text as its arguments "
        "(not JSON); ours: the body is content, counted as invalid_tool_call",
        example(
            (H_CHANNEL, True),
            ("commentary to=functions.f", False),
            (H_MESSAGE, True),
            ("not json", False),
            (H_CALL, True),
        ),
    ),
)
K2_WEATHER = (K2_CALL_OPEN, True), ("functions.get_weather:0", False), (K2_ARGUMENTS, True)
KIMI_K2_DIVERGENCES = (
    Divergence(
        "invalid_call",
        MODES,
        "vLLM's kimi_k2 parser returns a call whose arguments are not JSON with that text as its "
        "arguments; ours: the call's text (its id and arguments, markers dropped) is content, counted",
        example((K2_SECTION_OPEN, True), *K2_WEATHER, ("not json", False), (K2_CALL_END, True)),
    ),
    Divergence(
        "text_after_calls",
        MODES,
        "vLLM's kimi_k2 parser stays in its tool state after <|tool_calls_section_end|> and drops the "
        "text after the section; ours: it is content",
        example(
            (K2_SECTION_OPEN, True),
            *K2_WEATHER,
            ('{"city": "Paris"}', False),
            (K2_CALL_END, True),
            (K2_SECTION_CLOSE, True),
            (" Done.", False),
        ),
    ),
)
GLM_WEATHER = (
    (GLM_CALL_OPEN, True),
    ("get_weather\n", False),
    ("<arg_key>", True),
    ("city", False),
    ("</arg_key>", True),
    ("\n", False),
    ("<arg_value>", True),
    ("Paris", False),
    ("</arg_value>", True),
    ("\n", False),
    (GLM_CALL_CLOSE, True),
)
GLM45_DIVERGENCES = (
    Divergence(
        "text_after_calls",
        ("whole",),
        "vLLM's glm45 parser, whole, defers the text after a call and never returns it; ours: it is "
        "content (as vLLM streams it)",
        example(*GLM_WEATHER, (" Done.", False)),
    ),
    Divergence(
        "text_after_several_calls",
        ("streamed",),
        "vLLM's glm45 parser, streaming, sends the whitespace between calls as content once text "
        "follows them; ours drops whitespace alone between calls (as its whole answer does)",
        example(("Sure.\n", False), *GLM_WEATHER, ("\n", False), *GLM_WEATHER, (" Done.", False)),
    ),
)
GLM45_REASONING_DIVERGENCES = (
    Divergence(
        "no_think_block",
        MODES,
        "vLLM's glm45 reasoning parser (thinking enabled) reads an answer as reasoning up to a </think> "
        "even when the model opened no think block; ours: without <think> at the start it is content",
        example(("Paris is sunny.", False), shapes=("no_think_block",)),
    ),
)

PY_WEATHER = "get_weather(city='Paris')"
PYTHONIC_DIVERGENCES = (
    Divergence(
        "list_answer",
        ("streamed",),
        "vLLM's pythonic parsers, streaming, send nothing for an answer that opens with '[' but is no "
        "list of calls (a Python list, '[citation needed] ...'): the client gets no content. Ours: it is "
        "content, as vLLM's whole answer has it",
        example(("[1, 'a']", False)),
    ),
    Divergence(
        "text_after_calls",
        MODES,
        "vLLM's pythonic parsers: whole, text after the list makes the whole answer content (no calls); "
        "streaming, the text is never sent. Ours: the calls, and the text as content",
        example((f"[{PY_WEATHER}]", False), (" Done.", False)),
    ),
    Divergence(
        "invalid_call",
        MODES,
        "vLLM's pythonic parsers drop positional arguments (f(1) becomes f with {}; whole only after "
        "the first call, where its regex lets them through) and, streaming, send nothing for a call "
        "whose value is no literal (f(a=x)). Ours: a call that is not name(key=literal, ...) is "
        "content, and so is the rest of the list",
        example((f"[{PY_WEATHER}, lookup(1)]", False)),
    ),
    Divergence(
        "float",
        ("streamed",),
        "vLLM's pythonic parsers, streaming, re-serialize each partial call and send what is longer than "
        "what was sent: a float whose partial text serializes otherwise (0. as 0.0, 1.1 as 1.1 then "
        "1.1000000729317376e+16) can reach the client corrupted (here 0.5 became 0.0)",
        example(("[get_weather(b=None, a=(None, 0), a0=0.5)]", False)),
    ),
    Divergence(
        "leading_whitespace",
        MODES,
        "vLLM's pythonic parsers read calls only when '[' is the answer's first character; ours also "
        "after whitespace (as llama3_json)",
        example((f"\n[{PY_WEATHER}]", False)),
    ),
)
LLAMA4_PYTHONIC_DIVERGENCES = (
    *PYTHONIC_DIVERGENCES,
    Divergence(
        "text_before_python_start",
        MODES,
        "vLLM never sees <|python_start|> (a special token, skipped when decoding), so a list after text "
        "is content; ours reads the tag from its id and the calls after it (as llama3_json's python tag)",
        example(
            ("Let me look. ", False), (PYTHON_START, True), (f"[{PY_WEATHER}]", False), (PYTHON_END, True)
        ),
    ),
)

FAMILIES = [
    Family("hermes", QWEN3, "hermes", None, hermes_outputs(), chatml_prompt, HERMES_DIVERGENCES, HERMES_HELD),
    Family(
        "qwen3+hermes",
        QWEN3,
        "hermes",
        "qwen3",
        hermes_outputs(("open", "closed", "plain")),
        chatml_prompt,
        HERMES_DIVERGENCES + QWEN3_DIVERGENCES,
        HERMES_HELD,
    ),
    Family(
        "qwen3",
        QWEN3,
        None,
        "qwen3",
        reasoning_outputs(("open", "closed", "plain")),
        chatml_prompt,
        QWEN3_DIVERGENCES,
    ),
    Family("deepseek_r1", DEEPSEEK, None, "deepseek_r1", reasoning_outputs(("open",)), deepseek_prompt),
    Family("llama3_json", LLAMA3, "llama3_json", None, llama3_outputs(), llama3_prompt, LLAMA3_DIVERGENCES),
]
FAMILIES += [
    Family(
        "deepseek_v3",
        DEEPSEEK,
        "deepseek_v3",
        None,
        deepseek_outputs(True),
        deepseek_prompt,
        deepseek_divergences(v3=True),
    ),
    Family(
        "deepseek_v31",
        DEEPSEEK,
        "deepseek_v31",
        None,
        deepseek_outputs(False),
        deepseek_prompt,
        deepseek_divergences(v3=False),
    ),
    Family(
        "deepseek_v3-reasoning",
        DEEPSEEK,
        None,
        "deepseek_v3",
        reasoning_outputs(("open", "closed")),
        deepseek_prompt,
    ),
    Family(
        "deepseek_v3+deepseek_v31",
        DEEPSEEK,
        "deepseek_v31",
        "deepseek_v3",
        deepseek_outputs(False, ("open", "closed")),
        deepseek_prompt,
        deepseek_divergences(v3=False, prompt="closed"),
    ),
    Family(
        "qwen3_coder",
        QWEN3,
        "qwen3_coder",
        None,
        coder_outputs(),
        chatml_prompt,
        CODER_DIVERGENCES,
        text_markers=CODER_TEXT_MARKERS,
        properties=CODER_PROPERTIES,
    ),
    Family(
        "qwen3+qwen3_coder",
        QWEN3,
        "qwen3_coder",
        "qwen3",
        coder_outputs(("open", "closed", "plain")),
        chatml_prompt,
        CODER_DIVERGENCES + QWEN3_DIVERGENCES,
        text_markers=CODER_TEXT_MARKERS,
        properties=CODER_PROPERTIES,
    ),
]
FAMILIES += [  # Mistral (tests/engines/oracle_mistral.py): pre-v11 JSON arrays (tekken, SentencePiece), v11+
    Family(
        "mistral_nemo",
        NEMO,
        "mistral",
        None,
        json_form_outputs(),
        mistral_prompt,
        (*JSON_FORM_DIVERGENCES, TYPED_JSON_FORM),
    ),
    Family(
        "mistral_v3",
        V3,
        "mistral",
        None,
        json_form_outputs(typed=False),
        mistral_prompt,
        JSON_FORM_DIVERGENCES,
    ),
    Family(
        "mistral+mistral",
        SMALL3,
        "mistral",
        "mistral",
        v11_outputs(thinking=True),
        mistral_prompt,
        V11_DIVERGENCES + REASONING_DIVERGENCES,
        HELD,
    ),
    Family(
        "mistral_small_3",
        SMALL3,
        "mistral",
        None,
        v11_outputs(thinking=False),
        mistral_prompt,
        V11_DIVERGENCES,
    ),
    Family(
        "mistral_think", SMALL3, None, "mistral", think_outputs(), mistral_prompt, REASONING_DIVERGENCES, HELD
    ),
]
FAMILIES += [  # vLLM's aliases: the same classes under another name, on both sides
    Family(
        "qwen3_json",
        QWEN3,
        "qwen3_json",
        None,
        hermes_outputs(),
        chatml_prompt,
        HERMES_DIVERGENCES,
        HERMES_HELD,
    ),
    Family("llama4_json", LLAMA3, "llama4_json", None, llama3_outputs(), llama3_prompt, LLAMA3_DIVERGENCES),
]
FAMILIES += [
    Family(
        "openai_gptoss+openai",
        GPT_OSS,
        "openai",
        "openai_gptoss",
        harmony_outputs(),
        harmony_prompt,
        HARMONY_DIVERGENCES,
        harmony=True,
    ),
    Family("kimi_k2", KIMI_K2, "kimi_k2", None, kimi_k2_outputs(), kimi_k2_prompt, KIMI_K2_DIVERGENCES),
    Family("glm45", GLM45, "glm45", None, glm45_outputs(), glm45_prompt, GLM45_DIVERGENCES),
    Family(
        "glm45-typed",
        GLM45,
        "glm45",
        None,
        glm45_typed_outputs(),
        glm45_prompt,
        GLM45_DIVERGENCES,
        parameters=TYPED_PARAMETERS,
    ),
    Family(
        "glm45+glm45",
        GLM45,
        "glm45",
        "glm45",
        glm45_outputs(("closed", "plain")),
        glm45_prompt,
        GLM45_DIVERGENCES + GLM45_REASONING_DIVERGENCES,
    ),
]
FAMILIES += [
    Family("pythonic", LLAMA3, "pythonic", None, pythonic_outputs(), llama3_prompt, PYTHONIC_DIVERGENCES),
    Family(
        "llama4_pythonic",
        LLAMA4,
        "llama4_pythonic",
        None,
        pythonic_outputs(tags=True),
        llama4_prompt,
        LLAMA4_PYTHONIC_DIVERGENCES,
    ),
]
FAMILY_IDS = [family.id for family in FAMILIES]
ORACLE_LESS = {"kimi_k3": "vLLM reads K3's XTML with text regexes; docs/answers.md lists where it differs"}


def test_every_registered_name_is_vllms_and_is_tested_here() -> None:
    from vllm.reasoning import ReasoningParserManager  # noqa: PLC0415
    from vllm.tool_parsers import ToolParserManager  # noqa: PLC0415

    assert set(TOOL_CALL_PARSERS) <= set(ToolParserManager.list_registered())
    assert set(REASONING_PARSERS) <= set(ReasoningParserManager.list_registered())
    tested = {name for family in FAMILIES for name in (family.tool_parser, family.reasoning_parser)}
    assert {*TOOL_CALL_PARSERS, *REASONING_PARSERS} - set(ORACLE_LESS) <= tested


def check_against_vllm(family: Family, directory: Path, output: Output) -> None:
    ours = our_answers(family, directory, output)
    for mode in MODES:
        if family.known(output, mode) is not None:
            continue
        found = differences(ours, vllm_answer(family, directory, output, mode))
        assert not found, f"{family.id}, vLLM {mode}, {output.segments!r}: {found}"


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_same_answer_as_vllm(family: Family, models: dict[str, Path], data: st.DataObject) -> None:
    directory = models[family.model]
    check_against_vllm(family, directory, data.draw(family.outputs))


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
@settings(max_examples=max(1, EXAMPLES // 8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_truncated_at_every_position(family: Family, models: dict[str, Path], data: st.DataObject) -> None:
    """Cut by max_tokens anywhere: ours never half-sends a call and agrees with vLLM wherever the cut
    falls outside a call (inside one, vLLM returns the partial call text or a partial call) and
    outside a marker matched in text (ours drop the partial marker: it may have begun a call)."""
    directory = models[family.model]
    output = data.draw(family.outputs)
    tokenizer = our_tokenizer(directory)
    ids = output.ids(tokenizer)
    full = our_answers(family, directory, output)
    for cut in range(len(ids) + 1):
        text = tokenizer.decode(ids[:cut]).rstrip("\ufffd")  # a character the cut split is dropped
        at = len(text)
        ours = our_answers(family, directory, output, "length", cut)
        assert ours.calls == full.calls[: len(ours.calls)]
        assert full.reasoning.startswith(ours.reasoning) and full.content.startswith(ours.content)
        if any(start < at < end for start, end in output.call_spans) or family.cut_in_marker(text):
            continue
        for mode in MODES:
            if family.known(output, mode, text) is None:
                found = differences(ours, vllm_answer(family, directory, output, mode, cut))
                assert not found, f"{family.id}, vLLM {mode}, cut at {cut} of {output.segments!r}: {found}"


DIVERGENCES = [
    pytest.param(
        family,
        divergence,
        mode,
        id=f"{family.id}-{divergence.shape}-{mode}",
        marks=pytest.mark.xfail(strict=True, reason=divergence.reason),
    )
    for family in FAMILIES
    for divergence in family.divergences
    for mode in divergence.modes
]


@pytest.mark.parametrize(("family", "divergence", "mode"), DIVERGENCES)
def test_known_vllm_divergence(
    family: Family, divergence: Divergence, mode: Mode, models: dict[str, Path]
) -> None:
    """vLLM's answer to the divergence's example differs from ours (strict xfail: a fix shows)."""
    directory = models[family.model]
    ours = our_answers(family, directory, divergence.example)
    assert not differences(ours, vllm_answer(family, directory, divergence.example, mode))
