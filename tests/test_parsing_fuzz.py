"""Fuzzing the answer parsers with random id sequences: only documented behaviour, never an exception.

``answer_ids`` / ``check_answer_ids`` are the ``answer_parser`` target of ``python -m benchmarks.fuzz``
(>= 10,000 cases); the test below runs a seeded slice of the same property.

Inputs mix the structural ids (the four K3 markers, stop and other special ids, an id outside the
vocabulary), text ids that spell tag names, attributes, JSON and tag pieces, and random base ids.
No text id may contain ``<|`` (random base ids contain none of ``<``, ``|``, ``>``), so a K3 answer
that holds ``<|`` could only have leaked it from a marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Literal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.parsers import all_ways, counting_ids
from test_parsing_k3 import argument, call, json_block, turn
from test_parsing_streams import HERMES_TAG_OFFSETS, K3, QWEN, QWEN_TAGS, card, encode_with_tags, tokenizer

from dynamo_prep.parsing import AnswerParser, ParsedAnswer, answer_parser_for

K3_WORDS = (
    *("think", "response", "tools", "call", "argument", "json", "message", "note"),
    *(" tool", " key", " type", " index", '="', '"', "f", "k", "string", "number", "object", "array"),
    *("1", "1.0", "{", "}", '{"a": [1, 2.5]}', "hello", " ", "\n", "&quot;", "&amp;", "你", "😀"),
)
HERMES_WORDS = (
    *("<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "tool", "_call", ">", "think"),
    *('{"name": "f", "arguments": {"x": 1}}', '{"name": "g"}', "{", "}", '"name"', ":", '"f"', "\n", " "),
    *("hello", "你", "😀"),
    *(
        '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2.0]}}\n</tool_call>',
        '<tool_call>{"name": }</tool_call>',
    ),
)


@cache
def _safe_base_ids(name: str) -> tuple[int, ...]:
    tok = tokenizer(name)
    base = min(tok.special_tokens.values())
    return tuple(i for i in range(base) if not set(tok.encoding.decode_single_token_bytes(i)) & set(b"<|>"))


def _k3_tags() -> list[list[tuple[str, bool]]]:
    """Whole K3 tags (as the renderer writes them), and a few cut short, as segment lists."""
    open_, close, sep = ("<|open|>", True), ("<|close|>", True), ("<|sep|>", True)

    def attrs(*pairs: tuple[str, str]) -> list[tuple[str, bool]]:
        return [s for k, v in pairs for s in ((" " + k, False), ('="', False), (v, False), ('"', False))]

    heads = [
        *([(name, False)] for name in ("think", "response", "tools", "message", "note")),
        [("call", False), *attrs(("tool", "f"), ("index", "1"))],
        [("call", False), *attrs(("index", "2"))],
        [("argument", False), *attrs(("key", "k"), ("type", "number"))],
        [("argument", False), *attrs(("key", "s"), ("type", "string"))],
        [("argument", False), *attrs(("key", "k"))],
        [("json", False), *attrs(("type", "object"))],
    ]
    tags = [[open_, *head, sep] for head in heads]
    tags += [
        [close, (name, False), sep] for name in ("think", "response", "tools", "call", "argument", "json")
    ]
    tags += [
        [close, ("message", False), sep, ("<|end_of_msg|>", True)],
        [close, ("think", False)],
        [open_, *heads[5]],
    ]
    return tags


@cache
def _pieces(name: str) -> tuple[tuple[int, ...], ...]:
    """Id groups to draw from: whole tags, each word's ids, each of those ids alone, structural ids."""
    tok = tokenizer(name)
    words = K3_WORDS if name == K3 else HERMES_WORDS  # Hermes tags as text, even where they are tokens
    groups = {tuple(tok.encode(word)) for word in words}
    groups |= {(token_id,) for group in list(groups) for token_id in group}
    structural = [*tok.eos_token_ids, min(tok.special_tokens.values()) + 21, tok.n_vocab, -1]
    if name == K3:
        structural += [tok.special_tokens[m] for m in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")]
        groups |= {tuple(tok.encode_segments(tag)) for tag in _k3_tags()}
    if name == QWEN_TAGS:
        structural += [tok.special_tokens[tag] for tag in HERMES_TAG_OFFSETS]
    return (*sorted(groups), *((token_id,) for token_id in structural))


@dataclass(frozen=True)
class AnswerIds:
    model: str
    ids: tuple[int, ...]
    finish: Literal["stop", "length"]
    thinking: bool
    prompt_form: Literal["reference", "hosted"]
    tools_enabled: bool


text_words = st.lists(st.sampled_from(K3_WORDS), max_size=3).map("".join)
k3_elements = st.one_of(
    st.builds(
        argument, st.sampled_from(["k", "s", "k"]), st.sampled_from(["number", "string", None]), text_words
    ),
    st.builds(json_block, st.sampled_from(['{"a": 1}', "{bad", ""])),
)
k3_calls = st.builds(
    lambda name, elements: call(name, 1, *elements),
    st.sampled_from(["f", "g"]),
    st.lists(k3_elements, max_size=3),
)
k3_turns = st.builds(
    lambda reasoning, content, calls, form: turn(reasoning, content, calls, form=form),
    st.none() | text_words,
    text_words,
    st.lists(k3_calls, max_size=3),
    st.sampled_from(["think", "response", "hosted"]),
)
HERMES_PROSE = ("", "hello", "你好 😀", " \n", "a < b", "<tool", "</think")
hermes_calls = st.sampled_from(
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        '<tool_call>{"name": 1}</tool_call>',
        "\n",
    ]
)
hermes_turns = st.builds(
    lambda think, content, calls: (
        (f"<think>{think}</think>" if think is not None else "") + content + "".join(calls)
    ),
    st.none() | st.sampled_from(HERMES_PROSE),
    st.sampled_from(HERMES_PROSE),
    st.lists(hermes_calls, max_size=3),
)


