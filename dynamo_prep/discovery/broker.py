"""The discovery broker: an XSUB/XPUB forwarder so several frontends share one plane.

Workers connect their XPUB to the broker's XSUB; frontends connect their SUB to the broker's
XPUB. Subscriptions travel upstream: the broker's XPUB has ``XPUB_VERBOSE`` on so that *every*
frontend's subscription (not only the first for a topic) reaches the XSUB and from there every
worker, which re-announces at once. A late frontend therefore converges without waiting a
heartbeat, and a restarted broker is refilled as soon as workers reconnect.

With CURVE, the XSUB side is the trust boundary: it authenticates workers against an allow-list.
The XPUB side is open (frontends behind a broker trust the broker).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog
import zmq

from dynamo_prep.discovery.trust import (
    AllowList,
    ServerCurve,
    TrustError,
    apply_server_curve,
    authenticated_key,
    start_authenticator,
)
from dynamo_prep.lifecycle import EXIT_FAILED, EXIT_OK, on_stop_signals
from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.discovery import OPEN_PLANE_HINT, reachable_from_elsewhere

__all__ = ["Broker", "run_broker"]

log = structlog.get_logger("dynamo_prep.discovery")

_dropped = RateLimiter()  # one line per revoked key per second
POLL_MS = 100  # bounds how long a stop request waits
BROKER_LINGER_MS = 200
# Dropping at the high-water mark is harmless (full-card heartbeats); a deep queue only adds delay.
FORWARD_HWM = 1000


class Broker:
    """Forwards announcements downstream and subscriptions upstream until ``stop()``."""

    def __init__(
        self,
        *,
        xsub: str,
        xpub: str,
        curve: ServerCurve | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._context: zmq.Context[Any] = context or zmq.Context()
        self._curve = curve
        self._stopping = False
        self._authenticator = None
        self._allow: AllowList | None = None
        if curve is not None:
            self._authenticator = start_authenticator(self._context, curve.allow_dir)
            self._allow = AllowList(curve.allow_dir, self._authenticator)
        self._xsub = self._context.socket(zmq.XSUB)
        self._xpub = self._context.socket(zmq.XPUB)
        try:
            self._configure(xsub, xpub)
        except zmq.ZMQError:
            self.close()
            raise
        self.xsub_endpoint = self._xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.xpub_endpoint = self._xpub.getsockopt_string(zmq.LAST_ENDPOINT)

    def _configure(self, xsub: str, xpub: str) -> None:
        for socket in (self._xsub, self._xpub):
            socket.setsockopt(zmq.LINGER, BROKER_LINGER_MS)
            socket.setsockopt(zmq.SNDHWM, FORWARD_HWM)
            socket.setsockopt(zmq.RCVHWM, FORWARD_HWM)
        self._xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if self._curve is not None:
            apply_server_curve(self._xsub, self._curve)
        self._xsub.bind(xsub)
        self._xpub.bind(xpub)

    def stop(self) -> None:
        """Ask ``run()`` to return (safe from a signal handler)."""
        self._stopping = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xsub, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        while not self._stopping:
            events = dict(poller.poll(POLL_MS))
            if self._xsub in events:
                _forward(self._xsub, self._xpub, self._allow)
            if self._xpub in events:
                _forward(self._xpub, self._xsub)
            self._follow_allow_list()

    def _follow_allow_list(self) -> None:
        """A key removed from the allow-list: its announcements are no longer forwarded."""
        removed = self._allow.poll() if self._allow is not None else frozenset()
        if removed and self._allow is not None:
            log.warning("curve_keys_revoked", keys=sorted(removed), allowed=len(self._allow.keys))

    def close(self) -> None:
        for socket in (self._xsub, self._xpub):
            socket.close(linger=BROKER_LINGER_MS)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def _forward(source: zmq.Socket[Any], sink: zmq.Socket[Any], allow: AllowList | None = None) -> None:
    """Move every pending multipart message; never block (XPUB drops at HWM, XSUB queues). With an
    allow-list, a message whose sender's key is no longer in it is dropped."""
    while True:
        try:
            frames = source.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        if allow is not None and not allow.allows(key := authenticated_key(frames[0])):
            suppressed = _dropped.allow(str(key), time.monotonic())
            if suppressed is not None:
                log.warning("broker_dropped_revoked", key=key, suppressed=suppressed)
            continue
        try:
            sink.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.debug("broker_dropped", frames=len(frames))


def run_broker(*, xsub: str, xpub: str, curve_secret_key: Path | None, curve_allow_dir: Path | None) -> int:
    """The ``dynamo-prep broker`` process; returns the exit code (0 after SIGTERM/SIGINT)."""
    try:
        curve = _server_curve(curve_secret_key, curve_allow_dir)
    except TrustError as exc:
        log.error("broker_start_failed", error=str(exc))
        return EXIT_FAILED
    context: zmq.Context[Any] = zmq.Context()
    try:
        try:
            broker = Broker(xsub=xsub, xpub=xpub, curve=curve, context=context)
        except (zmq.ZMQError, TrustError) as exc:
            log.error("broker_start_failed", xsub=xsub, xpub=xpub, error=str(exc))
            return EXIT_FAILED
        log.info(
            "broker_started", xsub=broker.xsub_endpoint, xpub=broker.xpub_endpoint, curve=curve is not None
        )
        if curve is None and reachable_from_elsewhere(broker.xsub_endpoint):
            log.error(
                "discovery_plane_open",
                addresses=[broker.xsub_endpoint],
                exposed=[broker.xsub_endpoint],
                hint=OPEN_PLANE_HINT,
            )
        try:
            with on_stop_signals(lambda _signum: broker.stop()):
                broker.run()
        finally:
            broker.close()
        log.info("broker_stopped")
        return EXIT_OK
    finally:
        context.term()


def _server_curve(secret_key: Path | None, allow_dir: Path | None) -> ServerCurve | None:
    if secret_key is None and allow_dir is None:
        return None
    if secret_key is None or allow_dir is None:
        raise TrustError("CURVE needs both --curve-secret-key and --curve-allow-dir")
    return ServerCurve.load(secret_key, allow_dir)
