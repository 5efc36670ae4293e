"""Discovery latency: announce -> instance live, and kill -9 -> instance removed, on loopback.

``python -m benchmarks.discovery [--instances 200] [--ramp-ms 20] [--background 0,1000] [--kills 5]``

The frontend side runs *in this process* (the production ``DiscoveryWatcher`` and
``PreprocessorBuilder``, logging JSON at info level to /dev/null so log rendering is paid for), so
"live" is timed where it happens: the catalog update that makes an instance routable. The senders
are other processes; every timestamp is ``time.monotonic()``, one system-wide clock on Linux.

* announce: a seed instance makes the model build once (reported apart, it is not discovery);
  then a simulated fleet (``benchmarks._plane publish``) starts ``--instances`` new instances of
  that model one every ``--ramp-ms`` while the earlier ones keep heartbeating, once per
  ``--background`` count of other instances heartbeating at 1 s (default 0 and 1000).
  Latency = first announce sent -> catalog entry. Target p99 < 50 ms.
* kill -9: real ``dynamo-prep worker`` processes (ttl 1 s, heartbeat ttl/3 as the defaults' ratio)
  are killed one by one at random heartbeat phases; latency = SIGKILL -> the expiry removes the
  instance from the catalog. Target <= ttl + 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._plane import (
    DEMO_MODEL,
    DynamoProcess,
    reap,
    spawn,
    start_publisher,
    summary,
)
from benchmarks._report import Suite
from dynamo_prep.discovery.builder import PreprocessorBuilder
from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.discovery.files import ModelFileStore
from dynamo_prep.discovery.watcher import DiscoveryWatcher
from dynamo_prep.logging import configure_logging
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.discovery import Instance

ANNOUNCE_TARGET_MS = 50.0
KILL_TTL_MS = 1000
KILL_SLACK_S = 0.5
WAIT_S = 30.0


class TimedCatalog(ModelCatalog):
    """The production catalog, remembering when each instance became live and when it left."""

    def __init__(self) -> None:
        super().__init__()
        self.added: dict[str, float] = {}
        self.removed: dict[str, float] = {}
        self.published: dict[str, float] = {}

    def publish(self, model: LiveModel) -> None:
        super().publish(model)
        self.published.setdefault(model.name, time.monotonic())

    def set_instance(self, name: str, instance: Instance) -> None:
        super().set_instance(name, instance)
        self.added.setdefault(instance.instance_id, time.monotonic())

    def remove_instance(self, name: str, instance_id: str) -> None:
        super().remove_instance(name, instance_id)
        self.removed.setdefault(instance_id, time.monotonic())


async def until(predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """Poll a condition on this loop (the watcher runs beside it) until it holds, or fail."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)
    return value


def first_announces(proc: DynamoProcess) -> dict[str, float]:
    return {e["instance_id"]: e["t"] for e in proc.find("first_announce")}


# ----------------------------------------------------------------------------- announce latency


async def measure_announce(
    suite: Suite, watcher: DiscoveryWatcher, catalog: TimedCatalog, args: argparse.Namespace
) -> None:
    """Build the model once (seed instance), then time new instances for each background load."""
    address = watcher.addresses[0]
    seed = start_publisher(address, instances=1, prefix="seed", trace=True)
    try:
        await until(lambda: catalog.get(DEMO_MODEL), "the seed model build")
        build_ms = (catalog.published[DEMO_MODEL] - first_announces(seed)["seed-00000"]) * 1000
        suite.record(
            "first announce -> model built (once per model)",
            build_ms,
            "ms",
            note="preprocessor build from a local model dir; excluded below",
        )
        for background in args.background:
            await announce_round(suite, address, catalog, args, background)
    finally:
        await asyncio.to_thread(reap, [seed])


async def announce_round(
    suite: Suite, address: str, catalog: TimedCatalog, args: argparse.Namespace, background: int
) -> None:
    """New instances one by one while ``background`` others heartbeat; one latency distribution."""
    procs: list[DynamoProcess] = []
    prefix = f"new{background}"
    try:
        if background:
            procs.append(start_publisher(address, instances=background, prefix=f"bg{background}"))
            await until(lambda: _live(catalog, f"bg{background}") >= background, "background instances")
        fleet = start_publisher(
            address, instances=args.instances, prefix=prefix, ramp_ms=args.ramp_ms, trace=True
        )
        procs.append(fleet)
        await until(lambda: _live(catalog, prefix) >= args.instances, "the new instances")
        stats = fleet.find("publisher_stats")
    finally:
        await asyncio.to_thread(reap, procs)
    sends = first_announces(fleet)
    latencies = [(catalog.added[i] - t) * 1000 for i, t in sends.items() if i in catalog.added]
    report_announce(suite, latencies, args, background, stats[-1] if stats else {})


