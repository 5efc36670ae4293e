"""OpenAI's Responses API, the answer: the chat path's parsed answer (reasoning, content, tool calls)
becomes a response object or its typed SSE events (``ResponseBuilder``); the request's side is
``responses_request.py``. The mapping: docs/frontend.md "The Responses API".
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from dynamo_prep.frontend.errors import REQUEST_ERRORS, OpenAIError, as_openai_error
from dynamo_prep.frontend.openai_stream import Completion, answer_deltas
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.parsing import AnswerDelta, ContentDelta, ReasoningDelta, ToolCallDelta
from dynamo_prep.protocol.responses import (
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
)
from dynamo_prep.protocol.wire import Output

__all__ = ["ResponseBuilder", "collect_response", "response_events"]

log = structlog.get_logger("dynamo_prep.frontend")
_encoder = msgspec.json.Encoder()


@dataclass
class _OpenItem:
    """The reasoning or message item text is streaming into."""

    kind: type[ReasoningItem] | type[OutputMessage]
    index: int
    id: str
    text: list[str] = field(default_factory=list)


class ResponseBuilder:
    """The response's output items from the answer's deltas, and the events that stream them.

    Reasoning and content each stream into an item opened at their first delta and closed when
    another kind of delta (or the end) comes; a tool call is one whole ``function_call`` item.
    """

    def __init__(self, completion: Completion, asked: ResponsesRequest) -> None:
        self.completion = completion
        self.asked = asked
        self.output: list[OutputItem] = []
        self.failed: OpenAIError | None = None
        self._open: _OpenItem | None = None
        self._sequence = itertools.count()

    def start(self) -> list[StreamEvent]:
        snapshot = self.response()
        return [
            ResponseCreated(sequence_number=self._next(), response=snapshot),
            ResponseInProgress(sequence_number=self._next(), response=snapshot),
        ]

    def take(self, deltas: Sequence[AnswerDelta]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for delta in deltas:
            if isinstance(delta, ReasoningDelta | ContentDelta):
                if delta.text:
                    events += self._text(
                        ReasoningItem if isinstance(delta, ReasoningDelta) else OutputMessage, delta.text
                    )
            else:
                events += self._close("completed")
                events += self._call(delta)
        return events

    def finish(self) -> list[StreamEvent]:
        """The last item closed, then ``response.completed`` (or ``.incomplete`` at the length limit)."""
        incomplete = self.completion.finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        final = self.response()
        event = ResponseIncomplete if incomplete else ResponseCompleted
        return [*events, event(sequence_number=self._next(), response=final)]

    def fail(self, error: OpenAIError) -> list[StreamEvent]:
        """A failure after the stream started: an ``error`` event, then ``response.failed``."""
        self.failed = error
        code = "server_error" if error.status >= 500 else "invalid_request"
        return [
            ErrorEvent(sequence_number=self._next(), message=error.message, code=code, param=error.param),
            ResponseFailed(sequence_number=self._next(), response=self.response()),
        ]

    def response(self) -> ResponseObject:
        """The response as it stands: in progress until the answer ended, then its final form."""
        completion, asked = self.completion, self.asked
        finished = completion.finish_reason is not None
        status = "failed" if self.failed else "in_progress" if not finished else "completed"
        details = None
        if finished and completion.finish_reason == "length":
            status, details = "incomplete", IncompleteDetails(reason="max_output_tokens")
        return ResponseObject(
            id=completion.id,
            created_at=completion.created,
            model=completion.model,
            status=status,
            output=list(self.output) if finished or self.failed else [],
            usage=self._usage() if finished else None,
            tool_choice=asked.tool_choice if asked.tool_choice is not None else "auto",
            tools=asked.tools or [],
            parallel_tool_calls=asked.parallel_tool_calls is not False,
            text=asked.text or {"format": {"type": "text"}},
            metadata=asked.metadata or {},
            instructions=asked.instructions,
            max_output_tokens=asked.max_output_tokens,
            temperature=asked.temperature,
            top_p=asked.top_p,
            user=asked.user,
            reasoning=asked.reasoning,
            truncation=asked.truncation or "disabled",
            incomplete_details=details,
            error=ResponseError(code="server_error", message=self.failed.message) if self.failed else None,
        )

    def _usage(self) -> ResponseUsage:
        completion = self.completion
        return ResponseUsage(
            input_tokens=completion.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=completion.cached_tokens),
            output_tokens=completion.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=completion.answer.reasoning_tokens),
            total_tokens=completion.prompt_tokens + completion.completion_tokens,
        )

    def _next(self) -> int:
        return next(self._sequence)

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self.completion.id.removeprefix('resp_')}_{len(self.output)}"

    def _text(self, kind: type[ReasoningItem] | type[OutputMessage], text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        opened = self._open
        if opened is None or opened.kind is not kind:
            events += self._close("completed")
            events += self._open_item(kind)
            opened = self._open
            assert opened is not None
        opened.text.append(text)
        seq, item_id, index = self._next(), opened.id, opened.index
        if kind is ReasoningItem:
            delta: StreamEvent = ReasoningTextDelta(
                sequence_number=seq, item_id=item_id, output_index=index, content_index=0, delta=text
            )
        else:
            delta = OutputTextDelta(
                sequence_number=seq, item_id=item_id, output_index=index, content_index=0, delta=text
            )
        return [*events, delta]

    def _open_item(self, kind: type[ReasoningItem] | type[OutputMessage]) -> list[StreamEvent]:
        prefix = "rs" if kind is ReasoningItem else "msg"
        opened = self._open = _OpenItem(kind, len(self.output), self._item_id(prefix))
        item = _item(opened, "in_progress")
        self.output.append(item)  # replaced when the item closes
        part = ReasoningText(text="") if kind is ReasoningItem else OutputText(text="")
        return [
            OutputItemAdded(sequence_number=self._next(), output_index=opened.index, item=item),
            self._part(ContentPartAdded, opened, part),
        ]

    def _close(self, status: str) -> list[StreamEvent]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        text = "".join(opened.text)
        self.output[opened.index] = item = _item(opened, status)
        seq, item_id, index = self._next(), opened.id, opened.index
        done: StreamEvent
        part: OutputText | ReasoningText
        if opened.kind is ReasoningItem:
            part = ReasoningText(text=text)
            done = ReasoningTextDone(
                sequence_number=seq, item_id=item_id, output_index=index, content_index=0, text=text
            )
        else:
            part = OutputText(text=text)
            done = OutputTextDone(
                sequence_number=seq, item_id=item_id, output_index=index, content_index=0, text=text
            )
        return [
            done,
            self._part(ContentPartDone, opened, part),
            OutputItemDone(sequence_number=self._next(), output_index=index, item=item),
        ]

    def _part(
        self,
        event: type[ContentPartAdded] | type[ContentPartDone],
        opened: _OpenItem,
        part: OutputText | ReasoningText,
    ) -> StreamEvent:
        return event(
            sequence_number=self._next(),
            item_id=opened.id,
            output_index=opened.index,
            content_index=0,
            part=part,
        )

    def _call(self, call: ToolCallDelta) -> list[StreamEvent]:
        index, item_id = len(self.output), self._item_id("fc")
        added = FunctionCallItem(
            id=item_id, call_id=call.id, name=call.name, arguments="", status="in_progress"
        )
        item = FunctionCallItem(
            id=item_id, call_id=call.id, name=call.name, arguments=call.arguments, status="completed"
        )
        self.output.append(item)
        return [
            OutputItemAdded(sequence_number=self._next(), output_index=index, item=added),
            FunctionCallArgumentsDelta(
                sequence_number=self._next(), item_id=item_id, output_index=index, delta=call.arguments
            ),
            FunctionCallArgumentsDone(
                sequence_number=self._next(), item_id=item_id, output_index=index, arguments=call.arguments
            ),
            OutputItemDone(sequence_number=self._next(), output_index=index, item=item),
        ]


def _item(opened: _OpenItem, status: str) -> OutputItem:
    text = "".join(opened.text)
    if opened.kind is ReasoningItem:
        return ReasoningItem(id=opened.id, status=status, content=[ReasoningText(text=text)] if text else [])
    return OutputMessage(id=opened.id, status=status, content=[OutputText(text=text)] if text else [])


async def collect_response(
    outputs: AsyncIterator[Output], builder: ResponseBuilder, record: RequestRecord
) -> ResponseObject:
    """The whole answer, as the non-streamed response object."""
    async for deltas in answer_deltas(outputs, builder.completion, record):
        builder.take(deltas)
    builder.finish()
    return builder.response()


async def response_events(
    outputs: AsyncGenerator[Output, None], builder: ResponseBuilder, record: RequestRecord
) -> AsyncGenerator[bytes, None]:
    """The SSE body: one write per worker output, each the events it made visible. A failure after
    the response started becomes ``error`` and ``response.failed`` events (the status is sent)."""
    pending = builder.start()
    try:
        async with contextlib.aclosing(outputs):
            async for deltas in answer_deltas(outputs, builder.completion, record):
                pending += builder.take(deltas)
                if builder.completion.finish_reason is None and pending:
                    yield _sse(pending)
                    pending = []
        pending += builder.finish()
    except REQUEST_ERRORS as exc:
        error = as_openai_error(exc)
        log.warning("stream_failed", status=error.status, error=error.message)
        pending += builder.fail(error)
    yield _sse(pending)


def _sse(events: list[StreamEvent]) -> bytes:
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (event.__struct_config__.tag.encode(), _encoder.encode(event))  # type: ignore[union-attr]
        for event in events
    )
