"""The answer parsers by vLLM's names: what ``dynamo-prep worker --tool-call-parser`` /
``--reasoning-parser`` accept, what a card may declare, and what the frontend builds.

A family is a half (``ReasoningHalf`` or ``ToolHalf``, one module) and one line in a table here.
``kimi_k3`` is one grammar for both halves. How to add a family: docs/answers.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final, Literal

from dynamo_prep.parsing._answer import AnswerParser, CallIds, new_call_id
from dynamo_prep.parsing._compose import ComposedAnswerParser
from dynamo_prep.parsing._halves import ParseOptions, ReasoningHalf, ToolHalf
from dynamo_prep.parsing._tokens import Vocab
from dynamo_prep.parsing.hermes import HermesTools
from dynamo_prep.parsing.kimi_k3 import MARKER_STRINGS, KimiK3AnswerParser
from dynamo_prep.parsing.llama3_json import Llama3JsonTools
from dynamo_prep.parsing.mistral import MistralReasoning, MistralTools
from dynamo_prep.parsing.plain import PlainAnswerParser
from dynamo_prep.parsing.think import DeepSeekR1Reasoning, ThinkTagReasoning

__all__ = [
    "KIMI_K3_PARSER",
    "REASONING_HALVES",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "TOOL_HALVES",
    "call_ids_of",
    "check_parser_names",
    "engine_reasoning_flags",
    "parser_for",
]

KIMI_K3_PARSER: Final = "kimi_k3"
"""Kimi-K3's XTML: one grammar for reasoning and tool calls (``KimiK3AnswerParser``)."""

TOOL_HALVES: Final[Mapping[str, type[ToolHalf]]] = MappingProxyType(
    {
        "hermes": HermesTools,
        "qwen3_json": HermesTools,  # vLLM's alias of hermes for Qwen2.5/QwQ/Qwen3 JSON calls
        "llama3_json": Llama3JsonTools,
        "llama4_json": Llama3JsonTools,  # vLLM's alias: the same parser class
        "mistral": MistralTools,
    }
)
REASONING_HALVES: Final[Mapping[str, type[ReasoningHalf]]] = MappingProxyType(
    {
        "qwen3": ThinkTagReasoning,
        "deepseek_r1": DeepSeekR1Reasoning,
        "mistral": MistralReasoning,
    }
)
TOOL_CALL_PARSERS: Final = tuple(sorted({*TOOL_HALVES, KIMI_K3_PARSER}))
REASONING_PARSERS: Final = tuple(sorted({*REASONING_HALVES, KIMI_K3_PARSER}))

SKIP_TOKENIZER_INIT: Final = "--skip-tokenizer-init"
# The engines' own --reasoning-parser (they hold a structured-output grammar back until the
# reasoning ends): vLLM takes vLLM's names; SGLang spells some differently (None: SGLang has none).
_SGLANG_REASONING: Final[Mapping[str, str | None]] = MappingProxyType(
    {"qwen3": "qwen3", "deepseek_r1": "deepseek-r1", "mistral": "mistral", KIMI_K3_PARSER: "kimi_k3"}
)


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Raises ValueError naming the flag and the known names when either name is unknown."""
    for flag, name, known in (
        ("--tool-call-parser", tool_call_parser, TOOL_CALL_PARSERS),
        ("--reasoning-parser", reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in known:
            raise ValueError(f"unknown {flag} {name!r} (known: {', '.join(known)})")


def parser_for(
    vocab: Vocab,
    reasoning: str | None,
    tool_calls: str | None,
    options: ParseOptions,
    *,
    prompt_form: Literal["reference", "hosted"] = "reference",
) -> AnswerParser:
    """One response's parser for these registered names: ``kimi_k3`` (either half) reads both halves
    (``prompt_form`` is its; on a vocabulary without its four markers it is left out); else the
    reasoning half and the tool half composed; neither: plain."""
    if KIMI_K3_PARSER in (reasoning, tool_calls):
        if not all(marker in vocab.special_tokens for marker in MARKER_STRINGS):
            return parser_for(vocab, _without_k3(reasoning), _without_k3(tool_calls), options)
        return KimiK3AnswerParser(
            vocab,
            thinking=options.thinking,
            prompt_form=prompt_form,
            tools_enabled=options.tools_enabled,
            call_ids=options.call_ids,
        )
    if reasoning is None and tool_calls is None:
        return PlainAnswerParser(vocab)
    return ComposedAnswerParser(
        vocab,
        REASONING_HALVES[reasoning] if reasoning is not None else None,
        TOOL_HALVES[tool_calls] if tool_calls is not None else None,
        options,
        family="+".join(name for name in (reasoning, tool_calls) if name is not None),
    )


def call_ids_of(tool_calls: str | None) -> CallIds:
    """How the tool-call format ``tool_calls`` (a registered name, or None) makes call ids (Mistral's:
    9 alphanumeric characters; else OpenAI's ``call_`` + 24 hex)."""
    half = TOOL_HALVES.get(tool_calls) if tool_calls is not None else None
    return half.new_call_id if half is not None else new_call_id


def _without_k3(name: str | None) -> str | None:
    return None if name == KIMI_K3_PARSER else name


def engine_reasoning_flags(
    engine: str, reasoning_parser: str | None, engine_args: Sequence[str] = ()
) -> tuple[str, ...]:
    """The engine's own ``--reasoning-parser`` for ours, as ``vllm serve`` / SGLang's server would
    get it; empty when the engine has no such parser, or runs without its tokenizer
    (``--skip-tokenizer-init``: its reasoning parser needs one, and the frontend parses anyway)."""
    if reasoning_parser is None or engine not in ("vllm", "sglang") or SKIP_TOKENIZER_INIT in engine_args:
        return ()
    name = reasoning_parser if engine == "vllm" else _SGLANG_REASONING.get(reasoning_parser)
    return ("--reasoning-parser", name) if name is not None else ()
