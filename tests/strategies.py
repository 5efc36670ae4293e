"""Hypothesis strategies and property checks shared by ``tests/test_fuzz.py`` and ``benchmarks/fuzz.py``.

Both runs import this module, so the seeded slice in ``make test`` and the >= 10,000-case benchmark
run check exactly the same properties over exactly the same input distributions.

Inputs are plain trees (dicts, lists, scalars) that may hold ``Fragment`` leaves: a deep nesting,
a huge integer or string, an odd JSON number. A fragment stays a small object while hypothesis
generates, shrinks and prints the example, and becomes the real (possibly hostile) value only in
``materialize`` / ``to_json_bytes`` / ``to_msgpack``, right before the code under test sees it.

Each ``check_*`` function runs one example and returns an ``Outcome`` label:

* ``"ok"``: accepted, every property held;
* ``"rejected:<Type>"``: the documented error type was raised (a 400, a skipped message);
* ``"known:<key>"``: an already reported bug was hit (see ``KNOWN_BUGS``);

anything else is an ``AssertionError`` (a property failed) or the unexpected exception itself.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import msgspec
from hypothesis import strategies as st

from dynamo_prep.card import (
    CardDecodeError,
    FileRef,
    ModelDeploymentCard,
    ModelRuntimeConfig,
    decode_card,
    encode_card,
)
from dynamo_prep.discovery.registry import (
    DiscoveryRegistry,
    InstanceAdded,
    InstanceRemoved,
    ModelFirstSeen,
    ModelRemoved,
    RegistryEvent,
)
from dynamo_prep.formatter import PromptRenderError, Segment
from dynamo_prep.formatter.kimi_k3 import MARKERS, UNSET, KimiK3Formatter
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessError
from dynamo_prep.protocol.discovery import Announce, DiscoveryDecodeError, decode_message
from dynamo_prep.protocol.openai import RequestError, parse_chat_request
from dynamo_prep.tokenizer import Tokenizer

K3 = "kimi-k3-demo"
QWEN = "qwen-vl-demo"
MEDIA_PAD = "<|media_pad|>"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# ============================================================================ known bugs

# (exception type, innermost dynamo_prep function) -> reproducer test in tests/test_fuzz.py.
# A hit is counted as "known:<key>" instead of failing, so the seeded slice keeps passing
# until the owner fixes the bug; the strict-xfail reproducer then XPASSes and this entry goes.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def _project_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """Traceback frames inside dynamo_prep, comprehension and lambda frames left out."""
    return [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if "/dynamo_prep/" in frame.filename and not frame.name.startswith("<")
    ]


def known_bug(exc: BaseException) -> str | None:
    """The ``KNOWN_BUGS`` key of an exception, by its type and the innermost project function."""
    frames = _project_frames(exc)
    if not frames:
        return None
    return KNOWN_BUGS.get((type(exc).__name__, frames[-1].name))


def crash_site(exc: BaseException) -> str:
    """``file:line function`` of the innermost project frame (for reports)."""
    frames = _project_frames(exc)
    if not frames:
        return "<outside dynamo_prep>"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/dynamo_prep/', 1)[-1]}:{frame.lineno} {frame.name}"


Outcome = str


def _classify(exc: BaseException, documented: tuple[type[BaseException], ...]) -> Outcome:
    if isinstance(exc, documented):
        return f"rejected:{type(exc).__name__}"
    key = known_bug(exc)
    if key is not None:
        return f"known:{key}"
    raise exc


# ============================================================================ fragments


@dataclass(frozen=True)
class Fragment:
    """A hostile leaf value, kept small until it is materialized."""

    kind: Literal["deep_list", "deep_map", "big_int", "big_str", "odd_number"]
    size: int

    def python(self) -> Any:
        if self.kind in ("deep_list", "deep_map"):
            value: Any = 0
            for _ in range(self.size):
                value = [value] if self.kind == "deep_list" else {"k": value}
            return value
        if self.kind == "big_int":
            return 10**self.size
        if self.kind == "big_str":
            return "x" * self.size
        return (float("inf"), float("-inf"), -0.0, 1e308)[self.size % 4]

    def json(self) -> str:
        if self.kind == "deep_list":
            return "[" * self.size + "0" + "]" * self.size
        if self.kind == "deep_map":
            return '{"k":' * self.size + "0" + "}" * self.size
        if self.kind == "big_int":
            return "9" * self.size
        if self.kind == "big_str":
            return '"' + "x" * self.size + '"'
        return ("1e999", "-0", "1E-400", "-1e308", "0.0000000000000000000001")[self.size % 5]

    def msgpack(self) -> bytes:
        if self.kind == "deep_list":
            return b"\x91" * self.size + b"\x00"
        if self.kind == "deep_map":
            return b"\x81\xa1k" * self.size + b"\x00"
        if self.kind == "big_int":
            return b"\xcf" + b"\xff" * 8  # uint64 max
        if self.kind == "big_str":
            return msgspec.msgpack.encode("x" * self.size)
        return msgspec.msgpack.encode(self.python())


def materialize(tree: Any) -> Any:
    """The tree as plain Python values (fragments expanded)."""
    if isinstance(tree, Fragment):
        return tree.python()
    if isinstance(tree, dict):
        return {key: materialize(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [materialize(value) for value in tree]
    return tree


def _with_markers(tree: Any, found: list[Fragment]) -> Any:
    if isinstance(tree, Fragment):
        found.append(tree)
        return f"\x1eFRAGMENT{len(found) - 1}\x1e"
    if isinstance(tree, dict):
        return {key: _with_markers(value, found) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_with_markers(value, found) for value in tree]
    return tree


def to_json_bytes(tree: Any, *, ascii_only: bool = False) -> bytes:
    """JSON bytes of a tree; fragments are spliced in as raw JSON text (lone surrogates pass)."""
    found: list[Fragment] = []
    text = json.dumps(_with_markers(tree, found), ensure_ascii=ascii_only)
    for index, fragment in enumerate(found):
        text = text.replace(f'"\\u001eFRAGMENT{index}\\u001e"', fragment.json())
    return text.encode("utf-8", "surrogatepass")


def to_msgpack(tree: Any) -> bytes:
    """MessagePack bytes of a tree; fragments are spliced in as raw MessagePack."""

    def convert(node: Any) -> Any:
        if isinstance(node, Fragment):
            return msgspec.Raw(node.msgpack())
        if isinstance(node, dict):
            return {key: convert(value) for key, value in node.items()}
        if isinstance(node, list):
            return [convert(value) for value in node]
        return node

    return msgspec.msgpack.encode(convert(tree))


@dataclass(frozen=True)
class ByteMutation:
    """A byte-level edit of an encoded payload: truncate, flip one byte, or splice garbage in."""

    op: Literal["truncate", "flip", "insert"]
    at: int
    data: bytes = b""

    def apply(self, payload: bytes) -> bytes:
        if not payload:
            return self.data
        at = self.at % (len(payload) + 1)
        if self.op == "truncate":
            return payload[:at]
        if self.op == "flip":
            at %= len(payload)
            return (
                payload[:at]
                + bytes([payload[at] ^ (self.data[0] if self.data else 0xFF)])
                + payload[at + 1 :]
            )
        return payload[:at] + self.data + payload[at:]


byte_mutations = st.builds(
    ByteMutation,
    op=st.sampled_from(["truncate", "flip", "insert"]),
    at=st.integers(0, 1 << 16),
    data=st.binary(min_size=1, max_size=8),
)

# ============================================================================ generic values

SPECIAL_LOOKING = (
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "<|kimi_image_placeholder|>",
    MEDIA_PAD,
    "<|media_begin|>",
    "[BOS]",
    "[EOS]",
    "[EOT]",
    "[PAD]",
    "<|reserved_token_8300|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|video_pad|>",
    "<tool_call>",
    "{{ raise_exception('x') }}",
    "{% for %}",
    '"',
    "&quot;",
    "\n",
    " ",
    "",
    "\u2028",
    "\x00",
)

fragments = st.one_of(
    st.builds(Fragment, st.sampled_from(["deep_list", "deep_map"]), st.sampled_from([40, 400, 1200, 5000])),
    st.builds(Fragment, st.just("big_int"), st.sampled_from([19, 20, 40, 4301, 6000])),
    st.builds(Fragment, st.just("big_str"), st.sampled_from([65, 30_000])),
    st.builds(Fragment, st.just("odd_number"), st.integers(0, 9)),
)

texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(SPECIAL_LOOKING),
    st.lists(st.one_of(st.text(max_size=5), st.sampled_from(SPECIAL_LOOKING)), max_size=5).map("".join),
)

json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT64_MIN, INT64_MAX),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)


def json_values(
    *, leaves: st.SearchStrategy[Any] = json_leaves, max_leaves: int = 8
) -> st.SearchStrategy[Any]:
    """JSON-shaped values (string keys), shallow enough for hypothesis to print and shrink."""
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.dictionaries(texts, children, max_size=3),
        ),
        max_leaves=max_leaves,
    )


garbage = json_values(leaves=st.one_of(json_leaves, fragments), max_leaves=6)
json_objects = st.dictionaries(texts, json_values(max_leaves=4), max_size=3)

# ============================================================================ chat requests

FUNCTION_NAMES = ("get_weather", "search", "f")
function_names = st.one_of(st.sampled_from(FUNCTION_NAMES), texts)
roles = st.one_of(
    st.sampled_from(["user", "user", "user", "assistant", "assistant", "system", "tool", "developer"]),
    st.sampled_from(["function", "ipython", "USER", "", "model"]),
    garbage,
)
image_urls = st.one_of(
    st.sampled_from(
        [
            "http://example.com/a.png",
            "https://example.com/b.jpg?x=<|image_pad|>",
            "data:image/png;base64,iVBORw0KGgo=",
            "data:",
        ]
    ),
    st.sampled_from(["ftp://x/y.png", "", "file:///etc/passwd", "javascript:alert(1)", "HTTP://X"]),
    texts,
)
image_url_values = st.one_of(
    st.fixed_dictionaries({"url": image_urls}, optional={"detail": st.one_of(texts, garbage)}),
    image_urls,
    garbage,
)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": image_url_values}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": image_url_values}),
    st.fixed_dictionaries({"type": st.just("image"), "image": image_url_values}),
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["input_audio", "video", "file", "refusal", ""]), garbage)},
        optional={"text": st.one_of(texts, garbage), "image_url": image_url_values},
    ),
    st.fixed_dictionaries({}, optional={"text": texts, "image_url": image_url_values}),
    garbage,
)
contents = st.one_of(
    texts, texts, st.none(), st.lists(parts, max_size=4), st.lists(parts, max_size=4), garbage
)
arguments = st.one_of(
    json_objects,
    json_objects.map(json.dumps),
    st.sampled_from(["", " ", "{", "[1, 2]", '"str"', "null", "{not json}", '{"a": NaN}']),
    texts,
    garbage,
)
tool_calls = st.one_of(
    st.fixed_dictionaries(
        {
            "id": st.one_of(st.sampled_from(["call_0", "call_1", "call_2"]), garbage),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": function_names},
                optional={"arguments": arguments},
            ),
        }
    ),
    st.fixed_dictionaries({}, optional={"id": texts, "name": function_names, "arguments": arguments}),
    st.fixed_dictionaries({"function": garbage}),
    garbage,
)
tools = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": function_names},
                optional={"description": texts, "parameters": json_objects},
            ),
        }
    ),
    garbage,
)
messages = st.one_of(
    st.fixed_dictionaries(
        {"role": roles},
        optional={
            "content": contents,
            "name": st.one_of(texts, garbage),
            "tool_calls": st.one_of(st.lists(tool_calls, max_size=3), garbage),
            "tool_call_id": st.one_of(st.sampled_from(["call_0", "call_1", "call_2"]), garbage),
            "reasoning_content": st.one_of(texts, garbage),
            "partial": st.one_of(st.booleans(), garbage),
            "tools": st.one_of(st.lists(tools, max_size=2), garbage),
        },
    ),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": contents}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": contents}),
    st.fixed_dictionaries({}, optional={"content": contents}),
    garbage,
)
tool_choices = st.one_of(
    st.sampled_from(["none", "auto", "required", "any", ""]),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "tool"]),
            "function": st.fixed_dictionaries({"name": function_names}),
        }
    ),
    garbage,
)
response_formats = st.one_of(
    st.just({"type": "json_object"}),
    st.just({"type": "text"}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.one_of(
                st.fixed_dictionaries(
                    {"name": texts}, optional={"schema": json_objects, "strict": st.booleans()}
                ),
                st.fixed_dictionaries({"json_schema": json_objects}),
                json_objects,
                garbage,
            ),
        }
    ),
    st.sampled_from(["json_object", "json_schema"]),
    garbage,
)
template_args = st.fixed_dictionaries(
    {},
    optional={
        "thinking": st.one_of(st.booleans(), garbage),
        "enable_thinking": st.one_of(st.booleans(), garbage),
        "thinking_effort": st.one_of(st.sampled_from(["low", "medium", "high", "max", None]), garbage),
        "add_generation_prompt": st.one_of(st.booleans(), garbage),
        "documents": garbage,
        "tools": garbage,
        "self": garbage,
        "custom": garbage,
    },
)
_OPTIONAL_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "tools": st.one_of(st.lists(tools, max_size=3), garbage),
    "tool_choice": tool_choices,
    "response_format": response_formats,
    "reasoning_effort": st.one_of(st.sampled_from(["low", "medium", "high", "max", "none"]), garbage),
    "chat_template_args": st.one_of(template_args, garbage),
    "chat_template_kwargs": st.one_of(template_args, garbage),
    "max_tokens": st.one_of(st.integers(-2, 9000), garbage),
    "max_completion_tokens": st.one_of(st.integers(-2, 9000), garbage),
    "stop": st.one_of(texts, st.lists(texts, max_size=3), garbage),
    "n": st.one_of(st.integers(-1, 3), garbage),
    "temperature": st.one_of(st.floats(-1, 3), garbage),
    "add_generation_prompt": st.one_of(st.booleans(), garbage),
    "nvext": st.one_of(
        st.fixed_dictionaries(
            {"annotations": st.lists(st.sampled_from(["token_ids", "formatted_prompt", "x"]))}
        ),
        garbage,
    ),
    "stream": st.one_of(st.booleans(), garbage),
}
# Well-formed requests, so that the accepted-path properties (special ids, image counts) see many
# cases; the hostile trees above cover the rejection paths.
valid_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {"url": st.sampled_from(["http://example.com/a.png", "data:image/png;base64,AAAA"])}
            ),
        }
    ),
)
valid_contents = st.one_of(texts, st.lists(valid_parts, max_size=4))
valid_tools = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(FUNCTION_NAMES)},
            optional={"description": texts, "parameters": json_objects},
        ),
    }
)
valid_calls = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["call_0", "call_1", "call_2"]),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.sampled_from(FUNCTION_NAMES),
                "arguments": st.one_of(json_objects, json_objects.map(json.dumps)),
            }
        ),
    }
)
valid_messages = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer"]), "content": valid_contents},
        optional={"name": texts},
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.one_of(st.none(), texts)},
        optional={"tool_calls": st.lists(valid_calls, max_size=2), "reasoning_content": texts},
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "content": valid_contents,
            "tool_call_id": st.sampled_from(["call_0", "call_1"]),
        },
        optional={"name": st.sampled_from(FUNCTION_NAMES)},
    ),
)
valid_chat_trees = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(valid_messages, min_size=1, max_size=6)},
    optional={
        "tools": st.lists(valid_tools, max_size=2),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto"]),
            st.just({"type": "function", "function": {"name": "f"}}),
        ),
        "response_format": st.one_of(
            st.just({"type": "json_object"}),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": texts, "schema": json_objects}),
                }
            ),
        ),
        "reasoning_effort": st.sampled_from(["low", "high", "max", "none"]),
        "chat_template_args": st.fixed_dictionaries(
            {},
            optional={
                "thinking": st.booleans(),
                "thinking_effort": st.sampled_from(["low", "high", "max", None]),
            },
        ),
        "max_tokens": st.integers(1, 64),
        "stop": st.one_of(
            st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=2)
        ),
        "nvext": st.just({"annotations": ["token_ids", "formatted_prompt"]}),
    },
)
chat_trees = st.one_of(
    valid_chat_trees,
    valid_chat_trees,
    valid_chat_trees,
    st.fixed_dictionaries(
        {"model": st.one_of(st.just("m"), garbage), "messages": st.lists(messages, max_size=6)},
        optional=_OPTIONAL_FIELDS,
    ),
    st.fixed_dictionaries(
        {"model": st.just("m"), "messages": st.lists(messages, min_size=1, max_size=4)},
        optional={k: _OPTIONAL_FIELDS[k] for k in ("tools", "tool_choice", "response_format", "max_tokens")},
    ),
    st.fixed_dictionaries({}, optional={"model": garbage, "messages": garbage}),
    garbage,
)


@dataclass(frozen=True)
class ChatInput:
    """A chat request tree, sent as a dict or as JSON bytes (optionally corrupted)."""

    tree: Any
    as_bytes: bool
    ascii_only: bool = False
    mutation: ByteMutation | None = None
    raw: bytes | None = None

    def request(self) -> Any:
        if self.raw is not None:
            return self.raw
        if not self.as_bytes:
            return materialize(self.tree)
        payload = to_json_bytes(self.tree, ascii_only=self.ascii_only)
        return self.mutation.apply(payload) if self.mutation is not None else payload


chat_inputs = st.one_of(
    st.builds(ChatInput, chat_trees, st.just(False)),
    st.builds(
        ChatInput,
        chat_trees,
        st.just(True),
        st.booleans(),
        st.one_of(st.none(), st.none(), st.none(), byte_mutations),
    ),
    st.builds(ChatInput, st.none(), st.just(True), raw=st.binary(max_size=64)),
)


def image_part_count(request: Any) -> int:
    """Image parts in a decoded request's messages (the preprocessor's contract: one each)."""
    count = 0
    for message in request.get("messages", []) if isinstance(request, dict) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            count += sum(
                1 for p in content if isinstance(p, dict) and p.get("type") in ("image_url", "image")
            )
    return count


@cache
def preprocessor(name: str, image_token: str | None = None) -> OpenAIPreprocessor:
    runtime = ModelRuntimeConfig(image_placeholder_token=image_token)
    card = ModelDeploymentCard.from_model_dir(name, runtime_config=runtime)
    return OpenAIPreprocessor.new(card, name)


PREPROCESSORS: tuple[tuple[str, str | None], ...] = ((K3, None), (K3, MEDIA_PAD), (QWEN, None))


def _special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    return frozenset(tokenizer.special_tokens.values())


def check_segments(segments: list[Segment], tokenizer: Tokenizer, controls: frozenset[str]) -> None:
    """Segment properties: non-empty, control segments only from ``controls``, no special id from a
    text segment, and ``encode_segments`` equal to per-segment encodes (its caches change nothing)."""
    specials = _special_ids(tokenizer)
    expected: list[int] = []
    for text, allow_special in segments:
        assert text, f"empty segment in {segments!r}"
        assert isinstance(text, str)
        ids = tokenizer.encode(text, allow_special=allow_special)
        if allow_special:
            assert text in controls, f"control segment {text!r} is not an expected control"
        else:
            forged = [i for i in ids if i in specials]
            assert not forged, f"text segment {text!r} produced special ids {forged}"
        expected.extend(ids)
    assert tokenizer.encode_segments(segments) == expected, "encode_segments differs from per-segment encodes"


def k3_controls(image_token: str) -> frozenset[str]:
    return MARKERS | {image_token}


def check_chat(chat: ChatInput) -> Outcome:
    """preprocess on every demo preprocessor returns or raises PreprocessError; segment properties."""
    outcomes = [_check_chat_on(chat, name, token) for name, token in PREPROCESSORS]
    # one label per case: a known bug on any model, else "ok" if any model accepted it
    chosen = [o for o in outcomes if o.startswith("known:")] or [o for o in outcomes if o == "ok"] or outcomes
    return chosen[0]


def _check_chat_on(chat: ChatInput, name: str, image_token: str | None) -> Outcome:
    pp = preprocessor(name, image_token)
    request = chat.request()
    try:
        result = pp.preprocess(request)
    except Exception as exc:
        return _classify(exc, (PreprocessError,))
    prompt = pp.tokenize(request)
    assert prompt.token_ids == result.token_ids, "tokenize and preprocess disagree"
    # count on the parsed request: msgspec skips ignored fields without validating them (a body
    # with invalid UTF-8 in an unknown key is accepted), so a plain json decode could fail here
    images = image_part_count({"messages": parse_chat_request(request).messages})
    assert len(result.images) == images
    tokenizer = pp.tokenizer
    specials = _special_ids(tokenizer)
    rendered = prompt.rendered
    image = pp.formatter.rendered_token
    if pp.formatter.kind == "kimi_k3":
        assert image is not None
        controls = k3_controls(image)
    else:
        controls = frozenset(tokenizer.special_tokens)
        image = "<|image_pad|>"
    segments = rendered.segments
    if segments is not None:
        assert rendered.text == "".join(s.text for s in segments)
        check_segments(segments, tokenizer, controls)
        control_ids = [
            i
            for text, allow in segments
            if allow
            for i in tokenizer.encode(text, allow_special=True)
            if i in specials
        ]
        assert [i for i in result.token_ids if i in specials] == control_ids, "special id not from a control"
        assert sum(1 for s in segments if s.allow_special and s.text == image) == images
    if tokenizer.is_special_token(image):
        count = result.token_ids.count(tokenizer.special_tokens[image])
        assert count == images, f"{count} {image} ids for {images} image parts"
    return "ok"


# ============================================================================ K3 renderer


@dataclass(frozen=True)
class RenderInput:
    """Arguments of ``KimiK3Formatter.render_segments`` (any JSON shapes)."""

    messages: Any
    tools: Any
    add_generation_prompt: bool
    thinking: Any
    thinking_effort: Any
    tool_choice: Any
    response_format: Any
    response_schema: Any
    image_token: str | None


render_inputs = st.builds(
    RenderInput,
    messages=st.one_of(
        st.lists(valid_messages, max_size=6),
        st.lists(valid_messages, max_size=6),
        st.lists(messages, max_size=6),
        garbage,
    ),
    tools=st.one_of(st.none(), st.lists(valid_tools, max_size=2), st.lists(tools, max_size=3), garbage),
    add_generation_prompt=st.booleans(),
    thinking=st.one_of(st.booleans(), st.booleans(), garbage),
    thinking_effort=st.one_of(st.sampled_from(["low", "high", "max", "max", "medium", None]), garbage),
    tool_choice=tool_choices,
    response_format=st.one_of(st.none(), response_formats),
    response_schema=st.one_of(st.just(UNSET), st.just(UNSET), garbage),
    image_token=st.sampled_from([None, MEDIA_PAD]),
)


@cache
def k3_formatter(
    image_token: str | None, generation_prompt: Literal["reference", "hosted"]
) -> KimiK3Formatter:
    return KimiK3Formatter(image_token, generation_prompt=generation_prompt)


@cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_model_dir(name)


def check_render(data: RenderInput) -> Outcome:
    """render_segments raises PromptRenderError only; segments are well formed; render() joins them."""
    formatter = k3_formatter(data.image_token, "reference")
    try:
        segments = formatter.render_segments(
            materialize(data.messages),
            materialize(data.tools),
            add_generation_prompt=data.add_generation_prompt,
            thinking=materialize(data.thinking),
            thinking_effort=materialize(data.thinking_effort),
            tool_choice=materialize(data.tool_choice),
            response_format=materialize(data.response_format),
            response_schema=materialize(data.response_schema),
        )
    except Exception as exc:
        return _classify(exc, (PromptRenderError,))
    check_segments(segments, tokenizer(K3), k3_controls(formatter.rendered_token))
    _check_render_request(data, formatter)
    return "ok"


def _check_render_request(data: RenderInput, formatter: KimiK3Formatter) -> None:
    """The serving-layer ``render`` on the same request: text is the join of its segments."""
    body = {"model": "m", "messages": materialize(data.messages), "tools": materialize(data.tools)}
    body |= {
        "tool_choice": materialize(data.tool_choice),
        "response_format": materialize(data.response_format),
    }
    try:
        request = parse_chat_request(body)
        rendered = formatter.render(request)
    except Exception as exc:
        _classify(exc, (PromptRenderError, RequestError))
        return
    segments = rendered.segments
    assert segments is not None
    assert rendered.text == "".join(s.text for s in segments)
    check_segments(segments, tokenizer(K3), k3_controls(formatter.rendered_token))


# ============================================================================ cards

card_texts = st.text(max_size=16)
card_ints = st.integers(INT64_MIN, INT64_MAX)
card_values = json_values(
    leaves=st.one_of(
        st.none(), st.booleans(), card_ints, st.floats(allow_nan=False), card_texts, st.binary(max_size=8)
    ),
    max_leaves=6,
)
# The card's bounded figures (card.py): a context of 1 to 2**40 tokens, a KV block of 1 to 65,536
# tokens, counts of 0 to 2**40, 0 to 1,024 moves. Payload fuzzing sends any int there too.
card_tokens = st.integers(1, 1 << 40)
card_counts = st.integers(0, 1 << 40)
runtime_configs = st.builds(
    ModelRuntimeConfig,
    context_length=st.one_of(st.none(), card_tokens),
    total_kv_blocks=st.one_of(st.none(), card_counts),
    max_num_seqs=st.one_of(st.none(), card_counts),
    max_num_batched_tokens=st.one_of(st.none(), card_counts),
    tool_call_parser=st.one_of(st.none(), card_texts),
    reasoning_parser=st.one_of(st.none(), card_texts),
    data_parallel_size=st.integers(1, 4096),
    exclude_tools_when_tool_choice_none=st.booleans(),
    runtime_data=st.dictionaries(card_texts, card_values, max_size=3),
    image_placeholder_token=st.one_of(
        st.none(), st.sampled_from([MEDIA_PAD, "<|kimi_image_placeholder|>"]), card_texts
    ),
)
# What the card schema admits (names of 1-256 characters, file names of at most 128, 32 files).
card_names = card_texts.filter(bool)  # card_texts are at most 16 characters
cards = st.builds(
    ModelDeploymentCard,
    display_name=card_names,
    slug=card_names,
    model_type=st.one_of(st.none(), st.sampled_from(["kimi_k3", "qwen2_vl"]), card_names),
    model_input=st.one_of(st.just("tokens"), card_texts),
    context_length=card_tokens,
    kv_cache_block_size=st.integers(1, 1 << 16),
    migration_limit=st.integers(0, 1024),
    files=st.dictionaries(card_texts, st.builds(FileRef, card_texts, card_ints), max_size=4),
    runtime_config=runtime_configs,
    user_data=st.one_of(st.none(), st.dictionaries(card_texts, card_values, max_size=3)),
)


def check_card_roundtrip(card: ModelDeploymentCard) -> Outcome:
    result = decode_card(encode_card(card))
    assert result.card == card, f"{result.card!r} != {card!r}"
    assert result.legacy == {}
    assert result.card.mdcsum() == card.mdcsum()
    return "ok"


@dataclass(frozen=True)
class TreeMutation:
    """Set, delete or add a value at the ``pick``-th path of a tree (paths in a stable order)."""

    op: Literal["set", "delete", "add"]
    pick: int
    key: str = "extra"
    value: Any = None


tree_mutations = st.builds(
    TreeMutation,
    op=st.sampled_from(["set", "set", "delete", "add"]),
    pick=st.integers(0, 1 << 16),
    key=st.one_of(st.sampled_from(["expands_image_pad_token", "runtime_config", "v", "kind", "card"]), texts),
    value=garbage,
)


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(tree, dict):
        for key in tree:
            out.extend(_paths(tree[key], (*prefix, key)))
    elif isinstance(tree, list):
        for index, item in enumerate(tree):
            out.extend(_paths(item, (*prefix, index)))
    return out


def mutate(tree: Any, mutation: TreeMutation) -> Any:
    """A copy of ``tree`` with one mutation applied (the root can be replaced too)."""
    tree = _copy(tree)
    paths = _paths(tree)
    path = paths[mutation.pick % len(paths)]
    if not path:
        if mutation.op == "set":
            return mutation.value
        if isinstance(tree, dict):
            tree[mutation.key] = mutation.value
        return tree
    parent = tree
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if mutation.op == "set":
        parent[last] = mutation.value
    elif mutation.op == "delete":
        del parent[last]
    elif isinstance(parent[last], dict):
        parent[last][mutation.key] = mutation.value
    elif isinstance(parent, dict):
        parent[mutation.key] = mutation.value
    return tree


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def card_tree(card: ModelDeploymentCard) -> Any:
    return msgspec.to_builtins(card)


@dataclass(frozen=True)
class PayloadInput:
    """A MessagePack payload: a base tree with tree mutations, then byte mutations; or raw bytes."""

    base: Any
    mutations: tuple[TreeMutation, ...] = ()
    byte_mutation: ByteMutation | None = None
    raw: bytes | None = None

    def payload(self) -> bytes:
        if self.raw is not None:
            return self.raw
        tree = self.base
        for mutation in self.mutations:
            tree = mutate(tree, mutation)
        try:
            data = to_msgpack(tree)
        except (TypeError, OverflowError, ValueError):
            data = b"\xc1"  # not encodable as MessagePack: send the never-used byte instead
        return self.byte_mutation.apply(data) if self.byte_mutation is not None else data


def _legacy(tree: dict[str, Any], value: Any) -> dict[str, Any]:
    runtime = tree.get("runtime_config")
    runtime = dict(runtime) if isinstance(runtime, dict) else {}
    return {**tree, "runtime_config": {**runtime, "expands_image_pad_token": value}}


_card_trees = cards.map(card_tree)
card_payloads = st.one_of(
    st.builds(PayloadInput, _card_trees, st.lists(tree_mutations, max_size=3).map(tuple)),
    st.builds(PayloadInput, _card_trees, st.lists(tree_mutations, max_size=3).map(tuple)),
    st.builds(PayloadInput, st.builds(_legacy, _card_trees, st.one_of(st.booleans(), garbage)), st.just(())),
    st.builds(PayloadInput, _card_trees, st.just(()), byte_mutations),
    st.builds(PayloadInput, garbage),
    st.builds(PayloadInput, st.none(), st.just(()), st.none(), st.binary(max_size=64)),
)


def check_card_payload(data: PayloadInput) -> Outcome:
    payload = data.payload()
    try:
        result = decode_card(payload)
    except Exception as exc:
        return _classify(exc, (CardDecodeError,))
    assert isinstance(result.card, ModelDeploymentCard)
    assert set(result.legacy) <= {"expands_image_pad_token"}
    assert all(isinstance(v, bool) for v in result.legacy.values())
    encoded = encode_card(result.card)
    assert encode_card(decode_card(encoded).card) == encoded, "a decoded card does not round-trip"
    return "ok"


# ============================================================================ discovery


def _envelope(kind: Any, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, **fields}


@cache
def card_pool() -> tuple[bytes, ...]:
    """Card bytes the registry sequences pick from: same model, other declaration, legacy, other
    mdcsum, another model, and cards that do not decode."""
    k3 = ModelDeploymentCard.from_model_dir(K3)
    qwen = ModelDeploymentCard.from_model_dir(QWEN)
    k3_tree = card_tree(k3)
    return (
        encode_card(k3),
        encode_card(
            ModelDeploymentCard.from_model_dir(
                K3, runtime_config=ModelRuntimeConfig(image_placeholder_token=MEDIA_PAD)
            )
        ),
        to_msgpack(_legacy(k3_tree, True)),
        to_msgpack({**k3_tree, "context_length": 4096}),
        encode_card(qwen),
        encode_card(
            ModelDeploymentCard.from_model_dir(QWEN, runtime_config=ModelRuntimeConfig(runtime_data={"x": 1}))
        ),
        to_msgpack({**k3_tree, "display_name": QWEN}),
        b"\xc1",
        to_msgpack({"display_name": 1}),
    )


INSTANCE_IDS = ("w0", "w1", "w2", "w3")
TTLS_MS = (100, 1000, 3000, 3000, 50, 700_000)


@dataclass(frozen=True)
class Step:
    """One registry step: an announce/withdraw (encoded, then decoded), a garbage payload, or expire."""

    op: Literal["announce", "withdraw", "garbage", "expire"]
    dt: float
    instance_id: str = "w0"
    seq: int = 0
    ttl_ms: int = 3000
    card: int = 0
    endpoint: str = "tcp://127.0.0.1:1"
    user_id: str | None = None
    payload: PayloadInput | None = None

    def encoded(self) -> bytes:
        if self.payload is not None:
            return self.payload.payload()
        if self.op == "withdraw":
            return to_msgpack(_envelope("withdraw", instance_id=self.instance_id, seq=self.seq, sent_ms=0))
        fields = {"instance_id": self.instance_id, "seq": self.seq, "sent_ms": 0, "ttl_ms": self.ttl_ms}
        head = to_msgpack(_envelope("announce", endpoint=self.endpoint, **fields))
        # splice the raw card in as the last key, exactly as a worker sends it
        card = card_pool()[self.card % len(card_pool())]
        return bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("card") + card


_dts = st.one_of(st.sampled_from([0.0, 0.0, 0.05, 0.5, 1.0, 3.0, 10.0]), st.floats(0, 20))
_users = st.sampled_from([None, None, None, None, "key-a", "key-b"])
_valid_envelopes = st.one_of(
    st.builds(
        lambda iid, seq: _envelope(
            "announce", instance_id=iid, seq=seq, sent_ms=0, endpoint="tcp://h:1", card={}
        ),
        st.sampled_from(INSTANCE_IDS),
        st.integers(0, 10),
    ),
    st.builds(
        lambda iid, seq: _envelope("withdraw", instance_id=iid, seq=seq, sent_ms=0),
        st.sampled_from(INSTANCE_IDS),
        st.integers(0, 10),
    ),
)
envelope_payloads = st.one_of(
    st.builds(PayloadInput, _valid_envelopes),
    st.builds(PayloadInput, _valid_envelopes, st.lists(tree_mutations, max_size=3).map(tuple)),
    st.builds(PayloadInput, _valid_envelopes, st.just(()), byte_mutations),
    st.builds(
        PayloadInput,
        st.fixed_dictionaries(
            {},
            optional={
                "v": st.one_of(st.integers(-1, 3), garbage),
                "kind": st.one_of(st.sampled_from(["announce", "withdraw", "hello", ""]), garbage),
                "instance_id": st.one_of(st.sampled_from(INSTANCE_IDS), garbage),
                "seq": st.one_of(st.integers(-1, 10), garbage),
                "sent_ms": garbage,
                "ttl_ms": st.one_of(st.sampled_from(TTLS_MS), garbage),
                "endpoint": garbage,
                "card": garbage,
            },
        ),
    ),
    st.builds(PayloadInput, garbage),
    st.builds(PayloadInput, st.none(), st.just(()), st.none(), st.binary(max_size=64)),
    st.builds(PayloadInput, st.just({"kind": "announce", "pad": Fragment("big_str", (1 << 20) + 1)})),
)
steps = st.one_of(
    st.builds(
        Step,
        op=st.just("announce"),
        dt=_dts,
        instance_id=st.sampled_from(INSTANCE_IDS),
        seq=st.integers(0, 8),
        ttl_ms=st.sampled_from(TTLS_MS),
        card=st.integers(0, 8),
        endpoint=st.sampled_from(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", ""]),
        user_id=_users,
    ),
    st.builds(
        Step,
        op=st.just("announce"),
        dt=_dts,
        instance_id=st.sampled_from(INSTANCE_IDS),
        seq=st.integers(0, 8),
        card=st.sampled_from([0, 0, 1, 2, 4]),
    ),
    st.builds(
        Step,
        op=st.just("withdraw"),
        dt=_dts,
        instance_id=st.sampled_from(INSTANCE_IDS),
        seq=st.integers(0, 8),
        user_id=_users,
    ),
    st.builds(Step, op=st.just("expire"), dt=_dts),
    st.builds(Step, op=st.just("garbage"), dt=_dts, payload=envelope_payloads),
)
step_sequences = st.lists(steps, max_size=30)


def check_envelope(data: PayloadInput) -> Outcome:
    """decode_message returns a typed message or raises DiscoveryDecodeError only."""
    try:
        message = decode_message(data.payload())
    except Exception as exc:
        return _classify(exc, (DiscoveryDecodeError,))
    assert message.v == 1
    assert message.instance_id and message.seq >= 0
    if isinstance(message, Announce):
        assert 100 <= message.ttl_ms <= 600_000
        assert isinstance(bytes(message.card), bytes)
    return "ok"


def check_registry(sequence: list[Step]) -> Outcome:
    """Any sequence through apply/expire raises nothing and keeps the registry's invariants."""
    registry = DiscoveryRegistry()
    now = 0.0
    live: dict[str, str] = {}
    models: set[str] = set()
    deadlines: dict[str, float] = {}
    for step in sequence:
        now += step.dt
        before = _last_seqs(registry)
        if step.op == "expire":
            events = registry.expire(now)
            _replay(events, live, models)
            for instance_id in live:
                assert deadlines[instance_id] > now, f"{instance_id} is live after its deadline"
                assert registry._instances[instance_id].deadline > now
        else:
            try:
                message = decode_message(step.encoded())
            except Exception as exc:
                _classify(exc, (DiscoveryDecodeError,))
                continue
            events = registry.apply(message, now=now, user_id=step.user_id)
            _replay(events, live, models)
            after = _last_seqs(registry)
            accepted = after.get(message.instance_id) != before.get(message.instance_id)
            stale = message.instance_id in before and message.seq <= before[message.instance_id]
            if stale:
                assert not accepted and all(type(e).__name__ == "KeyMismatch" for e in events), events
            if accepted and isinstance(message, Announce):
                deadlines[message.instance_id] = now + message.ttl_ms / 1000
        after = _last_seqs(registry)
        for instance_id, seq in before.items():
            assert after.get(instance_id, seq) >= seq, f"seq of {instance_id} went back"
        _check_registry_state(registry, live, models)
    return "ok"


