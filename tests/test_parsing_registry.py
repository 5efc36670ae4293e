"""The parser registry: every registered name builds a parser, on its family's vocabulary (markers as
tokens) and on one that has none of its markers (markers then matched in text), and parses any ids
without raising. A new family adds its registry line and a line to ``FAMILY_MODELS`` here."""

from __future__ import annotations

import random
from functools import cache

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids
from test_parsing_streams import K3, QWEN

from dynamo_prep.engines.registry import bridge
from dynamo_prep.parsing import (
    REASONING_PARSERS,
    RECOVERY_KINDS,
    TOOL_CALL_PARSERS,
    AnswerParser,
    ContentDelta,
    ParseOptions,
    ReasoningDelta,
    ToolCallDelta,
    check_parser_names,
    parser_for,
)
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.parsing.registry import REASONING_HALVES, TOOL_HALVES, WHOLE_GRAMMARS, whole_grammar
from dynamo_prep.tokenizer import Tokenizer

FAMILY_MODELS = {
    "hermes": "qwen3",
    "qwen3_json": "qwen3",
    "llama3_json": "llama3",
    "llama4_json": "llama4",
    "pythonic": "llama3",
    "llama4_pythonic": "llama4",
    "qwen3": "qwen3",
    "deepseek_r1": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v31": "deepseek_v3",
    "qwen3_coder": "qwen3",
    "mistral": "mistral_small_3",
    "kimi_k3": K3,
    "openai": "gpt_oss",
    "openai_gptoss": "gpt_oss",
    "kimi_k2": "kimi_k2",
    "glm45": "glm45",
}
"""A model directory of each registered name's family (a real vocabulary with its markers): a
tests/support/hf_models directory, or a demo model."""
PLAIN_MODEL = QWEN  # the qwen-vl-demo vocabulary: no think, call or python tags


@cache
def tokenizer(model: str) -> Tokenizer:
    built = built_models()
    return Tokenizer.from_model_dir(built.get(model, model))


def halves(name: str, half: str) -> tuple[str | None, str | None]:
    return (name, None) if half == "reasoning" else (None, name)


NAMES = [("reasoning", name) for name in REASONING_PARSERS] + [("tools", name) for name in TOOL_CALL_PARSERS]


def test_every_registered_name_has_a_family_model() -> None:
    assert set(FAMILY_MODELS) == {*REASONING_PARSERS, *TOOL_CALL_PARSERS}
    assert set(TOOL_CALL_PARSERS) == {*TOOL_HALVES, *(grammar.tool_calls for grammar in WHOLE_GRAMMARS)}
    assert set(REASONING_PARSERS) == {*REASONING_HALVES, *(grammar.reasoning for grammar in WHOLE_GRAMMARS)}


def sample_ids(tok: Tokenizer, rng: random.Random) -> list[int]:
    """Every marker string a registered parser reads (as a token where it is one, else as text), text
    that spells them, JSON pieces, specials, an id outside the vocabulary, in random order."""
    markers = {m for half in (*TOOL_HALVES.values(), *REASONING_HALVES.values()) for m in half.MARKERS}
    markers.update(marker for grammar in WHOLE_GRAMMARS for marker in grammar.markers)
    pieces = [*markers, '{"name": "f", "parameters": {"a": [1, "}"]}}', ";", "\n", " 你好 😀", "{", '"', "}"]
    ids: list[int] = []
    for _ in range(60):
        piece = rng.choice(pieces)
        ids += tok.encode_segments([(piece, tok.is_special_token(piece) and rng.random() < 0.8)])
    ids += [*tok.eos_token_ids[:1], *list(tok.special_tokens.values())[:3], tok.n_vocab + 5]
    rng.shuffle(ids)
    return ids


@pytest.mark.parametrize(("half", "name"), NAMES)
@pytest.mark.parametrize("vocabulary", ["family", "plain"])
def test_every_registered_name_builds_and_parses_anything(half: str, name: str, vocabulary: str) -> None:
    tok = tokenizer(FAMILY_MODELS[name] if vocabulary == "family" else PLAIN_MODEL)
    vocab = vocab_of(tok)
    grammar = whole_grammar(*halves(name, half))
    unusable = grammar is not None and vocabulary == "plain"  # a whole grammar without its markers: left out
    for thinking in (False, True):

        def make(thinking: bool = thinking) -> AnswerParser:
            return parser_for(
                vocab, *halves(name, half), ParseOptions(thinking=thinking, call_ids=counting_ids())
            )

        assert make().family == ("plain" if unusable else name)
        for seed in range(3):
            ids = sample_ids(tok, random.Random(seed))
            for finish in ("stop", "length"):
                answer, recoveries = all_ways(make, ids, finish, seeds=(seed,))
                assert set(recoveries) <= set(RECOVERY_KINDS)
                assert all(call.name for call in answer.tool_calls)


def test_a_composed_parser_never_releases_empty_text_and_calls_are_whole() -> None:
    tok = tokenizer("qwen3")
    parser = parser_for(vocab_of(tok), "qwen3", "hermes", ParseOptions(thinking=True))
    ids = tok.encode_segments([("r", False), ("</think>", True), ("c", False), ("<tool_call>", True)])
    ids += tok.encode_segments([('{"name": "f", "arguments": {}}', False), ("</tool_call>", True)])
    deltas = [d for token_id in ids for d in parser.feed([token_id])] + parser.finish("stop")
    assert [type(d) for d in deltas] == [ReasoningDelta, ContentDelta, ToolCallDelta]
    assert parser.family == "qwen3+hermes"


def test_unknown_names_are_refused_with_the_known_ones() -> None:
    check_parser_names("hermes", "qwen3")
    check_parser_names(None, None)
    with pytest.raises(
        ValueError, match=r"unknown --tool-call-parser 'granite' \(known: .*hermes.*llama3_json"
    ):
        check_parser_names("granite", None)
    with pytest.raises(
        ValueError, match=r"unknown --reasoning-parser 'granite' \(known: deepseek_r1, .*kimi_k3"
    ):
        check_parser_names(None, "granite")


def test_the_reasoning_parser_is_also_the_engines_own_flag() -> None:
    assert bridge("vllm").reasoning_flags("deepseek_r1", ()) == ("--reasoning-parser", "deepseek_r1")
    assert bridge("sglang").reasoning_flags("deepseek_r1", ()) == ("--reasoning-parser", "deepseek-r1")
    assert bridge("sglang").reasoning_flags("qwen3", ()) == ("--reasoning-parser", "qwen3")
    assert bridge("sglang").reasoning_flags("deepseek_v3", ()) == ("--reasoning-parser", "deepseek-v3")
    assert bridge("sglang").reasoning_flags("openai_gptoss", ()) == ("--reasoning-parser", "gpt-oss")
    assert bridge("vllm").reasoning_flags("glm45", ()) == ("--reasoning-parser", "glm45")
    assert bridge("sglang").reasoning_flags("mistral", ()) == ("--reasoning-parser", "mistral")  # [THINK]
    assert bridge("mock").reasoning_flags("qwen3", ()) == ()
    assert bridge("vllm").reasoning_flags(None, ()) == ()
    # the engine's reasoning parser needs its tokenizer (vLLM refuses to start without one)
    assert bridge("vllm").reasoning_flags("qwen3", ["--seed", "0", "--skip-tokenizer-init"]) == ()
