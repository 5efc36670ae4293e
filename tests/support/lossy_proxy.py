"""A lossy discovery forwarder for fault tests: XSUB in, XPUB out, a seeded fraction of messages lost.

It sits where a broker would (workers connect their XPUB to ``xsub``) and delivers to a frontend's
embedded plane by *connecting* its XPUB to the frontend's bound SUB (``connect_xpub``), or lets
frontends connect to a bound ``xpub`` address. Subscriptions always travel upstream untouched (a
lost subscription is a different fault: the slow joiner); only discovery messages going downstream
are dropped, each with probability ``loss``, decided by ``random.Random(seed)`` in arrival order,
so a run is reproducible for a given message sequence.

The sockets are owned by one background thread that polls with a short timeout, so ``close()``
returns within a bounded time and the proxy never blocks a test.
"""

from __future__ import annotations

import contextlib
import random
import threading
from dataclasses import dataclass
from typing import Any

import zmq

__all__ = ["LossyProxy", "ProxyCounters"]

POLL_MS = 20
CLOSE_TIMEOUT_S = 5.0


@dataclass
class ProxyCounters:
    """What went through: downstream messages forwarded or dropped, subscriptions forwarded."""

    forwarded: int = 0
    dropped: int = 0
    subscriptions: int = 0

    @property
    def loss(self) -> float:
        """The observed drop fraction (0 before any message)."""
        total = self.forwarded + self.dropped
        return self.dropped / total if total else 0.0


class LossyProxy:
    """Forward discovery messages from ``xsub`` to the XPUB side, dropping a fraction ``loss``."""

    def __init__(
        self,
        *,
        xsub: str,
        xpub: str | None = None,
        connect_xpub: str | None = None,
        loss: float,
        seed: int = 0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        if (xpub is None) == (connect_xpub is None):
            raise ValueError("give exactly one of xpub (bind) or connect_xpub (connect)")
        self.loss = loss
        self.counters = ProxyCounters()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._context = context or zmq.Context.instance()
        self._xsub = self._context.socket(zmq.XSUB)
        self._xpub = self._context.socket(zmq.XPUB)
        for sock in (self._xsub, self._xpub):
            sock.setsockopt(zmq.LINGER, 0)
        self._xpub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription reaches the workers
        self._xsub.bind(xsub)
        if xpub is not None:
            self._xpub.bind(xpub)
        else:
            assert connect_xpub is not None
            self._xpub.connect(connect_xpub)
        self.xsub = self._xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-proxy", daemon=True)
        self._thread.start()

    def snapshot(self) -> ProxyCounters:
        with self._lock:
            return ProxyCounters(**vars(self.counters))

    def close(self) -> None:
        """Stop the thread (bounded) and close both sockets; idempotent."""
        self._stop.set()
        self._thread.join(CLOSE_TIMEOUT_S)

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xsub, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                if self._xsub in events:
                    self._downstream()
                if self._xpub in events:
                    self._upstream()
        finally:
            self._xsub.close(linger=0)
            self._xpub.close(linger=0)

    def _downstream(self) -> None:
        while True:
            try:
                frames = self._xsub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            dropped = self._random.random() < self.loss
            with self._lock:
                if dropped:
                    self.counters.dropped += 1
                else:
                    self.counters.forwarded += 1
            if not dropped:
                with contextlib.suppress(zmq.Again):  # at the high-water mark XPUB drops anyway
                    self._xpub.send_multipart(frames, zmq.NOBLOCK, copy=False)

    def _upstream(self) -> None:
        while True:
            try:
                frames = self._xpub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            with self._lock:
                self.counters.subscriptions += 1
            with contextlib.suppress(zmq.Again):
                self._xsub.send_multipart(frames, zmq.NOBLOCK, copy=False)
