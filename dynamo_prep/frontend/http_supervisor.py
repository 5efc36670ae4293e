"""``dynamo-prep frontend --http-workers N``: N whole frontend processes on one HTTP port, supervised.

Each child runs the complete frontend (``serve.py``: discovery watcher, KV subscriber when routing
by KV, HTTP) and binds the port with SO_REUSEPORT; the kernel spreads new connections over the
children. The parent starts no event loop and serves nothing:

* it reserves the port (a bound, never listening SO_REUSEPORT socket), so ``--http-port 0`` works
  and a restarted child gets the same port;
* on the embedded plane it runs the forwarder: N processes cannot bind one ZeroMQ address, so the
  parent binds the discovery address with an XSUB/XPUB broker (``discovery.broker``) and the
  children subscribe to its XPUB on a private ipc socket (subscriptions travel upstream, so a
  restarted child converges at once, like a late frontend behind a broker);
* metrics use prometheus_client's multiprocess mode (a private directory of per-process files):
  any child's ``/metrics`` sums counters and histograms over every process that ever served, the
  in-flight gauge over the live ones; other gauges are shown per live process (a ``pid`` label: a
  dead child's gauge files are deleted when it is reaped);
* it restarts a child that exits while nobody asked it to, forwards SIGTERM / SIGINT to the
  children and exits 0 when all have stopped. A child that exits with ``EXIT_CONFIG``, or dies
  within ``QUICK_EXIT_S`` of its start ``MAX_QUICK_EXITS`` times in a row, stops them all (exit 1).

Children die with their supervisor, however it ends (``kill -9`` included), so that none keeps
the port serving a stale view: Linux's parent-death signal (SIGTERM, a graceful stop), elsewhere a
thread that watches the parent's pid.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import structlog
import zmq
from prometheus_client import multiprocess

from dynamo_prep.discovery.broker import Broker
from dynamo_prep.frontend.config import FrontendConfig
from dynamo_prep.frontend.http_server import GRACE_S
from dynamo_prep.frontend.metrics import MULTIPROC_ENV
from dynamo_prep.frontend.serve import run_in_loop, serve_frontend
from dynamo_prep.lifecycle import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, on_stop_signals
from dynamo_prep.logging import configure_logging, logging_options

__all__ = ["MAX_QUICK_EXITS", "QUICK_EXIT_S", "run_workers"]

log = structlog.get_logger("dynamo_prep.frontend")

RESTART_DELAY_S = 0.5
QUICK_EXIT_S = 5.0
MAX_QUICK_EXITS = 5
POLL_S = 0.2
STOP_TIMEOUT_S = GRACE_S + 5.0
PARENT_POLL_S = 0.5  # the parent watch where there is no parent-death signal
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def run_workers(config: FrontendConfig) -> int:
    """Run ``config.http_workers`` frontend processes until SIGTERM / SIGINT; the exit code."""
    stopping: list[object] = []
    with (
        tempfile.TemporaryDirectory(prefix="dynamo-prep-frontend-") as private,
        on_stop_signals(stopping.append),
    ):
        try:
            reservation = _reserve(config.http_host, config.http_port)
        except OSError as exc:
            log.error("frontend_start_failed", error=str(exc), http=f"{config.http_host}:{config.http_port}")
            return EXIT_FAILED
        children_config = dataclasses.replace(config, http_port=reservation.getsockname()[1])
        forwarder: _Forwarder | None = None
        try:
            if config.bind:
                forwarder = _Forwarder(config.bind[0], f"ipc://{private}/discovery")
                children_config = dataclasses.replace(
                    children_config, bind=(), connect=(forwarder.broker.xpub_endpoint,)
                )
        except zmq.ZMQError as exc:
            reservation.close()
            log.error("frontend_start_failed", error=str(exc), discovery=list(config.bind))
            return EXIT_FAILED
        metrics_dir = Path(private) / "metrics"
        metrics_dir.mkdir()
        os.environ[MULTIPROC_ENV] = str(metrics_dir)  # read by each child as it imports prometheus_client
        try:
            return _Supervisor(children_config, metrics_dir).run(stopping)
        finally:
            if forwarder is not None:
                forwarder.close()
            reservation.close()


def _reserve(host: str, port: int) -> socket.socket:
    """Hold ``host:port`` for the children (bound with SO_REUSEPORT, never listening)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Forwarder:
    """The embedded plane's address, bound once for every child: a broker on a thread."""

    def __init__(self, bind: str, xpub: str) -> None:
        self.broker = Broker(xsub=bind, xpub=xpub)
        self._thread = threading.Thread(target=self.broker.run, name="discovery-forwarder", daemon=True)
        self._thread.start()
        log.info("discovery_forwarder_started", discovery=bind, children=xpub)

    def close(self) -> None:
        self.broker.stop()
        self._thread.join()
        self.broker.close()


