"""``LoopWatch``: a loop held past the threshold is noticed, with the loop thread's own share of it."""

from __future__ import annotations

import asyncio
import time

from dynamo_prep.loopwatch import LoopWatch, Stall


def _spin(seconds: float) -> None:
    """Hold the loop on the CPU (a slow callback of our own)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


async def test_a_loop_held_by_its_own_callback_is_a_stall_it_ran_for() -> None:
    seen: list[Stall] = []
    watch = LoopWatch(threshold_s=0.1, interval_s=0.01, on_stall=seen.append)
    watch.start()
    try:
        asyncio.get_running_loop().call_soon(_spin, 0.4)
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the loop turns while the watch looks (not a synchronisation)
    finally:
        watch.stop()
    assert seen, "the stall was not noticed"
    stall = seen[0]
    assert stall.stalled_s > 0.1
    assert watch.stalls >= 1 and watch.longest_s >= stall.stalled_s
    assert stall.ran_s is not None and stall.waited_s is not None  # Linux says (schedstat)
    assert stall.ran_s > 0 and stall.cause in ("loop", "host")  # it spun: on a CPU, or waiting for one


async def test_a_loop_that_keeps_turning_has_no_stall() -> None:
    watch = LoopWatch(threshold_s=5.0, interval_s=0.01)
    watch.start()
    try:
        for _ in range(20):
            await asyncio.sleep(0.005)
    finally:
        watch.stop()
    assert watch.stalls == 0


def test_a_stall_the_thread_neither_ran_nor_waited_for_is_a_stopped_process() -> None:
    assert Stall(1.0, 0.01, 0.02).cause == "stopped"
    assert Stall(1.0, 0.9, 0.05).cause == "loop"
    assert Stall(1.0, 0.1, 0.8).cause == "host"
    assert Stall(1.0, None, None).cause == "unknown"
