"""How every dynamo-prep process ends: its exit codes, and the signals that stop it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_OK",
    "STOP_SIGNALS",
    "new_event_loop",
    "on_stop_signals",
    "on_stop_signals_in_loop",
]

EXIT_OK = 0  # finished, or stopped by SIGTERM / SIGINT
EXIT_FAILED = 1  # could not start, or a part of it failed while running
EXIT_CONFIG = 2  # its options are wrong: restarting cannot help (systemd RestartPreventExitStatus=2)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

OnStop = Callable[[signal.Signals], None]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A serving process's event loop: uvloop (libuv), cheaper per I/O event than asyncio's own
    (the frontend's and the worker's; ``vllm serve`` runs on it too)."""
    import uvloop  # noqa: PLC0415 - only where a process serves

    return uvloop.new_event_loop()


@contextlib.contextmanager
def on_stop_signals(callback: OnStop) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT call ``callback`` (a synchronous process's handlers);
    the previous handlers come back on the way out."""

    def handler(signum: int, frame: FrameType | None) -> None:
        del frame  # the signal module's handler signature
        callback(signal.Signals(signum))

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def on_stop_signals_in_loop(callback: OnStop) -> Iterator[None]:
    """The same on the running asyncio loop. Outside the main thread signals cannot be handled:
    nothing is installed, and whoever runs the loop there stops it its own way."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for signum in STOP_SIGNALS:
        try:
            loop.add_signal_handler(signum, callback, signum)
        except (RuntimeError, ValueError):  # not the main thread
            break
        installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
