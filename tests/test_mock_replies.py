"""Scripted mock replies (``--replies FILE``): each kind, first match wins, stop conditions, bad files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.base import ReplyFormat
from dynamo_prep.engines.mock.engine import MockContinuation, MockEngine
from dynamo_prep.engines.mock.replies import RepliesError, load_replies
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.tokenizer import Tokenizer

K3 = "kimi-k3-demo"
QWEN = "qwen-vl-demo"


def write_replies(path: Path, *entries: dict[str, Any] | str) -> Path:
    """One JSON line per entry (a str is written as it is)."""
    lines = [entry if isinstance(entry, str) else json.dumps(entry) for entry in entries]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def preprocess(model: str, text: str, **fields: Any) -> PreprocessedRequest:
    card = ModelDeploymentCard.from_model_dir(model, runtime_config=ModelRuntimeConfig())
    messages = [{"role": "user", "content": text}]
    return OpenAIPreprocessor.new(card, model).preprocess({"model": model, "messages": messages, **fields})


def engine_with(
    tmp_path: Path, *entries: dict[str, Any] | str, model: str = K3, reply_format: ReplyFormat = "echo"
) -> MockEngine:
    replies = write_replies(tmp_path / "replies.jsonl", *entries)
    return MockEngine(model, flavor="vllm", replies=replies, reply_format=reply_format)


@pytest.fixture(scope="module")
def k3_tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(K3)


# --- the three kinds -----------------------------------------------------------------------------


@pytest.mark.parametrize("reply_format", ["echo", "model"])
def test_each_kind_is_encoded_as_documented(
    tmp_path: Path, k3_tokenizer: Tokenizer, reply_format: ReplyFormat
) -> None:
    engine = engine_with(
        tmp_path,
        {"when": "segments please", "segments": [["Hi", False], ["<|close|>", True], ["<|close|>", False]]},
        {"when": "text please", "text": "Hi<|close|>there"},
        {"when": "ids please", "token_ids": [5, 6, 7]},
        reply_format=reply_format,
    )
    close_id = k3_tokenizer.special_tokens["<|close|>"]
    plain_close = k3_tokenizer.encode("<|close|>")  # a text segment: BPE, never the special id
    assert close_id not in plain_close
    assert engine.reply_ids(preprocess(K3, "segments please")) == [
        *k3_tokenizer.encode("Hi"),
        close_id,
        *plain_close,
    ]
    assert engine.reply_ids(preprocess(K3, "text please")) == [
        *k3_tokenizer.encode("Hi"),
        close_id,
        *k3_tokenizer.encode("there"),
    ]
    assert engine.reply_ids(preprocess(K3, "ids please")) == [5, 6, 7]


def test_the_first_matching_reply_wins_and_no_match_falls_back(tmp_path: Path) -> None:
    engine = engine_with(
        tmp_path,
        {"when": "weather", "text": "first"},
        {"when": "weather in", "text": "second"},
        {"when": "", "text": "catch-all"},
    )
    assert engine.reply_text(preprocess(K3, "The weather in Paris?")) == "first"
    assert engine.reply_text(preprocess(K3, "Anything else")) == "catch-all"
    no_catch_all = engine_with(tmp_path, {"when": "weather", "text": "first"})
    request = preprocess(K3, "Anything else")
    assert no_catch_all.reply_text(request).startswith("[mock vllm] 0 image(s)")


def test_when_is_matched_against_the_whole_last_user_message(tmp_path: Path) -> None:
    """Beyond the echo's 200 characters, and only in the last user message."""
    engine = engine_with(tmp_path, {"when": "needle at the end", "text": "found"})
    long_text = "word " * 100 + "needle at the end"
    assert engine.reply_text(preprocess(K3, long_text)) == "found"
    earlier = [
        {"role": "user", "content": "needle at the end"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "something else"},
    ]
    card = ModelDeploymentCard.from_model_dir(K3)
    request = OpenAIPreprocessor.new(card, K3).preprocess({"model": K3, "messages": earlier})
    assert engine.reply_text(request) != "found"


def test_qwen_replies_match_the_chatml_user_turn(tmp_path: Path) -> None:
    engine = engine_with(tmp_path, {"when": "Paris", "text": "Sunny.<|im_end|>"}, model=QWEN)
    request = preprocess(QWEN, "Weather in Paris?")
    token_ids, finish = engine.plan(request)
    assert (engine.tokenizer.decode(token_ids), finish) == ("Sunny.", "stop")


# --- stop conditions -----------------------------------------------------------------------------


