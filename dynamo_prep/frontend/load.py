"""What the frontend knows of each instance's load, and the requests waiting for room.

Two sources, combined (docs/request-plane.md, "Busy, hung and dead"):

* each instance's heartbeat reports its engine's load (``Load``: unfinished, waiting, how long its
  engine has had work without a step), at most a heartbeat old;
* this frontend counts its own requests on each instance as it sends and ends them, at once.

An instance's load now is this frontend's requests on it plus the others' at its last report (its
unfinished requests then, less this frontend's then). An instance whose card says ``max_num_seqs``
is **saturated** at that many: no new request is routed there. When every instance a request may
go to is saturated, it waits here, in arrival order, at most ``max_queued`` per model and
``queue_timeout_s`` each; then it is refused with 503 and ``Retry-After`` (``SaturatedError``).

An instance is **busy** (its requests keep their place past the first-token and stall deadlines)
while its last report says requests wait there and its engine made a step within
``BUSY_STEP_WINDOW_S``: a queue that moves is not a dead worker, and a stuck engine says so.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import structlog

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.frontend.config import (
    BUSY_STEP_WINDOW_S,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_QUEUE_TIMEOUT_S,
    RETRY_AFTER_S,
)
from dynamo_prep.frontend.errors import OpenAIError
from dynamo_prep.protocol.discovery import Instance, Load

__all__ = ["LoadBoard", "SaturatedError", "Ticket"]

log = structlog.get_logger("dynamo_prep.frontend")


class SaturatedError(OpenAIError):
    """Every instance the request may go to is saturated and it could not wait (the queue is full,
    or it waited its time): a 503 with ``Retry-After``."""

    def __init__(self, model: str, why: str) -> None:
        super().__init__(
            503,
            f"every instance of model {model!r} is saturated ({why}); retry later",
            retry_after_s=RETRY_AFTER_S,
        )


@dataclass(slots=True)
class _Report:
    load: Load
    own_then: int  # this frontend's requests on the instance when the report arrived


class Ticket:
    """A request's place in its model's queue (kept while it re-checks: it never loses its place)."""

    __slots__ = ("model", "waiter", "woken")

    def __init__(self, model: str) -> None:
        self.model = model
        self.woken = False  # something changed since the request last looked
        self.waiter: asyncio.Future[None] | None = None


class LoadBoard:
    """Instances' load (their reports and this frontend's own requests) and the models' queues.

    Told by the discovery watcher (``report``, and as an ``InstanceListener``) and by the
    migration loop (``acquire`` / ``release`` around each attempt, ``enqueue`` / ``wait`` /
    ``leave`` while no instance has room).
    """

    def __init__(
        self,
        *,
        max_queued: int = DEFAULT_MAX_QUEUED_REQUESTS,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
    ) -> None:
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self._reports: dict[str, _Report] = {}
        self._own: dict[str, int] = {}  # instance_id -> this frontend's requests on it now
        self._model_of: dict[str, str] = {}  # instance_id -> model
        self._by_endpoint: dict[str, str] = {}  # endpoint -> instance_id
        self._queues: dict[str, deque[Ticket]] = {}  # model -> waiting requests, oldest first

    # -- the discovery watcher's ------------------------------------------------------------------

    def report(self, instance_id: str, load: Load) -> None:
        """An instance's heartbeat said ``load``."""
        self._reports[instance_id] = _Report(load, self._own.get(instance_id, 0))
        model = self._model_of.get(instance_id)
        if model is not None:
            self._wake(model)

    def instance_added(self, card: ModelDeploymentCard, instance: Instance) -> None:
        self._model_of[instance.instance_id] = card.display_name
        self._by_endpoint[instance.endpoint] = instance.instance_id
        self._wake(card.display_name)

    def instance_removed(self, model: str, instance: Instance) -> None:
        self._reports.pop(instance.instance_id, None)
        self._model_of.pop(instance.instance_id, None)
        if self._by_endpoint.get(instance.endpoint) == instance.instance_id:
            del self._by_endpoint[instance.endpoint]
        self._wake(model)  # a request waiting for it may have nowhere left to go: it looks again

    # -- what routing asks ------------------------------------------------------------------------

    def load(self, instance_id: str) -> int:
        """Requests on the instance now: this frontend's, plus the others' at its last report."""
        own = self._own.get(instance_id, 0)
        report = self._reports.get(instance_id)
        others = 0 if report is None else max(report.load.unfinished - report.own_then, 0)
        return own + others

    def saturated(self, instance: Instance) -> bool:
        """Its card's ``max_num_seqs`` requests are on it (never, when its card does not say)."""
        capacity = instance.max_num_seqs
        return capacity is not None and self.load(instance.instance_id) >= capacity

    def busy(self, endpoint: str) -> bool:
        """Whether the instance at ``endpoint`` reports requests waiting and an engine that steps."""
        instance_id = self._by_endpoint.get(endpoint)
        report = self._reports.get(instance_id) if instance_id is not None else None
        if report is None:
            return False
        return report.load.waiting > 0 and report.load.stalled_ms < BUSY_STEP_WINDOW_S * 1000

    # -- the migration loop's ---------------------------------------------------------------------

    def acquire(self, instance_id: str) -> None:
        self._own[instance_id] = self._own.get(instance_id, 0) + 1

    def release(self, instance_id: str) -> None:
        left = self._own.get(instance_id, 0) - 1
        if left > 0:
            self._own[instance_id] = left
        else:
            self._own.pop(instance_id, None)
        model = self._model_of.get(instance_id)
        if model is not None:
            self._wake(model)

    def queued(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def enqueue(self, model: str) -> Ticket:
        """A place at the end of ``model``'s queue; ``SaturatedError`` when the queue is full."""
        queue = self._queues.setdefault(model, deque())
        if len(queue) >= self.max_queued:
            if not queue:
                del self._queues[model]
            log.info("request_refused_saturated", model=model, reason="queue_full", queued=len(queue))
            raise SaturatedError(model, f"{len(queue)} requests are waiting already")
        ticket = Ticket(model)
        queue.append(ticket)
        log.debug("request_queued", model=model, position=len(queue))
        return ticket

    async def wait(self, ticket: Ticket, deadline: float) -> None:
        """Until something changes on the model's instances (at once if it has since the request
        last looked: ``ticket.woken``); ``SaturatedError`` at ``deadline`` (loop time)."""
        if ticket.woken:
            ticket.woken = False
            return
        loop = asyncio.get_running_loop()
        ticket.waiter = loop.create_future()
        try:
            async with asyncio.timeout_at(deadline):
                await ticket.waiter
        except TimeoutError:
            log.info("request_refused_saturated", model=ticket.model, reason="queue_timeout")
            raise SaturatedError(ticket.model, "no room came up while the request waited") from None
        finally:
            ticket.waiter = None
        ticket.woken = False

    def leave(self, ticket: Ticket) -> None:
        queue = self._queues.get(ticket.model)
        if queue is None:
            return
        try:
            queue.remove(ticket)
        except ValueError:
            return
        if not queue:
            del self._queues[ticket.model]
        else:
            self._wake(ticket.model)  # the room it was waiting for may suit the next one

    def _wake(self, model: str) -> None:
        """Everyone waiting for ``model`` looks again, oldest first."""
        for ticket in self._queues.get(model, ()):
            ticket.woken = True
            if ticket.waiter is not None and not ticket.waiter.done():
                ticket.waiter.set_result(None)
