"""The answer parsers by vLLM's names: what ``dynamo-prep worker --tool-call-parser`` /
``--reasoning-parser`` accept, what a card may declare, and what the frontend builds.

A family is a half (``ReasoningHalf`` or ``ToolHalf``, one module) and one line in a table here;
a format whose one grammar reads both (Kimi-K3, GPT-OSS Harmony) is a line in ``WHOLE_GRAMMARS``.
How to add a family: docs/answers.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from dynamo_prep.parsing import harmony, kimi_k3
from dynamo_prep.parsing._answer import AnswerParser, CallIds, new_call_id
from dynamo_prep.parsing._compose import ComposedAnswerParser
from dynamo_prep.parsing._halves import ParseOptions, ReasoningHalf, ToolHalf
from dynamo_prep.parsing._tokens import Vocab
from dynamo_prep.parsing.deepseek import DeepSeekV3Reasoning, DeepSeekV3Tools, DeepSeekV31Tools
from dynamo_prep.parsing.glm45 import Glm45Tools
from dynamo_prep.parsing.harmony import HarmonyAnswerParser
from dynamo_prep.parsing.hermes import HermesTools
from dynamo_prep.parsing.kimi_k2 import KimiK2Tools
from dynamo_prep.parsing.kimi_k3 import KimiK3AnswerParser
from dynamo_prep.parsing.llama3_json import Llama3JsonTools
from dynamo_prep.parsing.mistral import MistralReasoning, MistralTools
from dynamo_prep.parsing.plain import PlainAnswerParser
from dynamo_prep.parsing.pythonic import Llama4PythonicTools, PythonicTools
from dynamo_prep.parsing.qwen3_coder import Qwen3CoderTools
from dynamo_prep.parsing.think import DeepSeekR1Reasoning, ThinkTagReasoning

__all__ = [
    "HARMONY",
    "KIMI_K3",
    "KIMI_K3_PARSER",
    "REASONING_HALVES",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "TOOL_HALVES",
    "WHOLE_GRAMMARS",
    "WholeGrammar",
    "call_ids_of",
    "check_parser_names",
    "parser_for",
    "whole_grammar",
]

KIMI_K3_PARSER: Final = "kimi_k3"
"""Kimi-K3's XTML: one grammar for reasoning and tool calls (``KimiK3AnswerParser``)."""

TOOL_HALVES: Final[Mapping[str, type[ToolHalf]]] = MappingProxyType(
    {
        "hermes": HermesTools,
        "qwen3_json": HermesTools,  # vLLM's alias of hermes for Qwen2.5/QwQ/Qwen3 JSON calls
        "llama3_json": Llama3JsonTools,
        "llama4_json": Llama3JsonTools,  # vLLM's alias: the same parser class
        "deepseek_v3": DeepSeekV3Tools,
        "deepseek_v31": DeepSeekV31Tools,
        "qwen3_coder": Qwen3CoderTools,
        "kimi_k2": KimiK2Tools,
        "glm45": Glm45Tools,
        "pythonic": PythonicTools,
        "llama4_pythonic": Llama4PythonicTools,
        "mistral": MistralTools,
    }
)
REASONING_HALVES: Final[Mapping[str, type[ReasoningHalf]]] = MappingProxyType(
    {
        "qwen3": ThinkTagReasoning,
        "deepseek_r1": DeepSeekR1Reasoning,
        "deepseek_v3": DeepSeekV3Reasoning,
        "glm45": ThinkTagReasoning,  # GLM-4.5's <think> block, read as Qwen3's
        "mistral": MistralReasoning,
    }
)

PromptForm = Literal["reference", "hosted"]


