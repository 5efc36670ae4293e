"""What every answer parser shares: streaming equals the whole, deltas fold, ids never leak as text.

The demo models at the top are imported by the other ``test_parsing_*`` modules (and by the fuzz
target); the scaffold they share (``all_ways``: whole, id by id and in random chunks) is in
``tests/support/parsers.py``.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import pytest
from support.parsers import all_ways, marked_ids

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.parsing import (
    AnswerDelta,
    ContentDelta,
    ParsedAnswer,
    PlainAnswerParser,
    ReasoningDelta,
    ToolCallDelta,
    answer_parser_for,
    assistant_message,
    fold_deltas,
    new_call_id,
)
from dynamo_prep.parsing import _json as answer_json
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.parsing.hermes import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN
from dynamo_prep.tokenizer import Tokenizer

K3 = "kimi-k3-demo"
QWEN = "qwen-vl-demo"
QWEN_TAGS = "qwen-vl-demo+tags"
"""qwen-vl-demo with the four Hermes tags registered as added, non-special tokens at the real Qwen
offsets (Qwen2.5 ``<tool_call>`` = base + 14, Qwen3 ``<think>`` = base + 24), as real vocabularies do."""
HERMES_TAG_OFFSETS = {CALL_OPEN: 14, CALL_CLOSE: 15, THINK_OPEN: 24, THINK_CLOSE: 25}
Segments = Sequence[tuple[str, bool]]


@cache
def model_dir(name: str) -> Path:
    if name != QWEN_TAGS:
        return DEMO_MODELS_DIR / name
    directory = Path(tempfile.mkdtemp(prefix="qwen-tags-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    for path in (DEMO_MODELS_DIR / QWEN).iterdir():
        shutil.copy(path, directory / path.name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    base = min(int(key) for key in config["added_tokens_decoder"])
    for tag, offset in HERMES_TAG_OFFSETS.items():
        config["added_tokens_decoder"][str(base + offset)] = {"content": tag, "special": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir(name))


@cache
def card(name: str) -> ModelDeploymentCard:
    return ModelDeploymentCard.from_model_dir(model_dir(name))


def encode_with_tags(text: str, tok: Tokenizer) -> list[int]:
    """A Hermes completion as a model writes it: each tag one id where it is a token, text otherwise."""
    return marked_ids(tok, HERMES_TAG_OFFSETS, text, special=tok.is_special_token)


def answer_texts(answer: ParsedAnswer) -> list[str]:
    """Every string a client reads from an answer."""
    calls = [text for call in answer.tool_calls for text in (call.name, call.arguments)]
    return [answer.reasoning, answer.content, *calls]


# ----------------------------------------------------------------------------- shared pieces


def test_fold_joins_text_by_kind_and_keeps_calls_in_order() -> None:
    call = ToolCallDelta(0, "call_0", "f", "{}")
    deltas: list[AnswerDelta] = [
        ReasoningDelta("a"),
        ContentDelta("x"),
        call,
        ReasoningDelta("b"),
        ContentDelta("y"),
    ]
    assert fold_deltas(deltas) == ParsedAnswer(reasoning="ab", content="xy", tool_calls=[call])


def test_call_ids_are_openai_shaped_and_unique() -> None:
    ids = {new_call_id() for _ in range(200)}
    assert len(ids) == 200
    for call_id in ids:
        assert call_id.startswith("call_")
        assert len(call_id) == 29
        assert set(call_id[5:]) <= set("0123456789abcdef")


def test_assistant_message_carries_reasoning_and_calls() -> None:
    call = ToolCallDelta(0, "call_0", "f", '{"a":1}')
    assert assistant_message(ParsedAnswer(reasoning="r", content="", tool_calls=[call])) == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "r",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
        ],
    }
    assert assistant_message(ParsedAnswer(reasoning="", content="hi", tool_calls=[])) == {
        "role": "assistant",
        "content": "hi",
    }


@pytest.mark.parametrize(
    ("text", "compacted"),
    [
        (' { "a" : 1.0 ,\n "b" : [ 1e2 , -0 ] }', '{"a":1.0,"b":[1e2,-0]}'),
        ('"  keep \\"  spaces\\\\ "', '"  keep \\"  spaces\\\\ "'),
        ('{"\\u00e9 x": "a b"}', '{"\\u00e9 x":"a b"}'),
    ],
)
def test_json_compaction_keeps_every_spelling(text: str, compacted: str) -> None:
    assert answer_json.compact(text) == compacted
    assert json.loads(compacted) == json.loads(text)


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", "-Infinity", "[" * 5000 + "]" * 5000, "1" * 5000, "{"])
def test_strict_json_rejects_what_openai_arguments_cannot_hold(text: str) -> None:
    with pytest.raises(answer_json.JsonError):
        answer_json.loads(text)


def test_json_members_split_only_the_top_level() -> None:
    text = answer_json.compact('{"name": "f", "arguments": {"x": [1, {"y": ","}], "z": "}"}, "k": null}')
    assert answer_json.members(text) == [
        ("name", '"f"'),
        ("arguments", '{"x":[1,{"y":","}],"z":"}"}'),
        ("k", "null"),
    ]


# ----------------------------------------------------------------------------- plain parser


def test_plain_parser_is_content_and_never_decodes_specials() -> None:
    tok = tokenizer(K3)
    media_pad = tok.special_tokens["<|media_pad|>"]
    ids = [
        *tok.encode("héllo 你好 "),
        media_pad,
        *tok.encode("<|open|> stays text"),
        tok.eos_token_ids[0],
        -3,
    ]
    answer, recoveries = all_ways(lambda: PlainAnswerParser(vocab_of(tok)), ids)
    assert answer == ParsedAnswer(reasoning="", content="héllo 你好 <|open|> stays text", tool_calls=[])
    assert recoveries == {"special_token": 1, "invalid_token": 1}


def test_plain_parser_drops_a_character_cut_by_max_tokens() -> None:
    tok = tokenizer(K3)
    ids = tok.encode("ok 😀")
    assert len(ids) > 3  # the emoji spans several ids in the demo vocabulary
    answer, _ = all_ways(lambda: PlainAnswerParser(vocab_of(tok)), ids[:-1], "length")
    assert answer.content == "ok "
    answer, _ = all_ways(lambda: PlainAnswerParser(vocab_of(tok)), ids[:-1], "stop")
    assert answer.content == "ok \ufffd"


def test_a_model_of_no_known_family_gets_the_plain_parser() -> None:
    plain_card = ModelDeploymentCard.from_model_dir(K3, served_name="my-model")
    plain_card.model_type = "llama"
    parser = answer_parser_for(plain_card, tokenizer(K3), thinking=True)
    assert isinstance(parser, PlainAnswerParser)
