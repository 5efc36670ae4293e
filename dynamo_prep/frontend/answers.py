"""One response's answer: the model's output ids through its parser, then the request's options.

The parser (chosen per model, ``dynamo_prep.parsing``) turns ids into reasoning, content and tool
calls; this layer applies what the request asked for: stop strings cut the content (and end the
answer), ``include_reasoning: false`` drops the reasoning, ``tool_choice: "none"`` gets a parser
that returns no calls, a forced tool choice one that reads the constrained JSON as the calls.
What the parser recovered from malformed output is counted once, at the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.frontend.stops import StopMatcher
from dynamo_prep.parsing import (
    AnswerDelta,
    AnswerParser,
    ContentDelta,
    ReasoningDelta,
    answer_parser_for,
    call_ids_for,
    prompt_ends_in_think,
    thinking_requested,
    tool_properties,
)
from dynamo_prep.parsing.forced import ForcedToolParser
from dynamo_prep.preprocessor import stop_strings
from dynamo_prep.prompt import RenderedPrompt
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.protocol.structured import forced_tool
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["AnswerStream", "answer_stream_for"]


class AnswerStream:
    """``push`` the worker's ids as they stream, ``finish`` once; both return the client's deltas."""

    def __init__(
        self, parser: AnswerParser, *, stops: Sequence[str] = (), include_reasoning: bool = True
    ) -> None:
        self._parser = parser
        self._stops = StopMatcher(stops)
        self._include_reasoning = include_reasoning
        self.tool_calls = 0
        self.stopped = False  # a stop string ended the content: nothing more is released

    @property
    def recoveries(self) -> Mapping[str, int]:
        return self._parser.recoveries

    @property
    def reasoning_tokens(self) -> int:
        return self._parser.reasoning_tokens

    @property
    def family(self) -> str:
        return self._parser.family

    def push(self, token_ids: Sequence[int]) -> list[AnswerDelta]:
        return self._options(self._parser.feed(token_ids)) if not self.stopped else []

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        """The rest of the answer: what the parser held, then what the stop matcher held."""
        if self.stopped:
            return []
        deltas = self._options(self._parser.finish(finish_reason))
        if not self.stopped and (tail := self._stops.finish()):
            deltas.append(ContentDelta(tail))
        return deltas

    def _options(self, deltas: list[AnswerDelta]) -> list[AnswerDelta]:
        kept: list[AnswerDelta] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                text, self.stopped = self._stops.push(delta.text)
                if text:
                    kept.append(ContentDelta(text))
                if self.stopped:
                    break
            elif isinstance(delta, ReasoningDelta):
                if self._include_reasoning:
                    kept.append(delta)
            else:
                self.tool_calls += 1
                kept.append(delta)
        return kept


def answer_stream_for(
    card: ModelDeploymentCard, tokenizer: Tokenizer, chat: ChatCompletionRequest, prompt: RenderedPrompt
) -> AnswerStream:
    """The answer of ``chat`` on ``card``'s model: the parser starts where ``prompt`` left off (a
    K3 channel it opened, or a ``<think>`` block a template opened)."""
    channel = prompt.open_channel
    call_ids = call_ids_for(card, tokenizer)  # the format's own (Mistral: 9 alphanumeric characters)
    parser = answer_parser_for(
        card,
        tokenizer,
        thinking=channel == "think" or (channel is None and prompt_ends_in_think(prompt.text)),
        prompt_form="reference" if channel is not None else "hosted",
        tools_enabled=chat.tool_choice != "none",
        tools_declared=bool(chat.tools),
        thinking_requested=thinking_requested(chat.template_args()),
        tool_properties=tool_properties(chat.tools),
        call_ids=call_ids,
    )
    forced = forced_tool(chat.tool_choice) if chat.tools else None
    if forced is not None:  # the engine was constrained to the call's JSON (docs/structured-outputs.md)
        parser = ForcedToolParser(parser, forced, call_ids=call_ids)
    return AnswerStream(parser, stops=stop_strings(chat.stop), include_reasoning=chat.include_reasoning)