@dataclass(frozen=True)
class WholeGrammar:
    """A format whose one grammar reads reasoning and tool calls (vLLM reads it with one parser
    class too): used when either of its names is declared, on a vocabulary holding its markers as
    tokens; ``build(vocab, options, prompt_form, family)`` makes one response's parser."""

    reasoning: str
    tool_calls: str
    markers: tuple[str, ...]
    build: Callable[[Vocab, ParseOptions, PromptForm, str], AnswerParser]

    def names(self) -> tuple[str, ...]:
        return (self.reasoning, self.tool_calls)

    def usable(self, vocab: Vocab) -> bool:
        return all(marker in vocab.special_tokens for marker in self.markers)

    def family(self, reasoning: str | None, tool_calls: str | None) -> str:
        """The declared names it reads, joined (the ``family`` label of the parse-error metric)."""
        return "+".join(dict.fromkeys(name for name in (reasoning, tool_calls) if name in self.names()))


def _kimi_k3(vocab: Vocab, options: ParseOptions, prompt_form: PromptForm, family: str) -> AnswerParser:
    return KimiK3AnswerParser(
        vocab,
        thinking=options.thinking,
        prompt_form=prompt_form,
        tools_enabled=options.tools_enabled,
        call_ids=options.call_ids,
    )


def _harmony(vocab: Vocab, options: ParseOptions, prompt_form: PromptForm, family: str) -> AnswerParser:
    return HarmonyAnswerParser(
        vocab, tools_enabled=options.tools_enabled, call_ids=options.call_ids, family=family
    )


KIMI_K3: Final = WholeGrammar(KIMI_K3_PARSER, KIMI_K3_PARSER, kimi_k3.MARKER_STRINGS, _kimi_k3)
HARMONY: Final = WholeGrammar("openai_gptoss", "openai", harmony.MARKER_STRINGS, _harmony)
WHOLE_GRAMMARS: Final = (KIMI_K3, HARMONY)

TOOL_CALL_PARSERS: Final = tuple(sorted({*TOOL_HALVES, *(g.tool_calls for g in WHOLE_GRAMMARS)}))
REASONING_PARSERS: Final = tuple(sorted({*REASONING_HALVES, *(g.reasoning for g in WHOLE_GRAMMARS)}))


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Raises ValueError naming the flag and the known names when either name is unknown."""
    for flag, name, known in (
        ("--tool-call-parser", tool_call_parser, TOOL_CALL_PARSERS),
        ("--reasoning-parser", reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in known:
            raise ValueError(f"unknown {flag} {name!r} (known: {', '.join(known)})")


def whole_grammar(reasoning: str | None, tool_calls: str | None) -> WholeGrammar | None:
    """The whole grammar either declared name belongs to (the first, when they name two)."""
    return next((g for g in WHOLE_GRAMMARS if reasoning in g.names() or tool_calls in g.names()), None)


def parser_for(
    vocab: Vocab,
    reasoning: str | None,
    tool_calls: str | None,
    options: ParseOptions,
    *,
    prompt_form: PromptForm = "reference",
) -> AnswerParser:
    """One response's parser for these registered names: a whole grammar when either half names one
    (``prompt_form`` is K3's; on a vocabulary without its markers it is left out); else the
    reasoning half and the tool half composed; neither: plain."""
    grammar = whole_grammar(reasoning, tool_calls)
    if grammar is not None:
        if not grammar.usable(vocab):
            return parser_for(vocab, _without(grammar, reasoning), _without(grammar, tool_calls), options)
        return grammar.build(vocab, options, prompt_form, grammar.family(reasoning, tool_calls))
    if reasoning is None and tool_calls is None:
        return PlainAnswerParser(vocab)
    return ComposedAnswerParser(
        vocab,
        REASONING_HALVES[reasoning] if reasoning is not None else None,
        TOOL_HALVES[tool_calls] if tool_calls is not None else None,
        options,
        family="+".join(dict.fromkeys(name for name in (reasoning, tool_calls) if name is not None)),
    )


def _without(grammar: WholeGrammar, name: str | None) -> str | None:
    return None if name in grammar.names() else name


def call_ids_of(tool_calls: str | None) -> CallIds:
    """How the tool-call format ``tool_calls`` (a registered name, or None) makes call ids (Mistral's:
    9 alphanumeric characters; else OpenAI's ``call_`` + 24 hex)."""
    half = TOOL_HALVES.get(tool_calls) if tool_calls is not None else None
    return half.new_call_id if half is not None else new_call_id