@pytest.mark.parametrize("reply_format", ["echo", "model"])
async def test_a_reply_ends_at_eos_and_the_eos_is_not_sent(tmp_path: Path, reply_format: ReplyFormat) -> None:
    reply = {"when": "", "text": "Hello<|end_of_msg|>never sent"}
    engine = engine_with(tmp_path, reply, reply_format=reply_format)
    request = preprocess(K3, "hi")
    outputs = [output async for output in engine.generate(request)]
    assert engine.tokenizer.decode([t for o in outputs for t in o.token_ids]) == "Hello"
    assert outputs[-1].finish_reason == "stop"


def test_request_stop_ids_and_max_tokens_cut_a_reply(tmp_path: Path, k3_tokenizer: Tokenizer) -> None:
    engine = engine_with(tmp_path, {"when": "", "token_ids": [10, 11, 12, 13, 14, 15]})
    assert engine.plan(preprocess(K3, "hi", stop_token_ids=[13])) == ([10, 11, 12], "stop")
    assert engine.plan(preprocess(K3, "hi", max_tokens=4)) == ([10, 11, 12, 13], "length")
    eos = k3_tokenizer.special_tokens["[EOS]"]  # a hidden stop id, like <|end_of_msg|>
    with_eos = engine_with(tmp_path, {"when": "", "token_ids": [10, eos, 11]})
    assert with_eos.plan(preprocess(K3, "hi")) == ([10], "stop")


async def test_a_migrated_scripted_reply_continues_where_it_stopped(tmp_path: Path) -> None:
    engine = engine_with(tmp_path, {"when": "story", "text": "Once upon a time there was a mock engine."})
    continuing = MockContinuation(engine)
    request = preprocess(K3, "Tell me a story")
    full, _ = engine.plan(request)
    for count in (1, 4, len(full) - 1):
        stop = msgspec.structs.replace(
            request.stop_conditions, max_tokens=request.stop_conditions.max_tokens - count
        )
        migrated = msgspec.structs.replace(
            request, token_ids=[*request.token_ids, *full[:count]], stop_conditions=stop
        )
        assert continuing.already_streamed(migrated) == count
        rest = [step async for step in continuing.generate(migrated)]
        assert [t for step in rest for t in step.token_ids] == full[count:]


# --- bad files -----------------------------------------------------------------------------------


GOOD = {"when": "a", "text": "fine"}


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("not json", r"malformed|JSON"),
        ('["when", "text"]', r"Expected `object`"),
        ('{"when": 3, "text": "x"}', r"Expected `str`, got `int` - at `\$\.when`"),
        ('{"text": "x"}', r"missing required field `when`"),
        ('{"when": "a"}', r"exactly one of segments, text, token_ids \(got none\)"),
        ('{"when": "a", "text": "x", "token_ids": [1]}', r"exactly one of .*\(got text, token_ids\)"),
        ('{"when": "a", "text": null}', r"Expected `str`, got `null`"),
        ('{"when": "a", "token_ids": [8448]}', r"token id 8448 is outside the vocabulary \[0, 8448\)"),
        ('{"when": "a", "token_ids": [-1]}', r"token id -1 is outside the vocabulary"),
        ('{"when": "a", "token_ids": [true]}', r"Expected `int`, got `bool`"),
        ('{"when": "a", "segments": [["x"]]}', r"Expected `array` of length 2"),
        ('{"when": "a", "segments": [["x", "yes"]]}', r"Expected `bool`, got `str`"),
        ('{"when": "a", "txt": "x"}', r"unknown field `txt`"),
    ],
)
def test_a_bad_line_names_the_file_and_line(
    tmp_path: Path, k3_tokenizer: Tokenizer, line: str, error: str
) -> None:
    path = write_replies(tmp_path / "replies.jsonl", GOOD, "", line, GOOD)
    with pytest.raises(RepliesError, match=rf"^{path}:3: .*({error})"):
        load_replies(path, k3_tokenizer)


def test_blank_lines_are_skipped_and_a_missing_file_is_named(tmp_path: Path, k3_tokenizer: Tokenizer) -> None:
    path = write_replies(tmp_path / "replies.jsonl", GOOD, "   ", {"when": "b", "token_ids": [1]})
    assert [(reply.when, reply.line) for reply in load_replies(path, k3_tokenizer)] == [("a", 1), ("b", 3)]
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(RepliesError, match=rf"^{missing}: cannot read the replies file"):
        MockEngine(K3, flavor="sglang", replies=missing)
