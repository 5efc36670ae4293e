"""Work in threads beside the event loop: every dynamo-prep process runs its loop on the main thread."""

from __future__ import annotations

import threading
import time

__all__ = ["hand_over_gil", "off_loop_thread"]


def off_loop_thread() -> bool:
    """Running in a thread other than the event loop's (a render or an automaton built off the loop)."""
    return threading.current_thread() is not threading.main_thread()


def hand_over_gil() -> None:
    """Let a thread waiting for the GIL (the event loop) take it now, not after the switch interval."""
    time.sleep(0)
