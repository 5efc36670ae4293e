"""Our answer parsers against vLLM's own (``parser_oracle``): generated outputs of each family, whole
and streamed id by id, truncated at every position. A family is one ``Family`` line in ``FAMILIES``
(its vLLM names, its model directory, its output strategy, vLLM's known bugs)."""

from __future__ import annotations

import os
from pathlib import Path

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
    ARGUMENTS,
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


LLAMA3, QWEN3, DEEPSEEK = "llama3", "qwen3", "deepseek_v3"  # tests/support/hf_models directories


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
    """DeepSeek-R1's template opens the think block after the assistant marker."""
    head: list[Segment] = [("<｜begin▁of▁sentence｜>", True), ("<｜User｜>", True), ("hi", False)]
    head += [("<｜Assistant｜>", True)]
    return [*head, (THINK_OPEN, True), ("\n", False)] if end == "open" else head


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
    falls outside a call (inside one, vLLM returns the partial call text or a partial call)."""
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
        if any(start < at < end for start, end in output.call_spans):
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
