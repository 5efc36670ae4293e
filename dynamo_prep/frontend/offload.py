"""Where a request's CPU work runs: on the event loop while it is short, else in a thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from dynamo_prep.formatter.jinja import RenderSliceSpent, sliced

__all__ = ["LOOP_SLICE_S", "off_loop_if_slow"]

# A render on the event loop may run this long (ordinary templates take well under 1 ms); a slower
# one (a hostile chat template: up to its 2 s deadline) stops and starts again in a thread.
LOOP_SLICE_S = 0.01
_T = TypeVar("_T")


async def off_loop_if_slow(work: Callable[[], _T], *, in_thread: bool) -> _T:
    """``work()`` in a thread when ``in_thread`` (work known to be long: a large body), else on the
    loop; a chat template render in ``work`` that runs past ``LOOP_SLICE_S`` abandons it there and
    it runs again, whole, in a thread, with the template's full budget. ``work`` must be safe to
    run twice (rendering and tokenizing are pure)."""
    if not in_thread:
        try:
            with sliced(LOOP_SLICE_S):
                return work()
        except RenderSliceSpent:
            pass  # outside ``sliced``: the thread's copy of the context has no slice
    return await asyncio.to_thread(work)
