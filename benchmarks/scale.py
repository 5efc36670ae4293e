"""Scale: thousands of simulated worker instances on ONE frontend process at a 1 s heartbeat.

``python -m benchmarks.scale [--sizes 1000,5000] [--publishers 4] [--window 10]``

Each size runs two scenarios against a real ``dynamo-prep frontend`` (embedded plane, loopback),
with the instances simulated by ``--publishers`` processes (``benchmarks._plane publish``), each
announcing its share of instances of one model card, heartbeat 1 s, ttl 3 s:

* restart: the fleet is up first and the frontend starts (a frontend restart or a late joiner):
  every publisher re-announces all its instances on the new subscription. Convergence =
  ``frontend_started`` -> the last of N ``instance_added`` (and ``model_added``), all from the
  frontend's own log clock. Then the frontend's CPU (``/proc/<pid>/stat`` utime + stime) over a
  steady ``--window``, the messages dropped at the high-water mark (the publishers set
  ``XPUB_NODROP`` and count ``EAGAIN``), and instances that flapped (expired) in the window.
* join: the model is already built (a seed instance) and the N instances announce for the first
  time (workers scaled up at once). Convergence = the first announce sent -> the last
  ``instance_added`` (wall clocks of one machine).

Targets (1,000 instances): convergence < 2 s, CPU < 25% of one core.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._plane import (
    DynamoProcess,
    cpu_seconds,
    iso_to_epoch,
    reap,
    start_frontend,
    start_publisher,
    tcp_endpoint,
    wait_for,
)
from benchmarks._report import Suite

CONVERGENCE_TARGET_S = 2.0
CPU_TARGET = 0.25
TARGET_SIZE = 1000
SETTLE_S = 2.0


@dataclass
class Outcome:
    """What one scenario measured (None: not reached within the bound)."""

    size: int
    convergence_s: float | None = None
    live: int = 0
    cpu: float | None = None
    dropped: int = 0
    sent: int = 0
    flaps: int = 0
    rejected: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def stamps(proc: DynamoProcess, event: str) -> list[float]:
    return [iso_to_epoch(e["timestamp"]) for e in proc.find(event)]


def start_fleet(address: str, size: int, publishers: int, *, prefix: str, trace: bool) -> list[DynamoProcess]:
    """``publishers`` processes sharing ``size`` instances; returns once all are connected."""
    shares = [size // publishers + (1 if i < size % publishers else 0) for i in range(publishers)]
    fleet = [
        start_publisher(address, instances=share, prefix=f"{prefix}{i}", trace=trace)
        for i, share in enumerate(shares)
    ]
    for proc in fleet:
        proc.wait_event("publisher_ready", timeout=30)
    return fleet


def converge(frontend: DynamoProcess, size: int, bound_s: float) -> int:
    """Wait until ``size`` instances were added and the model is built, or the bound; the live count."""

    def done() -> bool:
        return len(frontend.find("instance_added")) >= size and bool(frontend.find("model_added"))

    with contextlib.suppress(AssertionError):  # not converged within the bound: report how far it got
        wait_for(done, bound_s, interval=0.05)
    return len(frontend.find("instance_added"))


def publisher_totals(fleet: list[DynamoProcess]) -> tuple[int, int]:
    """(sent, dropped) summed over the fleet's latest stats lines."""
    sent = dropped = 0
    for proc in fleet:
        stats = proc.find("publisher_stats")
        if stats:
            sent += stats[-1]["sent"]
            dropped += stats[-1]["dropped"]
    return sent, dropped


def steady_window(frontend: DynamoProcess, fleet: list[DynamoProcess], window_s: float) -> dict[str, Any]:
    """Frontend CPU share, drops and flaps over ``window_s`` of steady heartbeats."""
    time.sleep(SETTLE_S)
    removed_before = len(frontend.find("instance_removed"))
    sent0, dropped0 = publisher_totals(fleet)
    cpu0, wall0 = cpu_seconds(frontend.pid), time.monotonic()
    time.sleep(window_s)
    cpu1, wall1 = cpu_seconds(frontend.pid), time.monotonic()
    time.sleep(1.1)  # the publishers' next stats line covers the window
    sent1, dropped1 = publisher_totals(fleet)
    return {
        "cpu": (cpu1 - cpu0) / (wall1 - wall0),
        "sent": sent1 - sent0,
        "dropped": dropped1 - dropped0,
        "flaps": len(frontend.find("instance_removed")) - removed_before,
    }