def _last_seqs(registry: DiscoveryRegistry) -> dict[str, int]:
    return {iid: instance.last_seq for iid, instance in registry._instances.items()}


def _replay(events: list[RegistryEvent], live: dict[str, str], models: set[str]) -> None:
    """Apply events to a shadow state; each event must be consistent with it."""
    for event in events:
        if isinstance(event, InstanceAdded):
            instance_id = event.instance.instance_id
            # again for a live instance only as its changed record, in the same model
            assert live.get(instance_id, event.model) == event.model, f"{event} moved between models"
            assert event.model in models, f"{event} before its model"
            live[instance_id] = event.model
        elif isinstance(event, InstanceRemoved):
            instance_id = event.instance.instance_id
            assert live.pop(instance_id, None) == event.model, f"{event} for an instance not live there"
        elif isinstance(event, ModelFirstSeen):
            assert event.model not in models, f"{event} for a known model"
            models.add(event.model)
        elif isinstance(event, ModelRemoved):
            assert event.model in models and event.model not in live.values(), f"{event} with live instances"
            models.remove(event.model)


def _check_registry_state(registry: DiscoveryRegistry, live: dict[str, str], models: set[str]) -> None:
    assert set(registry.model_names()) == models
    seen: set[str] = set()
    for name in registry.model_names():
        snapshot = registry.model(name)
        assert snapshot is not None and snapshot.instances, f"model {name} has no instances"
        assert not (seen & set(snapshot.instances)), "an instance is in two models"
        seen |= set(snapshot.instances)
        assert {iid for iid, m in live.items() if m == name} == set(snapshot.instances)
    for instance_id in INSTANCE_IDS:
        assert registry.model_of(instance_id) == live.get(instance_id)
    assert seen == set(live)


# ============================================================================ targets

TARGETS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], Outcome]]] = {
    "card_roundtrip": (cards, check_card_roundtrip),
    "card_payload": (card_payloads, check_card_payload),
    "discovery_envelope": (envelope_payloads, check_envelope),
    "discovery_registry": (step_sequences, check_registry),
    "chat_request": (chat_inputs, check_chat),
    "k3_renderer": (render_inputs, check_render),
}
