"""Parsers are chosen, not hard-coded: the worker's declared parsers, else the model family."""

from __future__ import annotations

import pytest
import structlog
from test_parsing_streams import K3, QWEN, card, tokenizer

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.parsing import (
    HarmonyAnswerParser,
    KimiK3AnswerParser,
    ParsedAnswer,
    ParserChoice,
    PlainAnswerParser,
    answer_parser_for,
    parse_answer,
    parser_choice,
    prompt_ends_in_think,
)
from dynamo_prep.tokenizer import Tokenizer

CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


def declaring(
    name: str, served_name: str, *, reasoning: str | None = None, tools: str | None = None
) -> ModelDeploymentCard:
    """``name``'s card as announced by a worker declaring these parsers (one served name per test:
    warnings are once per model)."""
    runtime = ModelRuntimeConfig(reasoning_parser=reasoning, tool_call_parser=tools)
    return ModelDeploymentCard.from_model_dir(name, served_name=served_name, runtime_config=runtime)


def parse_text(model: ModelDeploymentCard, name: str, text: str, *, thinking: bool = False) -> ParsedAnswer:
    parser = answer_parser_for(model, tokenizer(name), thinking=thinking)
    return parse_answer(parser, tokenizer(name).encode(text), "stop")


def test_the_family_decides_when_nothing_is_declared() -> None:
    assert parser_choice(card(K3), tokenizer(K3)) == ParserChoice("kimi_k3", "kimi_k3")
    assert parser_choice(card(QWEN), tokenizer(QWEN)) == ParserChoice("qwen3", "hermes")
    assert isinstance(answer_parser_for(card(K3), tokenizer(K3), thinking=True), KimiK3AnswerParser)
    assert answer_parser_for(card(QWEN), tokenizer(QWEN), thinking=False).family == "qwen3+hermes"


def test_a_k3_model_is_recognised_by_its_served_name_without_a_model_type() -> None:
    nameless = ModelDeploymentCard.from_model_dir(K3, served_name="moonshot/Kimi-K3-demo")
    nameless.model_type = None
    assert parser_choice(nameless, tokenizer(K3)) == ParserChoice("kimi_k3", "kimi_k3")


def test_each_declared_parser_wins_over_the_family_for_its_half() -> None:
    """A model of no family (``llama`` type, no ChatML tokens) gets exactly the halves declared."""
    only_reasoning = declaring(K3, "reasoning-only", reasoning="deepseek_r1")
    only_reasoning.model_type = "llama"
    assert parser_choice(only_reasoning, tokenizer(K3)) == ParserChoice("deepseek_r1", None)
    parsed = parse_text(only_reasoning, K3, f"why</think>answer {CALL}")
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("why", f"answer {CALL}", [])

    only_tools = declaring(K3, "tools-only", tools="hermes")
    only_tools.model_type = "llama"
    assert parser_choice(only_tools, tokenizer(K3)) == ParserChoice(None, "hermes")
    parsed = parse_text(only_tools, K3, f"<think>x</think>{CALL}")
    assert (parsed.reasoning, parsed.content, [c.name for c in parsed.tool_calls]) == (
        "",
        "<think>x</think>",
        ["f"],
    )

    qwen_r1 = declaring(QWEN, "qwen-r1", reasoning="deepseek_r1")
    assert parser_choice(qwen_r1, tokenizer(QWEN)) == ParserChoice("deepseek_r1", "hermes")


def test_an_unknown_declared_name_falls_back_to_the_family_and_warns_once() -> None:
    model = declaring(QWEN, "qwen-unknown-parser", reasoning="granite", tools="granite_json")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert answer_parser_for(model, tokenizer(QWEN), thinking=False).family == "qwen3+hermes"
    warnings = [(e["event"], e.get("reasoning_parser"), e.get("tool_call_parser")) for e in logs]
    assert warnings == [
        ("answer_parser_unknown", "granite", None),
        ("answer_parser_unknown", None, "granite_json"),
    ]
    assert all(e["log_level"] == "warning" and e["model"] == "qwen-unknown-parser" for e in logs)


def test_kimi_k3_declared_for_a_tokenizer_without_its_markers_is_not_used() -> None:
    model = declaring(QWEN, "qwen-declares-k3", tools="kimi_k3")
    with structlog.testing.capture_logs() as logs:
        assert parser_choice(model, tokenizer(QWEN)) == ParserChoice("qwen3", "hermes")
        assert parser_choice(model, tokenizer(QWEN)) == ParserChoice("qwen3", "hermes")
    assert [e["event"] for e in logs] == ["answer_parser_unusable"]


def test_a_k3_model_declaring_another_tool_parser_still_gets_the_k3_grammar() -> None:
    model = declaring(K3, "k3-declares-hermes", tools="hermes")
    with structlog.testing.capture_logs() as logs:
        assert isinstance(answer_parser_for(model, tokenizer(K3), thinking=True), KimiK3AnswerParser)
    assert [(e["event"], e["tool_call_parser"]) for e in logs] == [("answer_parsers_mixed", "hermes")]


def test_a_model_of_no_family_with_nothing_declared_is_plain() -> None:
    plain = declaring(QWEN, "plain-model")
    plain.model_type = "llama"
    assert parser_choice(plain, tokenizer(K3)) == ParserChoice(None, None)
    assert isinstance(answer_parser_for(plain, tokenizer(K3), thinking=True), PlainAnswerParser)


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
    ],
)
def test_prompt_ends_in_think(prompt: str, opened: bool) -> None:
    assert prompt_ends_in_think(prompt) is opened


def test_gpt_oss_gets_harmony_by_model_type_and_harmony_reads_both_halves() -> None:
    from support.hf_models import built_models  # noqa: PLC0415

    directory = built_models()["gpt_oss"]
    gpt_oss = Tokenizer.from_model_dir(directory)
    plain = ModelDeploymentCard.from_model_dir(directory, served_name="gpt-oss-plain")
    assert parser_choice(plain, gpt_oss) == ParserChoice("openai_gptoss", "openai")
    declares_qwen3 = ModelDeploymentCard.from_model_dir(
        directory,
        served_name="gpt-oss-declares-qwen3",
        runtime_config=ModelRuntimeConfig(reasoning_parser="qwen3"),
    )
    with structlog.testing.capture_logs() as logs:
        assert isinstance(answer_parser_for(declares_qwen3, gpt_oss, thinking=False), HarmonyAnswerParser)
    assert [(e["event"], e["reasoning_parser"]) for e in logs] == [("answer_parsers_mixed", "qwen3")]


def test_harmony_declared_for_a_tokenizer_without_its_markers_is_not_used() -> None:
    model = declaring(QWEN, "qwen-declares-openai", tools="openai", reasoning="openai_gptoss")
    with structlog.testing.capture_logs() as logs:
        assert parser_choice(model, tokenizer(QWEN)) == ParserChoice("qwen3", "hermes")
    assert [(e["event"], e["parser"]) for e in logs] == [("answer_parser_unusable", "openai")]
