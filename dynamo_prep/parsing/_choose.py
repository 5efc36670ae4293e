"""Which answer parser a model gets: the worker's declaration when it names a registered parser
(``registry``), else the model family. Parser names are vLLM's."""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

import structlog

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.formatter import is_kimi_k3
from dynamo_prep.parsing._answer import AnswerParser, CallIds
from dynamo_prep.parsing._halves import ParseOptions
from dynamo_prep.parsing._schema_types import NO_TOOLS, ToolProperties
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.parsing.registry import (
    HARMONY,
    KIMI_K3,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    WholeGrammar,
    call_ids_of,
    parser_for,
    whole_grammar,
)
from dynamo_prep.tokenizer import Tokenizer

log = structlog.get_logger("dynamo_prep.parsing")

HERMES_TOOL_PARSER: Final = "hermes"
CHATML_START: Final = "<|im_start|>"
GPT_OSS_MODEL_TYPE: Final = "gpt_oss"
_WARNED_MAX = 1024


class ParserChoice(NamedTuple):
    """The reasoning and tool-call parser names in effect for a model (None: that half is off)."""

    reasoning: str | None
    tool_calls: str | None


K3_FAMILY: Final = ParserChoice(KIMI_K3.reasoning, KIMI_K3.tool_calls)
HARMONY_FAMILY: Final = ParserChoice(HARMONY.reasoning, HARMONY.tool_calls)
HERMES_FAMILY: Final = ParserChoice("qwen3", HERMES_TOOL_PARSER)
PLAIN: Final = ParserChoice(None, None)

_warned: set[tuple[str | None, ...]] = set()


def _first_time(*key: str | None) -> bool:
    """True once per key (a model and what is wrong with it): warnings are per model, not per request."""
    if key in _warned:
        return False
    if len(_warned) >= _WARNED_MAX:
        _warned.clear()
    _warned.add(key)
    return True


def family_parsers(card: ModelDeploymentCard, tokenizer: Tokenizer) -> ParserChoice:
    """Kimi-K3 by the formatter's detection rule; GPT-OSS (model_type ``gpt_oss``, as vLLM picks its
    Harmony parser) gets Harmony; ChatML (a Qwen model_type, or a tokenizer with ``<|im_start|>``)
    gets Qwen's think tags and Hermes calls; anything else is plain content."""
    if is_kimi_k3(card.model_type, card.display_name):
        return K3_FAMILY
    if card.model_type == GPT_OSS_MODEL_TYPE:
        return HARMONY_FAMILY
    if (card.model_type or "").startswith("qwen") or tokenizer.is_special_token(CHATML_START):
        return HERMES_FAMILY
    return PLAIN


def parser_choice(card: ModelDeploymentCard, tokenizer: Tokenizer) -> ParserChoice:
    """The declared parsers where known, the family's otherwise (an unknown name is warned about)."""
    family = family_parsers(card, tokenizer)
    declared = card.runtime_config
    reasoning, tools = declared.reasoning_parser, declared.tool_call_parser
    model = card.display_name
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        if _first_time("unknown", model, "reasoning", reasoning):
            log.warning(
                "answer_parser_unknown", model=model, reasoning_parser=reasoning, using=family.reasoning
            )
        reasoning = None
    if tools is not None and tools not in TOOL_CALL_PARSERS:
        if _first_time("unknown", model, "tools", tools):
            log.warning("answer_parser_unknown", model=model, tool_call_parser=tools, using=family.tool_calls)
        tools = None
    choice = ParserChoice(reasoning or family.reasoning, tools or family.tool_calls)
    grammar = whole_grammar(*choice)
    return choice if grammar is None else _whole(grammar, choice, family, card, tokenizer)


def _whole(
    grammar: WholeGrammar,
    choice: ParserChoice,
    family: ParserChoice,
    card: ModelDeploymentCard,
    tokenizer: Tokenizer,
) -> ParserChoice:
    """A whole grammar reads both halves: without its marker tokens it is left out (the family's
    parsers, or plain); a name of another format declared for the other half is warned about."""
    model = card.display_name
    own = ParserChoice(grammar.reasoning, grammar.tool_calls)
    if not all(tokenizer.is_special_token(marker) for marker in grammar.markers):
        fallback = PLAIN if whole_grammar(*family) is grammar else family
        if _first_time("unusable", model, *choice):
            log.warning(
                "answer_parser_unusable",
                model=model,
                parser=grammar.tool_calls,
                reason=f"the tokenizer does not register the markers {', '.join(grammar.markers)}",
                using=fallback.tool_calls or fallback.reasoning,
            )
        return fallback
    if any(name not in (None, *own) for name in choice) and _first_time("mixed", model, *choice):
        log.warning(
            "answer_parsers_mixed",
            model=model,
            reasoning_parser=choice.reasoning,
            tool_call_parser=choice.tool_calls,
            using=grammar.tool_calls,
        )
    return own


def answer_parser_for(
    card: ModelDeploymentCard,
    tokenizer: Tokenizer,
    *,
    thinking: bool,
    prompt_form: Literal["reference", "hosted"] = "reference",
    tools_enabled: bool = True,
    tools_declared: bool = True,
    call_ids: CallIds | None = None,
    thinking_requested: bool = False,
    tool_properties: ToolProperties = NO_TOOLS,
) -> AnswerParser:
    """A fresh parser for one response of ``card``'s model.

    ``thinking``: for K3, the prompt ended in the ``think`` channel (else ``response``; from a
    rendered prompt: ``open_channel == "think"``, and ``prompt_form`` is ``"hosted"`` when no channel
    is open); for the
    think-tag parsers, the prompt opened a ``<think>`` block (``prompt_ends_in_think``), so text
    before ``</think>`` is reasoning (``deepseek_r1`` always assumes so, as vLLM's does).
    ``tools_enabled=False`` (``tool_choice: "none"``) drops every call; ``tools_declared``: the
    request declared tools (formats that cannot tell a call from a JSON answer need them).
    ``thinking_requested``: the request's template kwargs asked for thinking (``deepseek_v3``
    reads it, as vLLM's does); ``tool_properties``: the declared tools' property schemas
    (``tool_properties(chat.tools)``; ``qwen3_coder`` types its values by them).
    ``call_ids``: makes each call's id (None: the format's own, ``call_ids_for``).
    """
    choice = parser_choice(card, tokenizer)
    options = ParseOptions(
        thinking=thinking,
        tools_enabled=tools_enabled,
        tools_declared=tools_declared,
        call_ids=call_ids,
        thinking_requested=thinking_requested,
        tool_properties=tool_properties,
    )
    return parser_for(vocab_of(tokenizer), *choice, options, prompt_form=prompt_form)


def call_ids_for(card: ModelDeploymentCard, tokenizer: Tokenizer) -> CallIds:
    """How the tool calls of ``card``'s model get their ids: its tool-call format's own (Mistral's
    templates want 9 alphanumeric characters), so a call sent back renders."""
    return call_ids_of(parser_choice(card, tokenizer).tool_calls)
