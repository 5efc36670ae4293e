"""Answer parsers: a response's output ids in, its reasoning, content and tool calls out.

Chosen per model by ``answer_parser_for`` (the worker's declared parsers, by vLLM's names in
``registry``, else the model family): a whole grammar parsed on token ids (Kimi-K3 XTML channels,
GPT-OSS Harmony messages), or a reasoning half (think tags) composed with a tool half (Hermes
``<tool_call>``, Llama 3 JSON, DeepSeek V3/V3.1, Qwen3-Coder XML, Kimi-K2 sections, GLM-4.5 XML), or
plain content.
Every parser streams (``feed`` as ids arrive, ``finish`` once) and counts what it recovered from
malformed output by kind (``RECOVERY_KINDS``). The contract: docs/answers.md.
"""

from __future__ import annotations

from dynamo_prep.parsing._answer import (
    AnswerDelta,
    AnswerParser,
    ContentDelta,
    ParsedAnswer,
    ReasoningDelta,
    ToolCallDelta,
    assistant_message,
    fold_deltas,
    new_call_id,
    parse_answer,
)
from dynamo_prep.parsing._choose import (
    HERMES_TOOL_PARSER,
    ParserChoice,
    answer_parser_for,
    call_ids_for,
    parser_choice,
)
from dynamo_prep.parsing._compose import ComposedAnswerParser
from dynamo_prep.parsing._halves import ParseOptions, ReasoningHalf, ToolHalf
from dynamo_prep.parsing._recoveries import RECOVERY_KINDS
from dynamo_prep.parsing._schema_types import tool_properties
from dynamo_prep.parsing.harmony import HarmonyAnswerParser
from dynamo_prep.parsing.hermes import HermesAnswerParser
from dynamo_prep.parsing.kimi_k3 import KimiK3AnswerParser
from dynamo_prep.parsing.plain import PlainAnswerParser, plain_parser_for
from dynamo_prep.parsing.registry import (
    KIMI_K3_PARSER,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    check_parser_names,
    parser_for,
)
from dynamo_prep.parsing.think import prompt_ends_in_think, thinking_requested

__all__ = [
    "HERMES_TOOL_PARSER",
    "KIMI_K3_PARSER",
    "REASONING_PARSERS",
    "RECOVERY_KINDS",
    "TOOL_CALL_PARSERS",
    "AnswerDelta",
    "AnswerParser",
    "ComposedAnswerParser",
    "ContentDelta",
    "HarmonyAnswerParser",
    "HermesAnswerParser",
    "KimiK3AnswerParser",
    "ParseOptions",
    "ParsedAnswer",
    "ParserChoice",
    "PlainAnswerParser",
    "ReasoningDelta",
    "ReasoningHalf",
    "ToolCallDelta",
    "ToolHalf",
    "answer_parser_for",
    "assistant_message",
    "call_ids_for",
    "check_parser_names",
    "fold_deltas",
    "new_call_id",
    "parse_answer",
    "parser_choice",
    "parser_for",
    "plain_parser_for",
    "prompt_ends_in_think",
    "thinking_requested",
    "tool_properties",
]
