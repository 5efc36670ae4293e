"""``RequestPlaneClient``: requests to workers over one channel per endpoint, the timers that give
up on a silent stream, and which endpoints to route around (docs/request-plane.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar, cast

import structlog
import zmq
import zmq.asyncio
from prometheus_client import Counter

from dynamo_prep.frontend.client._allowance import Refusals
from dynamo_prep.frontend.client._channel import Channel
from dynamo_prep.frontend.client._errors import NoSocketLeft, WorkerError, WorkerLost
from dynamo_prep.frontend.client._inbox import (
    CUT,
    DEADLINE,
    AnswerInbox,
    Inbox,
    Progress,
    StreamInbox,
    failure_of,
)
from dynamo_prep.frontend.client._limits import (
    DEADLINE_GRACE_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_IDLE_CLOSE_S,
    DEFAULT_STALL_TIMEOUT_S,
    PROBES_PER_STALL,
    STALL_CHECKS,
    UNREACHABLE_HOLD_S,
)
from dynamo_prep.frontend.config import DEFAULT_FIRST_TOKEN_TIMEOUT_S, DEFAULT_STREAM_STALL_TIMEOUT_S
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.limits import is_exhausted
from dynamo_prep.logging import DETAIL_CHARS, RateLimiter
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.clock import now_ms
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Answer, Call, Generate, Output, Ping, Unary, WireDecodeError, merged

log = structlog.get_logger("dynamo_prep.frontend")

A = TypeVar("A")


class RequestPlaneClient:
    """Streams generations from workers, and makes non-streamed calls to them, over shared
    per-endpoint DEALER sockets."""

    def __init__(
        self,
        context: zmq.asyncio.Context | None = None,
        *,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        idle_close_s: float = DEFAULT_IDLE_CLOSE_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
        stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S,
        refused: Counter | None = None,
        metrics: FrontendMetrics | None = None,
        busy: Callable[[str], bool] | None = None,
    ) -> None:
        """``busy(endpoint)``: whether the worker there is busy rather than stuck (its heartbeat
        reports a queue and recent steps): its requests then keep their place past the first-token
        and stall deadlines (``LoadBoard.busy``)."""
        timeouts = (
            stall_timeout_s,
            idle_close_s,
            connect_timeout_s,
            first_token_timeout_s,
            stream_stall_timeout_s,
        )
        if min(timeouts) <= 0:
            raise ValueError(f"timeouts must be positive, got {', '.join(map(str, timeouts))}")
        shared = context or zmq.asyncio.Context.instance()
        self._sync: zmq.Context[Any] = zmq.Context.shadow(shared.underlying)  # plain sockets
        self.stall_timeout_s = stall_timeout_s
        self.idle_close_s = idle_close_s
        self.connect_timeout_s = connect_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.expired_grace_s = stall_timeout_s / PROBES_PER_STALL
        self._busy = busy or (lambda _endpoint: False)
        self._channels: dict[str, Channel] = {}
        self._unreachable: dict[str, float] = {}  # endpoint -> until (loop time)
        self._held: dict[str, float] = {}  # given up on (flooding, garbage, no first token) -> until
        self._refused = refused  # requests refused for want of a socket
        self._refusal_log = RateLimiter()
        self.refusals = Refusals(metrics)  # what was refused of the workers' replies

    async def generate(
        self, endpoint: str, request: PreprocessedRequest, *, request_id: str, timeout_s: float
    ) -> AsyncGenerator[Output, None]:
        """Yield the worker's Outputs up to the one with ``finish_reason``.

        Raises ``WorkerError`` on an ErrorReply (or 504 if even the deadline reply never comes),
        ``WorkerLost`` if the worker is lost. Stopping early (``aclose``, cancellation) sends Cancel.
        """
        channel = self._channel(endpoint)
        loop = asyncio.get_running_loop()
        inbox = channel.open(request_id, StreamInbox(loop, request.stop_conditions.max_tokens))
        deadline = loop.call_at(loop.time() + timeout_s + DEADLINE_GRACE_S, inbox.put, DEADLINE)
        progress = Progress(inbox.room)
        progress.first = loop.call_later(
            self.first_token_timeout_s, self._no_first_token, channel, request_id, inbox, progress
        )
        progress.stall = loop.call_later(
            self._stall_check_s, self._check_stall, channel, request_id, inbox, progress
        )
        try:
            deadline_ms = now_ms() + int(timeout_s * 1000)
            await channel.send(Generate(request_id=request_id, request=request, deadline_ms=deadline_ms))
            finished = False
            while not finished:
                outputs: list[Output] = []
                failure: Exception | None = None
                for item in await inbox.take():
                    if not isinstance(item, Output):
                        failure = failure_of(item, endpoint)
                        break
                    outputs.append(item)
                    finished = item.finish_reason is not None
                    if finished:
                        break
                if outputs:
                    yield merged(outputs)  # tokens that arrived before a failure still count (migration)
                if failure is not None:
                    raise failure
        finally:
            deadline.cancel()
            progress.cancel()
            channel.finish(request_id)
            if not inbox.worker_done and not inbox.cancel_sent:  # the client left, a stop string, ...
                channel.cancel(request_id, inbox)
                log.debug("request_cancel_sent", request_id=request_id, endpoint=endpoint)

    async def call(self, endpoint: str, request: Unary[A], *, request_id: str, timeout_s: float) -> A:
        """Send a non-streamed request (a ``Unary`` kind) and return its answer.

        Raises ``WorkerError`` on an ErrorReply (504 if not even the deadline reply comes; 500 if
        the answer is not the kind's), ``WorkerLost`` if the worker is lost. Leaving early
        (cancellation) sends Cancel.
        """
        channel = self._channel(endpoint)
        loop = asyncio.get_running_loop()
        inbox = channel.open(request_id, AnswerInbox(loop))
        deadline = loop.call_at(loop.time() + timeout_s + DEADLINE_GRACE_S, inbox.put, DEADLINE)
        try:
            deadline_ms = now_ms() + int(timeout_s * 1000)
            body = wire.encode_body(request)
            await channel.send(
                Call(request_id=request_id, method=request.method, body=body, deadline_ms=deadline_ms)
            )
            item = (await inbox.take())[0]
            if not isinstance(item, Answer):
                raise failure_of(item, endpoint)
            return self._answer(item, cast("type[A]", type(request).answer), endpoint)
        finally:
            deadline.cancel()
            channel.finish(request_id)
            if not inbox.worker_done and not inbox.cancel_sent:  # the caller left
                channel.cancel(request_id, inbox)
                log.debug("request_cancel_sent", request_id=request_id, endpoint=endpoint)

    def _answer(self, answer: Answer, kind: type[A], endpoint: str) -> A:
        """An Answer's body as its kind's answer; a 500 (counted as refused) when it is not one."""
        try:
            return wire.decode_body(answer.body, kind)
        except WireDecodeError as exc:
            self.refusals.replies(exc.reason, 1)
            message = f"the answer is not a {kind.__name__}: {exc.detail[:DETAIL_CHARS]}"
            raise WorkerError(500, message, endpoint=endpoint) from None

    def endpoint_expired(self, endpoint: str) -> None:
        """The instance at ``endpoint`` expired (its heartbeats stopped reaching us). A channel that
        still delivers (it spoke within ``expired_grace_s``) keeps its streams until it falls silent
        for that long, or they end; no new request goes there (it left the catalog). Else every
        request on it fails now, as with ``endpoint_lost``."""
        channel = self._channels.get(endpoint)
        if channel is None:
            return
        silent_s = channel.silent_s()
        if not channel.queues or silent_s >= self.expired_grace_s:
            self._lose(endpoint, "removed")
            return
        channel.expired = True
        channel.send_nowait(Ping(request_id="expired"))
        log.info(
            "worker_expired_delivering",
            endpoint=endpoint,
            in_flight=len(channel.queues),
            silent_s=round(silent_s, 3),
            grace_s=self.expired_grace_s,
        )

    def endpoint_lost(self, endpoint: str) -> None:
        """Fail every in-flight request to ``endpoint`` with ``WorkerLost`` now and close its socket.

        Call it when an instance expires (died), not on a withdraw: a withdrawn worker is draining
        and its in-flight streams still finish.
        """
        self._lose(endpoint, "removed")

    async def answers(self, endpoint: str, timeout_s: float) -> bool:
        """Whether ``endpoint`` answers (a Ping, or anything) within ``timeout_s``: a live worker
        does in milliseconds, a forged or black-holed announce never does. The channel stays open
        for requests and closes when idle, as any."""
        channel = self._channel(endpoint)
        if not channel.heard:
            channel.send_nowait(Ping(request_id="probe"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(channel.first_heard.wait(), timeout_s)
        return channel.heard

    def unreachable_endpoints(self) -> frozenset[str]:
        """Endpoints to route around while there is elsewhere: they never answered a recent
        request, or were given up on recently (flooding, garbage, no first token in time)."""
        if not self._unreachable and not self._held:
            return frozenset()
        now = asyncio.get_running_loop().time()
        for endpoint, until in list(self._unreachable.items()):
            channel = self._channels.get(endpoint)
            if until <= now or (channel is not None and channel.heard):  # it answered after all
                del self._unreachable[endpoint]
        for endpoint, until in list(self._held.items()):
            if until <= now:
                del self._held[endpoint]
        return frozenset(self._unreachable).union(self._held)

    @property
    def endpoints(self) -> list[str]:
        """The endpoints with an open channel (socket and tasks) right now."""
        return sorted(self._channels)

    async def close(self) -> None:
        for endpoint in list(self._channels):
            self._lose(endpoint, "client closed")
        await asyncio.sleep(0)  # let the cancelled channel tasks unwind

    def _lose(self, endpoint: str, reason: str) -> None:
        channel = self._channels.pop(endpoint, None)
        if channel is None:
            return
        if reason == "unreachable":
            self._unreachable[endpoint] = asyncio.get_running_loop().time() + UNREACHABLE_HOLD_S
        log.info("worker_lost", endpoint=endpoint, reason=reason, in_flight=len(channel.queues))
        channel.fail_all(WorkerLost(endpoint, reason))
        channel.close()

    def _close_idle(self, endpoint: str) -> None:
        channel = self._channels.get(endpoint)
        if channel is None or channel.queues:  # never close under a request (none can race: no await)
            return
        del self._channels[endpoint]
        log.debug("request_plane_channel_closed", endpoint=endpoint, reason="idle")
        channel.close()

    def _channel(self, endpoint: str) -> Channel:
        channel = self._channels.get(endpoint)
        if channel is not None:
            return channel
        try:
            socket: zmq.Socket[bytes] = self._sync.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            if not is_exhausted(exc):
                raise
            self._no_socket(endpoint, exc)
            raise NoSocketLeft(endpoint) from None
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY_BYTES)  # larger: libzmq drops the connection
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:  # no ZeroMQ address ("nonsense://x"): nothing will ever answer
            socket.close(linger=0)
            raise self._bad_address(endpoint, exc) from None
        channel = Channel(endpoint, socket, self, self._drop)
        channel.tasks = [
            asyncio.create_task(
                channel.watch(self._lose, self._close_idle), name=f"request-plane-watch-{endpoint}"
            ),
        ]
        self._channels[endpoint] = channel
        return channel

    def _bad_address(self, endpoint: str, exc: zmq.ZMQError) -> WorkerLost:
        """An endpoint libzmq cannot connect to is unreachable at once (its requests move for free)
        and kept out of routing like one that never answered; its log line at most once a second."""
        now = asyncio.get_running_loop().time()
        self._unreachable[endpoint] = now + UNREACHABLE_HOLD_S
        if self._refusal_log.allow("bad_address", now) is not None:
            log.warning("worker_unreachable", endpoint=endpoint[:200], waited_s=0.0, error=str(exc))
        return WorkerLost(endpoint, "unreachable")

    def _no_socket(self, endpoint: str, exc: zmq.ZMQError) -> None:
        """Count a request refused at the socket limit; its log line at most once a second."""
        if self._refused is not None:
            self._refused.inc()
        suppressed = self._refusal_log.allow("socket_limit", asyncio.get_running_loop().time())
        if suppressed is not None:
            log.warning(
                "request_plane_refused",
                endpoint=endpoint,
                reason="socket_limit",
                error=str(exc),
                channels=len(self._channels),
                suppressed=suppressed,
            )

    # -- a worker's hostile replies (docs/operations.md, "Worker replies") ---------------------

    def stream_stopped(self, channel: Channel, request_id: str, inbox: Inbox, verdict: int) -> None:
        """The frontend ended a stream the worker still writes: cut at ``max_tokens``, or its
        client reads too slowly (``MAX_BUFFERED_TOKENS`` unread). The worker is told to stop."""
        channel.cancel(request_id, inbox)
        if verdict == CUT:
            self.refusals.replies("past_max_tokens", 1)
            return
        self.refusals.slow_reader(request_id=request_id, endpoint=channel.endpoint)

    def _no_first_token(
        self, channel: Channel, request_id: str, inbox: StreamInbox, progress: Progress
    ) -> None:
        """No token ``first_token_timeout_s`` after the request was sent: it fails over like a
        lost worker, the worker is told to stop and is routed around for a while; unless the
        worker is busy (its queue keeps the request's place: the deadline starts again)."""
        if inbox.started or inbox.ended or channel.closed:
            return
        if self._busy(channel.endpoint):
            progress.first = asyncio.get_running_loop().call_later(
                self.first_token_timeout_s, self._no_first_token, channel, request_id, inbox, progress
            )
            log.debug(
                "worker_busy_kept", request_id=request_id, endpoint=channel.endpoint, phase="first_token"
            )
            return
        self._give_up(channel, request_id, inbox, "no_first_token", waited_s=self.first_token_timeout_s)

    @property
    def _stall_check_s(self) -> float:
        return self.stream_stall_timeout_s / STALL_CHECKS

    def _check_stall(self, channel: Channel, request_id: str, inbox: StreamInbox, progress: Progress) -> None:
        """Every ``stream_stall_timeout_s / STALL_CHECKS``: a stream that got no token over the
        last ``stream_stall_timeout_s`` moves on like one without a first token (its worker is
        routed around), unless the worker is busy. A token costs nothing here: the timer compares
        the stream's token count with the last check's."""
        if inbox.ended or channel.closed:
            return
        if inbox.room != progress.room or not inbox.started:  # the first-token deadline rules until then
            progress.room, progress.quiet_s = inbox.room, 0.0
        else:
            progress.quiet_s += self._stall_check_s
        if progress.quiet_s >= self.stream_stall_timeout_s * (1 - 1e-9):
            if not self._busy(channel.endpoint):
                self._give_up(channel, request_id, inbox, "stalled_stream", waited_s=progress.quiet_s)
                return
            progress.quiet_s = 0.0
            log.debug("worker_busy_kept", request_id=request_id, endpoint=channel.endpoint, phase="stream")
        progress.stall = asyncio.get_running_loop().call_later(
            self._stall_check_s, self._check_stall, channel, request_id, inbox, progress
        )

    def _give_up(
        self, channel: Channel, request_id: str, inbox: Inbox, reason: str, *, waited_s: float
    ) -> None:
        """The stream fails over (``WorkerLost(reason)``), its worker told to stop and routed around."""
        inbox.ended = True
        inbox.replace(WorkerLost(channel.endpoint, reason))
        channel.cancel(request_id, inbox)
        self._hold(channel.endpoint)
        event = "worker_no_first_token" if reason == "no_first_token" else "worker_stream_stalled"
        self.refusals.fault(
            reason, event, request_id=request_id, endpoint=channel.endpoint, waited_s=waited_s
        )

    def _drop(self, endpoint: str, reason: str) -> None:
        """A flooding worker (replies nobody asked for, or garbage): its channel is closed and its
        requests fail over, as for a dead worker; it is routed around for a while."""
        channel = self._channels.get(endpoint)
        in_flight = len(channel.queues) if channel is not None else 0
        self._hold(endpoint)
        self.refusals.fault(reason, "worker_dropped", endpoint=endpoint, in_flight=in_flight)
        self._lose(endpoint, reason)

    def _hold(self, endpoint: str) -> None:
        self._held[endpoint] = asyncio.get_running_loop().time() + UNREACHABLE_HOLD_S