@st.composite
def answer_ids(draw: st.DrawFn) -> AnswerIds:
    """A well-formed turn with a few random edits (deleted, inserted or repeated ids), or random pieces."""
    model = draw(st.sampled_from([K3, K3, QWEN, QWEN_TAGS]))
    tok = tokenizer(model)
    piece = st.sampled_from(_pieces(model)) | st.sampled_from(_safe_base_ids(model)).map(lambda i: (i,))
    if draw(st.integers(0, 3)):
        ids = (
            tok.encode_segments(draw(k3_turns)) if model == K3 else encode_with_tags(draw(hermes_turns), tok)
        )
        for where, edit, group in draw(
            st.lists(st.tuples(st.integers(0, 10**4), st.integers(0, 2), piece), max_size=4)
        ):
            at = where % (len(ids) + 1)
            if edit == 0:
                del ids[at : at + len(group)]
            elif edit == 1:
                ids[at:at] = group
            else:
                ids[at:at] = ids[at : at + 3]
    else:
        ids = [token_id for group in draw(st.lists(piece, max_size=60)) for token_id in group]
    return AnswerIds(
        model=model,
        ids=tuple(ids),
        finish=draw(st.sampled_from(["stop", "length"])),
        thinking=draw(st.booleans()),
        prompt_form=draw(st.sampled_from(["reference", "hosted"])),
        tools_enabled=draw(st.booleans()),
    )


def check_answer_ids(example: AnswerIds) -> str:
    """Same answer and recoveries however the ids are chunked; no leaked marker; whole, valid calls."""

    def make() -> AnswerParser:
        return answer_parser_for(
            card(example.model),
            tokenizer(example.model),
            thinking=example.thinking,
            prompt_form=example.prompt_form,
            tools_enabled=example.tools_enabled,
            call_ids=counting_ids(),
        )

    answer, recoveries = all_ways(make, example.ids, example.finish, seeds=(len(example.ids),))
    _check_answer(example, answer, recoveries)
    return "ok"


def _check_answer(example: AnswerIds, answer: ParsedAnswer, recoveries: dict[str, int]) -> None:
    if not example.tools_enabled:
        assert answer.tool_calls == []
    for tool_call in answer.tool_calls:
        try:
            valid = isinstance(json.loads(tool_call.arguments), dict)
        except ValueError:
            valid = False
        assert valid or recoveries.get("invalid_json_block", 0) > 0, tool_call
    if example.model == K3:
        texts = [answer.reasoning, answer.content, *(c.name for c in answer.tool_calls)]
        texts += [c.arguments for c in answer.tool_calls]
        assert not any("<|" in text for text in texts), texts


@settings(
    max_examples=400,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(answer_ids())
def test_random_ids_give_only_documented_behaviour(example: AnswerIds) -> None:
    assert check_answer_ids(example) == "ok"


def test_the_pieces_cannot_spell_a_marker() -> None:
    for name in (K3, QWEN, QWEN_TAGS):
        tok = tokenizer(name)
        for group in _pieces(name):
            text_ids = [i for i in group if 0 <= i < min(tok.special_tokens.values())]
            assert "<|" not in tok.decode(text_ids)