class _Supervisor:
    def __init__(self, config: FrontendConfig, metrics_dir: Path) -> None:
        self.config = config
        self.metrics_dir = metrics_dir
        self._spawn = multiprocessing.get_context("spawn")
        self.children: dict[int, BaseProcess] = {}
        self._started_at: dict[int, float] = {}
        self._restart_at: dict[int, float] = {}
        self._quick_exits = 0

    def run(self, stopping: list[object]) -> int:
        for index in range(self.config.http_workers):
            self._start(index)
        log.info(
            "frontend_workers_started",
            http_workers=self.config.http_workers,
            http_port=self.config.http_port,
            pids=[child.pid for child in self.children.values()],
        )
        code = EXIT_OK
        while not stopping and code == EXIT_OK:
            sentinels = {child.sentinel: index for index, child in self.children.items()}
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=POLL_S):
                code = self._exited(sentinels[sentinel])  # type: ignore[index]
            now = time.monotonic()
            for index, due in list(self._restart_at.items()):
                if due <= now and not stopping:
                    del self._restart_at[index]
                    self._start(index)
        self._stop_all()
        log.info("frontend_workers_stopped", exit_code=code)
        return code

    def _start(self, index: int) -> None:
        child = self._spawn.Process(
            target=_child,
            args=(self.config, index, logging_options(), os.getpid()),
            name=f"frontend-http-{index}",
        )
        child.start()
        self.children[index] = child
        self._started_at[index] = time.monotonic()
        log.info("http_worker_started", http_worker=index, pid=child.pid)

    def _exited(self, index: int) -> int:
        """Reap a child that exited on its own; schedule its restart, or say why not."""
        child = self.children.pop(index)
        child.join()
        assert child.pid is not None
        _forget_metrics(child.pid, self.metrics_dir)
        quick = time.monotonic() - self._started_at[index] < QUICK_EXIT_S
        self._quick_exits = self._quick_exits + 1 if quick else 0
        log.warning("http_worker_exited", http_worker=index, pid=child.pid, exit_code=child.exitcode)
        if child.exitcode == EXIT_CONFIG or self._quick_exits >= MAX_QUICK_EXITS:
            log.error("http_workers_failing", http_worker=index, quick_exits=self._quick_exits)
            return EXIT_FAILED
        self._restart_at[index] = time.monotonic() + RESTART_DELAY_S
        return EXIT_OK

    def _stop_all(self) -> None:
        for child in self.children.values():
            if child.is_alive():
                child.terminate()  # SIGTERM: each child stops gracefully
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children.values():
            child.join(max(deadline - time.monotonic(), 0.0))
            if child.is_alive():
                log.warning("http_worker_killed", pid=child.pid)
                child.kill()
                child.join()


def _forget_metrics(pid: int, directory: Path) -> None:
    """A dead child's gauges leave ``/metrics``; its counters and histograms stay in the sums."""
    multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    for path in directory.glob(f"gauge_*_{pid}.db"):
        path.unlink(missing_ok=True)


def _child(config: FrontendConfig, index: int, logging: dict[str, Any], parent: int) -> None:
    """One HTTP worker process: the whole frontend on its own loop, for as long as ``parent`` lives."""
    _die_with(parent)
    configure_logging(**logging, http_worker=index)
    raise SystemExit(run_in_loop(serve_frontend(config)))


def _die_with(parent: int) -> None:
    """SIGTERM this process when ``parent`` ends, or end now if it already has."""
    if not _parent_death_signal(signal.SIGTERM):
        threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it ended before the signal was asked for
        raise SystemExit(EXIT_FAILED)


def _parent_death_signal(signum: int) -> bool:
    """Linux's prctl(PR_SET_PDEATHSIG): the kernel sends ``signum`` when the parent ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
