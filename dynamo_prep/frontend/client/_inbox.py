"""One request's replies on their way to its consumer: a stream's (``StreamInbox``) or a call's
(``AnswerInbox``); and a stream's timers (``Progress``)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TypeAlias

import msgspec

from dynamo_prep.frontend.client._errors import SlowReader, WorkerError, WorkerLost
from dynamo_prep.frontend.client._limits import MAX_BUFFERED_TOKENS, MAX_EMPTY_OUTPUTS
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.wire import Answer, ErrorReply, Output


class Deadline:
    """Queued for a request whose deadline passed without its final reply."""


class Overflow:
    """Queued for a request whose unread tokens passed ``MAX_BUFFERED_TOKENS``."""


DEADLINE = Deadline()
OVERFLOW = Overflow()
Item: TypeAlias = Output | Answer | ErrorReply | WorkerLost | Deadline | Overflow
Reply: TypeAlias = Output | Answer | ErrorReply
"""A worker's reply to a request (``Pong`` and ``FileData`` never reach an inbox)."""
# What ``Inbox.accept`` made of a reply.
TAKEN, UNSOLICITED, CUT, OVERFLOWED = range(4)


class Inbox:
    """One request's queued items; its consumer takes all that arrived at once."""

    __slots__ = ("_loop", "_waiter", "buffered", "cancel_sent", "ended", "items", "started", "worker_done")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.buffered = 0  # tokens queued and not taken yet
        self.started = False  # a token (or the end) came: the worker made progress
        self.ended = False  # the last reply is queued; later ones are unsolicited
        self.worker_done = False  # the worker ended it (its final reply, an ErrorReply)
        self.cancel_sent = False

    def accept(self, reply: Reply) -> int:
        """Queue a worker's reply for this request; what was made of it (``TAKEN``, ...)."""
        raise NotImplementedError

    def put(self, item: Item) -> None:
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def replace(self, item: Item) -> None:
        """Drop whatever is queued: ``item`` is reported at once."""
        self.items.clear()
        self.put(item)

    async def take(self) -> list[Item]:
        while not self.items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self.items)
        self.items.clear()
        self.buffered = 0
        return items


class StreamInbox(Inbox):
    """A generation's replies. Consecutive Outputs are merged as they arrive (one object however
    many frames came), the stream is cut at ``room`` tokens (its ``max_tokens``), and what is
    queued is bounded."""

    __slots__ = ("empties", "room")

    def __init__(self, loop: asyncio.AbstractEventLoop, max_tokens: int) -> None:
        super().__init__(loop)
        self.room = max_tokens  # tokens the stream may still carry
        self.empties = 0  # replies without a token that did not end the stream

    def accept(self, reply: Reply) -> int:
        if self.ended:
            return UNSOLICITED
        if reply.__class__ is ErrorReply:
            self.ended = self.started = self.worker_done = True
            self.put(reply)
            return TAKEN
        if reply.__class__ is Answer:  # a call's answer: not this stream's
            return UNSOLICITED
        return self._output(reply)  # type: ignore[arg-type]

    def _output(self, output: Output) -> int:
        count = len(output.token_ids)
        verdict = TAKEN
        if count > self.room:
            output = _cut(output, self.room)
            count, verdict = self.room, CUT
        elif not count and output.finish_reason is None:
            self.empties += 1
            if self.empties > MAX_EMPTY_OUTPUTS:
                return UNSOLICITED
        self.room -= count
        self.buffered += count
        ended = output.finish_reason is not None
        self.started = self.started or bool(count) or ended
        self.ended, self.worker_done = ended, ended and verdict == TAKEN
        if self.buffered > MAX_BUFFERED_TOKENS:
            self.ended = True
            self.replace(OVERFLOW)
            return OVERFLOWED
        self._append(output)
        return verdict

    def _append(self, output: Output) -> None:
        """Queue ``output``, merged into the Output before it when that one did not end the stream."""
        last = self.items[-1] if self.items else None
        if isinstance(last, Output) and last.finish_reason is None:
            wire.extend_logprobs(last, output)  # before the ids grow
            last.token_ids += output.token_ids
            last.finish_reason = output.finish_reason
            last.prompt_tokens = output.prompt_tokens or last.prompt_tokens
            last.completion_tokens = output.completion_tokens
            last.cached_tokens = output.cached_tokens or last.cached_tokens
        else:
            self.put(output)


class AnswerInbox(Inbox):
    """A call's reply: one ``Answer`` or ``ErrorReply``; anything after it, or an Output, is
    unsolicited."""

    __slots__ = ()

    def accept(self, reply: Reply) -> int:
        if self.ended or reply.__class__ is Output:
            return UNSOLICITED
        self.ended = self.started = self.worker_done = True
        self.put(reply)
        return TAKEN


class Progress:
    """One stream's progress timers: its first-token deadline and its stall checks (each re-armed
    in place), and the stream's token room at the last check."""

    __slots__ = ("first", "quiet_s", "room", "stall")

    def __init__(self, room: int) -> None:
        self.room = room
        self.quiet_s = 0.0
        self.first: asyncio.TimerHandle | None = None
        self.stall: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        for timer in (self.first, self.stall):
            if timer is not None:
                timer.cancel()


def failure_of(item: Item, endpoint: str) -> WorkerError | WorkerLost | SlowReader:
    """What a request raises for an item that is not its reply."""
    if isinstance(item, WorkerLost):
        return item
    if isinstance(item, ErrorReply):
        return WorkerError(item.code, item.message, endpoint=endpoint)
    if isinstance(item, Overflow):
        return SlowReader(endpoint)
    return WorkerError(504, "no reply by the deadline", endpoint=endpoint)


def _cut(output: Output, room: int) -> Output:
    """The last output ``max_tokens`` allows: a worker that streams past it is cut, as an engine
    would have stopped (``length``)."""
    dropped = len(output.token_ids) - room
    return msgspec.structs.replace(
        output,
        token_ids=output.token_ids[:room],
        logprobs=None if output.logprobs is None else output.logprobs[:room],
        finish_reason="length",
        completion_tokens=max(output.completion_tokens - dropped, 0),
    )
