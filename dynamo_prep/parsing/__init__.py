"""Answer parsers: a response's output ids in, its reasoning, content and tool calls out.

Chosen per model by ``answer_parser_for`` (the worker's declared parsers, else the model family):
Kimi-K3 XTML channels parsed on token ids, Qwen/Hermes think tags and ``<tool_call>`` blocks, or
plain content. Every parser streams (``feed`` as ids arrive, ``finish`` once) and counts what it
recovered from malformed output by kind (``RECOVERY_KINDS``). The contract: docs/answers.md.
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
    KIMI_K3_PARSER,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ParserChoice,
    answer_parser_for,
    parser_choice,
)
from dynamo_prep.parsing._recoveries import RECOVERY_KINDS
from dynamo_prep.parsing.hermes import HermesAnswerParser, prompt_ends_in_think
from dynamo_prep.parsing.kimi_k3 import KimiK3AnswerParser
from dynamo_prep.parsing.plain import PlainAnswerParser, plain_parser_for

__all__ = [
    "HERMES_TOOL_PARSER",
    "KIMI_K3_PARSER",
    "REASONING_PARSERS",
    "RECOVERY_KINDS",
    "TOOL_CALL_PARSERS",
    "AnswerDelta",
    "AnswerParser",
    "ContentDelta",
    "HermesAnswerParser",
    "KimiK3AnswerParser",
    "ParsedAnswer",
    "ParserChoice",
    "PlainAnswerParser",
    "ReasoningDelta",
    "ToolCallDelta",
    "answer_parser_for",
    "assistant_message",
    "fold_deltas",
    "new_call_id",
    "parse_answer",
    "parser_choice",
    "plain_parser_for",
    "prompt_ends_in_think",
]