def restart(size: int, args: argparse.Namespace, cache: Path) -> Outcome:
    """Fleet first, then the frontend: convergence from its start, then the steady window."""
    address = tcp_endpoint()
    outcome = Outcome(size)
    procs: list[DynamoProcess] = []
    try:
        fleet = start_fleet(address, size, args.publishers, prefix="r", trace=False)
        procs += fleet
        frontend = start_frontend(address, cache_dir=cache)
        procs.append(frontend)
        outcome.live = converge(frontend, size, args.bound)
        if outcome.live >= size:
            started = stamps(frontend, "frontend_started")[0]
            last = max([*stamps(frontend, "instance_added"), *stamps(frontend, "model_added")])
            outcome.convergence_s = last - started
            outcome.extra["first_instance_s"] = min(stamps(frontend, "instance_added")) - started
            outcome.extra["model_build_ms"] = frontend.find("model_added")[0]["build_ms"]
        window = steady_window(frontend, fleet, args.window)
        outcome.cpu, outcome.flaps = window["cpu"], window["flaps"]
        outcome.sent, outcome.dropped = window["sent"], window["dropped"]
        outcome.rejected = sum(e.get("total", 1) for e in frontend.find("card_rejected")[-1:])
    finally:
        reap(procs)
    return outcome


def join(size: int, args: argparse.Namespace, cache: Path) -> Outcome:
    """Model already built by a seed instance; N instances announce for the first time."""
    address = tcp_endpoint()
    outcome = Outcome(size)
    procs: list[DynamoProcess] = []
    try:
        frontend = start_frontend(address, cache_dir=cache)
        procs.append(frontend)
        procs.append(start_publisher(address, instances=1, prefix="seed"))
        frontend.wait_event("model_added", timeout=30)
        fleet = start_fleet(address, size, args.publishers, prefix="j", trace=True)
        procs += fleet
        outcome.live = converge(frontend, size + 1, args.bound) - 1
        if outcome.live >= size:
            first = min(e["wall"] for proc in fleet for e in proc.find("first_announce"))
            outcome.convergence_s = max(stamps(frontend, "instance_added")) - first
        time.sleep(1.1)  # the publishers' next stats line covers the join
        outcome.sent, outcome.dropped = publisher_totals(fleet)
    finally:
        reap(procs)
    return outcome


def report(suite: Suite, kind: str, outcome: Outcome, bound_s: float) -> None:
    size, target = outcome.size, outcome.size == TARGET_SIZE
    parts = [] if outcome.convergence_s is not None else [f"{outcome.live}/{size} live after {bound_s:g} s"]
    if outcome.extra:
        extra = outcome.extra
        parts.append(f"first instance {extra['first_instance_s']:.2f} s, build {extra['model_build_ms']} ms")
    if kind == "join":
        parts.append(f"{outcome.sent} announces, {outcome.dropped} dropped at the HWM")
    suite.record(
        f"{kind}: convergence, {size} instances",
        outcome.convergence_s,
        "s",
        target=f"< {CONVERGENCE_TARGET_S:g} s" if target else "",
        met=(outcome.convergence_s is not None and outcome.convergence_s < CONVERGENCE_TARGET_S)
        if target
        else None,
        note="; ".join(parts),
    )


def report_steady(suite: Suite, outcome: Outcome, window_s: float) -> None:
    size, target = outcome.size, outcome.size == TARGET_SIZE
    cpu = None if outcome.cpu is None else outcome.cpu * 100
    suite.record(
        f"frontend CPU, {size} instances at 1 s heartbeat",
        cpu,
        "% of a core",
        target=f"< {CPU_TARGET * 100:g}%" if target else "",
        met=(cpu is not None and cpu < CPU_TARGET * 100) if target else None,
        note=f"{window_s:g} s window: {outcome.sent} announces, {outcome.dropped} dropped at the HWM, "
        f"{outcome.flaps} expired (flaps), {outcome.rejected} rejected",
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument("--sizes", type=lambda text: [int(n) for n in text.split(",")], default=[1000, 5000])
    parser.add_argument("--publishers", type=int, default=4, help="simulated-fleet processes")
    parser.add_argument("--window", type=float, default=10.0, help="steady CPU window (s)")
    parser.add_argument("--bound", type=float, default=30.0, help="give up converging after (s)")
    args = parser.parse_args()
    suite = Suite("scale")
    suite.details["load_average_at_start"] = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for size in args.sizes:
            outcome = restart(size, args, Path(tmp) / f"r{size}")
            report(suite, "restart", outcome, args.bound)
            report_steady(suite, outcome, args.window)
            joined = join(size, args, Path(tmp) / f"j{size}")
            report(suite, "join", joined, args.bound)
            suite.details[f"size_{size}"] = {"restart": vars(outcome), "join": vars(joined)}
    path = suite.write()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
