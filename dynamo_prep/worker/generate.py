"""Generation on the worker's request plane: Generate, Cancel and Ping, plus the graceful drain.

Each Generate runs in its own task (handlers run inline in the ROUTER's receive loop, so a long
stream must not block it) and is tracked by ``request_id`` until its final message, so Cancel
can find it and a stopping worker can drain it. Every engine step goes out as its own Output, at
once: the worker never holds a step back to fill a frame. Steps merge only when the stream falls
behind: while a send waits for room (the frontend reads slower than the engine writes) the
stream's task waits, and the engine merges the steps its consumer has not taken yet (vLLM's output
collector does; the mock engine simply waits). An engine's own ``--stream-interval`` (vLLM's,
SGLang's) sends fewer, fuller steps.

Every request ends with exactly one final message: an ``Output`` with ``finish_reason`` ("stop",
"length", "cancelled", "deadline") or an ``ErrorReply``. The one exception is a request cancelled
for an unknown reason (the event loop is going away): nothing more can be sent then.

The server keeps its engine's load in plain counters (``load()``, read by the heartbeat thread):
requests in flight, those without a step yet, and when the engine last made a step while it had
work (``stalled_s``, what the worker's watchdog reads).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import structlog
import zmq

from dynamo_prep.engines.base import CheckFn, EngineContractError, EngineError, GenerateFn
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.clock import now_ms
from dynamo_prep.protocol.discovery import Load
from dynamo_prep.protocol.wire import Cancel, ErrorReply, Generate, Output, Ping, Pong

__all__ = ["GenerationServer", "Reply"]

log = structlog.get_logger("dynamo_prep.worker")

Reply = Callable[[wire.FromWorker], Awaitable[None]]
"""Sends one message to the peer that made the request (bound by the request-plane dispatcher)."""
_StopReason = Literal["cancelled", "shutdown"]


@dataclass
class _Running:
    """One in-flight generation; ``stop_reason`` tells the task why it was cancelled."""

    task: asyncio.Task[None]
    stop_reason: _StopReason | None = None
    stepped: bool = False  # the engine made a step for it (else it is waiting)


@dataclass
class _Progress:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


class GenerationServer:
    """Serves Generate / Cancel / Ping for one engine and drains it on shutdown.

    ``generate`` streams an engine's outputs; ``check`` (optional) validates a request against the
    engine's prompt contract before a task is spawned, raising ``EngineContractError``.
    """

    def __init__(self, generate: GenerateFn, *, check: CheckFn | None = None) -> None:
        self._generate = generate
        self._check = check
        self._running: dict[str, _Running] = {}
        self._sends: set[asyncio.Future[None]] = set()
        self.draining = False
        self._waiting = 0  # requests in flight without a step yet
        self._progress_at = time.monotonic()  # the last step, or when work arrived at an idle engine

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def stalled_s(self) -> float:
        """How long the engine has had work without making a step (0: it has nothing to do)."""
        return time.monotonic() - self._progress_at if self._running else 0.0

    def load(self) -> Load:
        """What the heartbeat says (safe from another thread: it only reads plain counters)."""
        return Load(
            unfinished=len(self._running),
            waiting=max(self._waiting, 0),
            stalled_ms=int(self.stalled_s() * 1000),
        )

    async def drain(self, timeout_s: float) -> int:
        """Refuse new work, let in-flight requests finish for ``timeout_s``, cancel the rest.

        Returns how many requests had to be cancelled (each gets a 503: retryable elsewhere).
        """
        self.draining = True
        tasks = [running.task for running in self._running.values()]
        log.info("worker_draining", in_flight=len(tasks), timeout_s=timeout_s)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        leftover = list(self._running.values())
        for running in leftover:
            running.stop_reason = "shutdown"
            running.task.cancel()
        await asyncio.gather(*(running.task for running in leftover), return_exceptions=True)
        await asyncio.gather(*self._sends, return_exceptions=True)
        if leftover:
            log.warning("worker_drain_timeout", cancelled=len(leftover), timeout_s=timeout_s)
        return len(leftover)

    async def on_generate(self, message: Generate, reply: Reply) -> None:
        """Start a generation task, unless the request must be refused (503/400/504)."""
        refusal = self._refusal(message)
        if refusal is not None:
            await reply(refusal)
            return
        task = asyncio.create_task(self._run(message, reply), name=f"generate-{message.request_id}")
        running = _Running(task)
        if not self._running:
            self._progress_at = time.monotonic()  # an idle engine's clock starts with its work
        self._running[message.request_id] = running
        self._waiting += 1
        task.add_done_callback(lambda _: self._answer_unstarted(message, reply, running))

    def _answer_unstarted(self, message: Generate, reply: Reply, running: _Running) -> None:
        """A task cancelled before its first step never ran ``_run``: send its final message here."""
        request_id = message.request_id
        if not running.task.cancelled() or self._running.get(request_id) is not running:
            return
        progress = _Progress(prompt_tokens=len(message.request.token_ids))
        final = self._cancelled(request_id, progress)
        self._forget(request_id)
        if final is not None:
            sending = asyncio.ensure_future(_send_quietly(reply, final))
            self._sends.add(sending)
            sending.add_done_callback(self._sends.discard)

    def _refusal(self, message: Generate) -> ErrorReply | None:
        """The ErrorReply for a Generate that must not start, or None."""
        request_id = message.request_id
        if self.draining:
            return ErrorReply(request_id=request_id, code=503, message="worker is draining")
        if request_id in self._running:
            return ErrorReply(request_id=request_id, code=400, message="duplicate request_id")
        if message.deadline_ms <= now_ms():
            return ErrorReply(
                request_id=request_id, code=504, message="deadline passed before the request started"
            )
        if self._check is not None:
            try:
                self._check(message.request)
            except EngineContractError as exc:
                return ErrorReply(request_id=request_id, code=400, message=str(exc))
        return None

    async def on_cancel(self, message: Cancel, _reply: Reply) -> None:
        """Cancel a running generation; its task sends the final "cancelled" Output (not ``_reply``)."""
        running = self._running.get(message.request_id)
        if running is None:
            log.debug("cancel_unknown_request", request_id=message.request_id)
            return
        running.stop_reason = "cancelled"
        running.task.cancel()

    async def on_ping(self, message: Ping, reply: Reply) -> None:
        await reply(Pong(request_id=message.request_id))

    async def _run(self, message: Generate, reply: Reply) -> None:
        request_id = message.request_id
        progress = _Progress(prompt_tokens=len(message.request.token_ids))
        log.debug("request_started", request_id=request_id, prompt_tokens=progress.prompt_tokens)
        final: Output | ErrorReply | None
        try:
            final = await self._stream(message, reply, progress)
        except asyncio.CancelledError:
            final = self._cancelled(request_id, progress)
            if final is None:
                raise
        except EngineError as exc:
            final = ErrorReply(request_id=request_id, code=exc.code, message=str(exc))
        except Exception as exc:
            log.exception("request_failed", request_id=request_id)
            final = ErrorReply(request_id=request_id, code=500, message=type(exc).__name__)
        finally:
            self._forget(request_id)
        progress.finish_reason = final.finish_reason if isinstance(final, Output) else f"error_{final.code}"
        await _send_quietly(reply, final)
        log.debug(
            "request_finished",
            request_id=request_id,
            finish_reason=progress.finish_reason,
            prompt_tokens=progress.prompt_tokens,
            completion_tokens=progress.completion_tokens,
        )

    def _forget(self, request_id: str) -> None:
        running = self._running.pop(request_id, None)
        if running is not None and not running.stepped:
            running.stepped = True
            self._waiting -= 1

    def _stepped(self, running: _Running | None) -> None:
        """The engine made a step (for ``running``, when still tracked)."""
        self._progress_at = time.monotonic()
        if running is not None and not running.stepped:
            running.stepped = True
            self._waiting -= 1

    async def _stream(self, message: Generate, reply: Reply, progress: _Progress) -> Output:
        """Send every engine output but the last, each as it comes; return the final one (or the
        deadline's). A send that waits for room holds the stream (the engine merges meanwhile)."""
        steps = self._generate(message.request)
        running = self._running.get(message.request_id)
        request_id = message.request_id
        try:
            async with asyncio.timeout(message.deadline_ms / 1000 - time.time()) as scope:
                async for step in steps:
                    self._stepped(running)
                    progress.prompt_tokens = step.prompt_tokens or progress.prompt_tokens
                    progress.completion_tokens = step.completion_tokens
                    progress.cached_tokens = step.cached_tokens
                    output = Output(
                        request_id=request_id,
                        token_ids=step.token_ids,
                        finish_reason=step.finish_reason,
                        prompt_tokens=progress.prompt_tokens,
                        completion_tokens=progress.completion_tokens,
                        cached_tokens=progress.cached_tokens,
                        logprobs=step.logprobs,
                    )
                    if step.finish_reason is not None:
                        return output
                    await reply(output)
        except TimeoutError:
            if not scope.expired():
                raise
            return self._output(request_id, [], "deadline", progress)
        finally:
            if isinstance(steps, AsyncGenerator):
                await steps.aclose()
        # An engine that ends without a reason: the stream still needs its final message.
        return self._output(request_id, [], "stop", progress)

    def _cancelled(self, request_id: str, progress: _Progress) -> Output | ErrorReply | None:
        running = self._running.get(request_id)
        reason = running.stop_reason if running is not None else None
        if reason == "cancelled":
            return self._output(request_id, [], "cancelled", progress)
        if reason == "shutdown":
            return ErrorReply(
                request_id=request_id, code=503, message="worker stopped before the request finished"
            )
        return None

    @staticmethod
    def _output(request_id: str, token_ids: list[int], finish: str | None, progress: _Progress) -> Output:
        return Output(
            request_id=request_id,
            token_ids=token_ids,
            finish_reason=finish,
            prompt_tokens=progress.prompt_tokens,
            completion_tokens=progress.completion_tokens,
            cached_tokens=progress.cached_tokens,
        )


async def _send_quietly(reply: Reply, message: wire.FromWorker) -> None:
    """A final message to a closed request plane is dropped: the worker is stopping anyway."""
    try:
        await reply(message)
    except zmq.ZMQError as exc:
        log.debug("reply_dropped", request_id=message.request_id, error=str(exc))
