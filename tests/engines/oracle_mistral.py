"""Mistral's outputs and vLLM's known bugs on them, for ``test_parser_oracle`` (``parser_oracle``).

vLLM's ``mistral`` parser is tested with a Hugging Face tokenizer (our directories are Hugging Face
checkpoints, as ``vllm serve --tokenizer-mode hf`` loads them), not mistral-common's
``MistralTokenizer``. With one, vLLM picks its path from the vocabulary: without ``[ARGS]`` (v3, v7,
Nemo, Pixtral) its pre-v11 path (``[TOOL_CALLS]`` + a JSON array); with ``[ARGS]`` (Mistral Small
3.2) its engine path (``[TOOL_CALLS]name[ARGS]{...}``); reasoning only where ``[THINK]`` is a token.
"""

from __future__ import annotations

from hypothesis import strategies as st
from parser_oracle import (
    ARGUMENTS,
    MODES,
    TOOL_NAMES,
    Divergence,
    Output,
    PromptEnd,
    Segment,
    Writer,
    json_text,
    words,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
THINK_OPEN, THINK_CLOSE = "[THINK]", "[/THINK]"
NEMO, V3, SMALL3 = "mistral_nemo", "mistral_v3", "mistral_small_3"  # tests/support/hf_models directories
TEXT = "abcxyz ,.!?:\n\t'\"\\<>()#*-你好é😀"  # no brackets: text after an array is never taken for JSON
CALL_IDS = st.text(alphabet="abcXYZ0129", min_size=9, max_size=9)


def mistral_prompt(end: PromptEnd) -> list[Segment]:
    """``<s>[INST]hi[/INST]``: Mistral's prompts never open a reasoning block (the model writes [THINK])."""
    return [("<s>", True), ("[INST]", True), ("hi", False), ("[/INST]", True)]


def now_and_then(draw: st.DrawFn, times: int) -> bool:
    """True about once in ``times`` draws (shapes vLLM gets wrong stay rare, so most outputs compare)."""
    return draw(st.sampled_from([False] * (times - 1) + [True]))


def after_calls(draw: st.DrawFn) -> str:
    """What follows the calls: mostly nothing or whitespace, now and then text."""
    return draw(st.sampled_from(["", "", "\n", "  \n"])) if not now_and_then(draw, 5) else draw(words(TEXT))


def typed_marker(draw: st.DrawFn, writer: Writer, markers: tuple[str, ...]) -> None:
    """Now and then, a control token the model spelled as text (its pieces, never its id)."""
    if now_and_then(draw, 10):
        writer.shapes.add("typed_marker")
        writer.typed(draw(st.sampled_from(markers)))


BAD_ELEMENTS = ("3", '{"arguments": [1]}', '{"name": 3, "arguments": {}}', '{"x": 1}')


@st.composite
def json_form_call(draw: st.DrawFn, writer: Writer) -> str:
    """One element of the array: a call, now and then one without arguments or one that is no call."""
    kind = draw(st.sampled_from(["call"] * 18 + ["call_without_arguments", "invalid_call"]))
    body: dict[str, object] = {"name": draw(st.sampled_from(TOOL_NAMES))}
    if kind == "invalid_call":
        writer.shapes.add(kind)
        return draw(st.sampled_from(BAD_ELEMENTS))
    if kind == "call":
        body["arguments"] = draw(ARGUMENTS)
    else:
        writer.shapes.add(kind)
    if now_and_then(draw, 5):
        body["id"] = draw(CALL_IDS)  # the model echoes the id its template showed it
    return draw(json_text(body))


@st.composite
def json_form_outputs(draw: st.DrawFn, *, typed: bool = True) -> Output:
    """Tokenizers before v11: text [TOOL_CALLS] [{"name", "arguments"}, ...] (or one bare object) [text].
    ``typed``: the marker spelled as text now and then (not on SentencePiece, whose decoder puts a space
    between the spelled pieces, so the text is no longer the segments'; no marker either way)."""
    writer = Writer()
    before = draw(words(TEXT, min_size=0))
    writer.text(before)
    if typed:
        typed_marker(draw, writer, (TOOL_CALLS,))
    blocks = draw(st.sampled_from([1, 1, 1, 1, 1, 1, 0, 2]))
    for block in range(blocks):
        count = draw(st.integers(1, 3))
        elements = [draw(json_form_call(writer)) for _ in range(count)]
        bare = count == 1 and draw(st.booleans())
        separator = draw(st.sampled_from([", ", ","]))
        body = elements[0] if bare else "[" + separator.join(elements) + "]"
        space = draw(st.sampled_from(["", " "]))
        writer.call((TOOL_CALLS, True), (space + body, False))
        writer.shapes.update(
            ["calls"] + (["several_markers"] if block else []) + (["bare_object"] if bare else [])
        )
    after = after_calls(draw) if blocks else ""
    if after.strip():
        writer.shapes.add("text_after_calls")
    writer.text(after)
    if blocks and before.strip():
        writer.shapes.add("text_before_calls")
    return writer.output()


@st.composite
def v11_outputs(draw: st.DrawFn, thinking: bool) -> Output:
    """Mistral Small 3.2 / Magistral: [[THINK]...[/THINK]] text, then
    ([TOOL_CALLS]name[[CALL_ID]id][ARGS]{...})* [text]."""
    writer = Writer()
    if thinking and draw(st.booleans()):
        writer.shapes.add("think")
        writer.marker(THINK_OPEN).text(draw(words())).marker(THINK_CLOSE)
    before = draw(words(TEXT, min_size=0))
    writer.text(before)
    if thinking:
        typed_marker(draw, writer, (TOOL_CALLS, ARGS, THINK_OPEN, THINK_CLOSE))
    else:
        typed_marker(draw, writer, (TOOL_CALLS, ARGS))
    count = draw(st.sampled_from([1, 1, 2, 3, 0]))
    for index in range(count):
        if index:
            writer.text(draw(st.sampled_from(["", "\n", " "])))
        pieces: list[Segment] = [(TOOL_CALLS, True), (draw(st.sampled_from(TOOL_NAMES)), False)]
        if now_and_then(draw, 10):
            writer.shapes.add("call_id")
            pieces += [(CALL_ID, True), (draw(CALL_IDS), False)]
        if now_and_then(draw, 16):
            writer.shapes.add("invalid_arguments")
            arguments = draw(st.sampled_from(['{"x": }', "[1]", '"text"', '{"a": 1']))
        else:
            arguments = draw(json_text(draw(ARGUMENTS)))
        writer.call(*pieces, (ARGS, True), (arguments, False))
    after = after_calls(draw) if count else ""
    if after.strip():
        writer.shapes.add("text_after_calls")
    writer.text(after)
    writer.shapes.update(["calls"] if count else [])
    return writer.output()


@st.composite
def think_outputs(draw: st.DrawFn) -> Output:
    """[THINK] reasoning [/THINK] text, [THINK] more reasoning later, or text alone (reasoning only)."""
    writer = Writer()
    kind = draw(st.sampled_from(["think", "think", "later", "none", "unclosed"]))
    if kind in ("think", "unclosed"):
        writer.marker(THINK_OPEN).text(draw(words()))
        if kind == "think":
            writer.marker(THINK_CLOSE)
    writer.text(draw(words(min_size=0)))
    if kind == "later":
        writer.marker(THINK_OPEN).text(draw(words())).marker(THINK_CLOSE).text(draw(words(min_size=0)))
    return writer.output()


def example(*segments: Segment, shapes: tuple[str, ...] = (), typed: str = "", after: str = "") -> Output:
    writer = Writer()
    for text, marker in segments:
        writer.marker(text) if marker else writer.text(text)
    if typed:
        writer.typed(typed)
    writer.text(after)
    writer.shapes.update(shapes)
    return writer.output()


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = (TOOL_CALLS, True)

JSON_FORM_DIVERGENCES = (
    Divergence(
        "text_after_calls",
        ("whole",),
        "vLLM's mistral parser (pre-v11), whole, drops the text after the calls' JSON (streaming sends it "
        "as content). Ours: content, both ways",
        example(T, (f"[{WEATHER}]", False), (" Done.", False)),
    ),
    Divergence(
        "several_markers",
        MODES,
        "vLLM's mistral parser (pre-v11) reads the JSON after the first [TOOL_CALLS] only: whole, the "
        "later calls are dropped; streaming, they are sent as content. Ours: each [TOOL_CALLS] opens calls",
        example(T, (f"[{WEATHER}]", False), T, (f"[{WEATHER}]", False)),
    ),
    Divergence(
        "invalid_call",
        MODES,
        "vLLM's mistral parser (pre-v11) skips the elements that are no call and keeps the others (whole), "
        "or sends a call with arguments that are not JSON (streaming); an array with no call at all "
        "becomes content without the text before [TOOL_CALLS]. Ours: the block (one array) is content, "
        "as written, unless every element is a call",
        example(("pre ", False), T, (f"[{WEATHER}, 3]", False)),
    ),
    Divergence(
        "call_without_arguments",
        ("streamed",),
        'vLLM\'s mistral parser (pre-v11), streaming, sends arguments "" for a call without "arguments" '
        "(whole: {}). Ours: {}",
        example(T, ('[{"name": "f"}]', False)),
    ),
)
V11_DIVERGENCES = (
    Divergence(
        "call_id",
        MODES,
        "vLLM's mistral parser (v11+ with a Hugging Face tokenizer) does not know [CALL_ID]: the name it "
        "returns is name[CALL_ID]id. Ours: the name, the model's id dropped (ours are generated)",
        example(T, ("f", False), (CALL_ID, True), ("a1B2c3D4e", False), (ARGS, True), ("{}", False)),
    ),
    Divergence(
        "text_after_calls",
        MODES,
        "vLLM's mistral parser (v11+) drops the text after a call's arguments (whole) or sends it as part "
        "of the arguments, which are then not JSON (streaming). Ours: content",
        example(T, ("f", False), (ARGS, True), ('{"a": 1}', False), (" Done.", False)),
    ),
    Divergence(
        "invalid_arguments",
        MODES,
        "vLLM's mistral parser (v11+) returns a call whose arguments are not a JSON object (not JSON, an "
        "array, a string, cut short) as a call. Ours: it is no call; its text is content",
        example(T, ("f", False), (ARGS, True), ('{"x": }', False)),
    ),
    Divergence(
        "typed_marker",
        ("whole",),
        "vLLM's mistral parser, whole, finds the markers in the decoded text too: a control token the model "
        "spelled as text ([TOOL_CALLS], [THINK]) is taken for it (streaming reads ids). Ours: only its id "
        "is the marker, both ways",
        example(("I would write ", False), typed=TOOL_CALLS, after='f[ARGS]{"a": 1}'),
    ),
)
TYPED_JSON_FORM = Divergence(
    "typed_marker",
    ("whole",),
    "vLLM's mistral parser (pre-v11), whole, looks for [TOOL_CALLS] in the decoded text: the marker spelled "
    "as text is taken for the control token (streaming reads ids). Ours: only its id is the marker. (A "
    "SentencePiece vocabulary decodes the spelled pieces with a space between them: no divergence there)",
    example(("I would write ", False), typed=TOOL_CALLS, after=f"[{WEATHER}]"),
)

HELD = (THINK_OPEN, THINK_CLOSE, TOOL_CALLS, ARGS, "</s>")
"""What vLLM's streaming engine holds back at the end of the answer (the markers' spellings; ``</s>``
too, decoded as text)."""
REASONING_DIVERGENCES = (
    Divergence(
        "ends_in_tag_prefix",
        ("streamed",),
        "vLLM's mistral parser, streaming, loses the whitespace before an end of the answer that could "
        "still grow into a marker's text ('[', '[T', '<', '</') when the answer ends inside reasoning",
        example((THINK_OPEN, True), ("a", False), (" [", False)),
    ),
)