def _live(catalog: TimedCatalog, prefix: str) -> int:
    return sum(instance_id.startswith(prefix + "-") for instance_id in catalog.added)


def report_announce(
    suite: Suite, latencies: list[float], args: argparse.Namespace, background: int, stats: dict[str, Any]
) -> None:
    dist = summary(latencies)
    suite.details[f"announce_ms_background_{background}"] = {
        **dist,
        "instances": args.instances,
        "ramp_ms": args.ramp_ms,
        "publisher": stats,
    }
    load = f"{args.instances} new instances, 1 per {args.ramp_ms:g} ms, {background} others heartbeating"
    p99 = dist["p99"]
    suite.record(f"announce -> instance live p50 (+{background} live)", dist["p50"], "ms", note=load)
    suite.record(
        f"announce -> instance live p99 (+{background} live)",
        p99,
        "ms",
        target=f"< {ANNOUNCE_TARGET_MS:g} ms",
        met=p99 < ANNOUNCE_TARGET_MS,
        note=f"max {dist['max']:.2f} ms; in-process watcher, publisher in another process",
    )


# ----------------------------------------------------------------------------- kill -9


async def measure_kills(suite: Suite, watcher: DiscoveryWatcher, catalog: TimedCatalog, kills: int) -> None:
    address = watcher.addresses[0]
    heartbeat_s = round(KILL_TTL_MS / 3000, 3)
    workers: list[DynamoProcess] = []
    latencies: list[float] = []
    try:
        for _ in range(kills):
            workers.append(spawn(_worker_command(address, heartbeat_s)))
        ids = [(await asyncio.to_thread(w.wait_event, "worker_started", 60))["instance_id"] for w in workers]
        await until(lambda: all(i in catalog.added for i in ids), "workers live", 60)
        for worker, instance_id in zip(workers, ids, strict=True):
            await asyncio.sleep(random.uniform(0, heartbeat_s))  # a random heartbeat phase
            killed_at = time.monotonic()
            os.kill(worker.pid, signal.SIGKILL)
            await until(lambda i=instance_id: i in catalog.removed, "expiry", KILL_TTL_MS / 1000 + 5)
            latencies.append(catalog.removed[instance_id] - killed_at)
    finally:
        await asyncio.to_thread(reap, workers)
    dist = summary(latencies)
    suite.details["kill_s"] = {
        **dist,
        "samples": latencies,
        "ttl_ms": KILL_TTL_MS,
        "heartbeat_s": heartbeat_s,
    }
    limit = KILL_TTL_MS / 1000 + KILL_SLACK_S
    suite.record(
        "kill -9 -> instance removed (max)",
        dist["max"],
        "s",
        target=f"<= {limit:g} s (ttl {KILL_TTL_MS / 1000:g} s + 0.5 s)",
        met=dist["max"] <= limit,
        note=f"{len(latencies)} kills, heartbeat {heartbeat_s:g} s: "
        + ", ".join(f"{value:.3f}" for value in sorted(latencies)),
    )


def _worker_command(address: str, heartbeat_s: float) -> list[str]:
    return [
        sys.executable, "-m", "dynamo_prep.cli", "--log-level", "info", "--log-format", "json",
        "worker", "--model-path", DEMO_MODEL, "--discovery", address, "--token-delay", "0",
        "--ttl-ms", str(KILL_TTL_MS), "--heartbeat", str(heartbeat_s),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> Suite:
    suite = Suite("discovery")
    catalog = TimedCatalog()
    with tempfile.TemporaryDirectory(prefix="bench-discovery-") as tmp:
        builder = PreprocessorBuilder(
            ModelFileStore(Path(tmp)), local_model_path=resolve_model_dir(DEMO_MODEL)
        )
        watcher = DiscoveryWatcher(builder=builder, bind=["tcp://127.0.0.1:0"], catalog=catalog)
        watcher.open()
        task = asyncio.create_task(watcher.run())
        try:
            await measure_announce(suite, watcher, catalog, args)
            if args.kills:
                await measure_kills(suite, watcher, catalog, args.kills)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return suite


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.discovery", description=__doc__)
    parser.add_argument("--instances", type=int, default=200, help="new instances timed")
    parser.add_argument("--ramp-ms", type=float, default=20.0, help="one new instance every ... ms")
    parser.add_argument(
        "--background",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[0, 1000],
        help="rounds: how many other instances heartbeat meanwhile (comma-separated)",
    )
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    # The frontend's real log configuration, rendered and thrown away: its cost is part of the figure.
    configure_logging(level="info", stream=open(os.devnull, "w"), component="frontend")  # noqa: SIM115
    suite = asyncio.run(run(args))
    path = suite.write()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
