"""The KV-plane attacks of issue 20 (rows 4, 5 and 16) against the index and one follower, in-process.

Each case runs in its own process and prints the longest synchronous step (what the event loop would
be held for: one ``on_live`` call, or one ``settle`` slice where the follower has them) and the
process's peak RSS. It uses only what old and new code share, so the same command measures both::

    python -m benchmarks.kv_hostile                      # this tree
    git archive HEAD~1 dynamo_prep | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python -m benchmarks.kv_hostile

``--frontend`` runs rows 16, 4 and 5 against a real frontend (``--router-mode kv``, a real worker
of the demo model, a ``/live`` poller every 10 ms) from a raw pyzmq publisher announced as an
instance of its own model (block size 1; ``--capacity N``: its card says N blocks), and prints the
``/live`` figures and the frontend's peak RSS per attack. The old tree runs it too, from its own
directory with a copy of ``benchmarks/``.

Cases: ``removals`` (row 4: 500 removals of blocks whose descendants are held, against 100k held
blocks), ``big_batches`` (row 5: ten batches of 300k blocks, in ``BlockStored`` events of 50k, the issue's
750k-block batches being above ``MAX_BATCH_BYTES`` now; with ``capacity`` the card says 100k blocks),
``pending_fill`` (row 5: live batches of 300k blocks buffered during a replay,
then applied), ``unknown_events`` (row 16: one 1 MB batch of 1,000,000 one-byte events, and one of
62,500 sixteen-byte events of an unknown type).
"""

from __future__ import annotations

import argparse
import inspect
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from benchmarks._plane import DEMO_MODEL, FileProcess, reap, scrape_metrics, summary, tcp_endpoint, wait_for
from benchmarks.hostile import PLANE_TOPIC, Poller
from dynamo_prep.card import ModelDeploymentCard, encode_card
from dynamo_prep.protocol.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch, encode_seq
from dynamo_prep.routing import follower as follower_module
from dynamo_prep.routing.follower import InstanceFollower
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.routing.metrics import KvMetrics

CASES = ("removals", "big_batches", "big_batches_capacity", "pending_fill", "unknown_events", "unknown_16b")


class _Channel:
    def request(self, start_seq: int) -> None:
        pass

    def cancel(self) -> None:
        pass


class _Timed:
    """The longest single call, in ms."""

    def __init__(self) -> None:
        self.longest = 0.0

    def __call__(self, call: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = call()
        self.longest = max(self.longest, (time.perf_counter() - started) * 1000)
        return result


def _follower(index: KvIndex, *, replay: bool = False) -> InstanceFollower:
    fields: dict[str, Any] = {}
    if "slice_blocks" in inspect.signature(InstanceFollower).parameters:  # the new code: its slices
        fields["slice_blocks"] = follower_module.APPLY_SLICE_BLOCKS
    return InstanceFollower(
        "w",
        index,
        topic=b"",
        replay=_Channel() if replay else None,
        metrics=KvMetrics(),
        clock=time.monotonic,
        **fields,
    )


def _feed(follower: InstanceFollower, timed: _Timed, frames: list[bytes], *, replay: bool = False) -> None:
    timed(lambda: (follower.on_replay if replay else follower.on_live)(frames))
    while getattr(follower, "backlogged", False):
        timed(follower.settle)


EVENT_BLOCKS = 50_000  # blocks per event: about 500 KB, under MAX_EVENT_BYTES (a bigger one is skipped)
BATCH_BLOCKS = 300_000  # blocks per batch: about 3 MB, under MAX_BATCH_BYTES (4 MB; the old code took 16)
BATCHES = 10  # 3M blocks, past any instance's bound


def _stored_batch(first: int, blocks: int, *, root: bool = False) -> bytes:
    """``blocks`` blocks of one token (block size 1) chained to block ``first - 1`` (unless ``root``),
    in events of ``EVENT_BLOCKS``, each chained to the one before."""
    events: list[BlockStored] = []
    for start in range(first, first + blocks, EVENT_BLOCKS):
        hashes = list(range(start, min(start + EVENT_BLOCKS, first + blocks)))
        parent = None if (root and start == first) or not start else start - 1
        events.append(
            BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=[7] * len(hashes), block_size=1
            )
        )
    return encode_batch(KVEventBatch(ts=1.0, events=list(events)))


def removals() -> str:
    index = KvIndex(4)
    for chain in range(1000):
        hashes = [chain * 1000 + i for i in range(100)]
        index.apply(
            "w",
            [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[chain] * 400, block_size=4)],
        )
    timed = _Timed()
    timed(lambda: index.apply("w", [BlockRemoved(block_hashes=[chain * 1000]) for chain in range(500)]))
    for _ in range(20):  # the next batches (empty here): the new index drops the rest with them
        timed(lambda: index.apply("w", []))
    return f"500 removals against 100k held: longest step {timed.longest:.1f} ms, {len(index)} blocks left"


def big_batches(capacity: int | None = None) -> str:
    index = KvIndex(1)
    if capacity is not None and hasattr(index, "set_capacity"):
        index.set_capacity("w", capacity)
    follower = _follower(index)
    timed = _Timed()
    for seq in range(BATCHES):
        _feed(follower, timed, [b"", encode_seq(seq), _stored_batch(seq * BATCH_BLOCKS, BATCH_BLOCKS)])
    held = index.blocks_held("w")
    longest = timed.longest
    return f"{BATCHES} batches of {BATCH_BLOCKS:,} blocks: longest step {longest:.1f} ms, {held} blocks held"


def pending_fill() -> str:
    index = KvIndex(1)
    follower = _follower(index, replay=True)
    follower.start()  # a catch-up replay is outstanding: live batches wait
    timed = _Timed()
    sent = 0
    for seq in range(40):
        if not follower.replaying:
            break
        sent += 1
        _feed(follower, timed, [b"", encode_seq(seq), _stored_batch(seq * BATCH_BLOCKS, BATCH_BLOCKS)])
    buffered = len(follower.pending)
    end = (-1).to_bytes(8, "big", signed=True)
    _feed(follower, timed, [b"", b"", end, b""], replay=True)
    return f"{sent} live batches in a replay ({buffered} left buffered), then applied: {timed.longest:.1f} ms"


def unknown_events(size: int) -> str:
    count = 1_000_000 // size
    event = b"\x01" if size == 1 else msgspec.msgpack.encode({"type": "X" * (size - 7)})
    assert len(event) == size
    header = b"\xdd" + count.to_bytes(4, "big")
    payload = b"\x93" + msgspec.msgpack.encode(1.0) + header + event * count + b"\xc0"
    follower = _follower(KvIndex(4))
    timed = _Timed()
    _feed(follower, timed, [b"", encode_seq(0), payload])
    described = f"one {len(payload) / 1e6:.1f} MB batch of {count:,} {size}-byte events"
    return f"{described}: longest step {timed.longest:.1f} ms"


def run_case(name: str) -> str:
    cases: dict[str, Callable[[], str]] = {
        "removals": removals,
        "big_batches": big_batches,
        "big_batches_capacity": lambda: big_batches(100_000),
        "pending_fill": pending_fill,
        "unknown_events": lambda: unknown_events(1),
        "unknown_16b": lambda: unknown_events(16),
    }
    result = cases[name]()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"{name:22} {result}; peak RSS {peak_mb:.0f} MB"


# ----------------------------------------------------------------------------- a real frontend


REMOVED = "dynamo_frontend_kv_events_applied_total{kind=removed}"
MARKER = encode_batch(KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[1])]))  # of a block never held


class Frontend:
    """A kv-mode frontend, a worker of the demo model, and the attacker: an instance of its own
    model (block size 1) whose KV publisher is a raw PUB here."""

    def __init__(self, tmp: Path, capacity: int | None) -> None:
        self.tmp = tmp
        plane = tcp_endpoint()
        args = ["--log-level", "info", "frontend", "--discovery-bind", plane, "--http-host", "127.0.0.1",
                "--http-port", "0", "--cache-dir", str(tmp / "cache"), "--router-mode", "kv"]  # fmt: skip
        self.frontend = FileProcess(args, tmp / "frontend.log")
        self.procs = [self.frontend]
        self.port = self.frontend.wait_event("frontend_started")["http_port"]
        worker = ["--log-level", "info", "worker", "--model-path", DEMO_MODEL, "--discovery", plane]
        self.procs.append(FileProcess([*worker, "--token-delay", "0"], tmp / "worker.log"))
        self.frontend.wait_event("model_added", timeout=60)
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.LINGER, 0)
        kv_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self._announce(plane, kv_port, capacity)
        self.marker(self.removed())  # the first batches a new PUB sends may be lost: from here on none is

    def _announce(self, plane: str, kv_port: int, capacity: int | None) -> None:
        card = msgspec.msgpack.decode(encode_card(ModelDeploymentCard.from_model_dir(DEMO_MODEL)))
        card.update(display_name="kvattack", slug="kvattack", kv_cache_block_size=1)
        if capacity is not None:
            card["runtime_config"] = {**card.get("runtime_config", {}), "total_kv_blocks": capacity}
        payload = msgspec.msgpack.encode(
            {"v": 1, "kind": "announce", "sent_ms": 0, "ttl_ms": 600_000, "instance_id": "kvattack",
             "seq": 1, "endpoint": "tcp://127.0.0.1:9", "card": card,
             "kv_events": {"endpoint": f"tcp://127.0.0.1:{kv_port}"}}
        )  # fmt: skip
        plane_pub = self.context.socket(zmq.PUB)
        plane_pub.setsockopt(zmq.LINGER, 0)
        plane_pub.connect(plane)

        def followed() -> bool:
            plane_pub.send_multipart([PLANE_TOPIC, payload])
            found = self.frontend.find("kv_events_subscribed")
            return any(record.get("instance_id") == "kvattack" for record in found)

        wait_for(followed, 60, interval=0.2, message="the attacker's instance followed")
        plane_pub.close()

    def send(self, payload: bytes) -> None:
        self.pub.send_multipart([b"", encode_seq(self.seq), payload])
        self.seq += 1

    def removed(self) -> float:
        try:
            return scrape_metrics(self.port).get(REMOVED, 0.0)
        except httpx.HTTPError:  # a frontend whose loop is held (the old code) answers late
            return -1.0

    def marker(self, removed: float) -> None:
        """A batch of one removal after the attack (whose removals brought the count to ``removed``):
        once it reaches the index, so has everything before it (batches are applied in order)."""

        def applied() -> bool:
            self.send(MARKER)
            return self.removed() > removed

        wait_for(applied, 600, interval=0.5, message="the marker batch applied")

    def attack(self, name: str, batches: list[bytes], removals: int = 0) -> str:
        poller = Poller(self.port, 10.0, self.tmp / f"live-{self.seq}.txt")
        try:
            removed = self.removed() + removals
            began = time.monotonic()
            for batch in batches:
                self.send(batch)
            self.marker(removed)
            ended = time.monotonic()
        finally:
            samples = poller.stop()
        rows = [row for row in samples if began <= row[0] <= ended]
        live = summary([latency for _, latency, _ in rows])
        failed = sum(status != 200 for _, _, status in rows)
        status = Path(f"/proc/{self.frontend.pid}/status").read_text()
        peak = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
        return (
            f"{name:28} {ended - began:6.1f} s; /live max {live.get('max', 0):8.1f} ms, "
            f"p99 {live.get('p99', 0):7.1f} ms, {failed} failed of {live['n']}; "
            f"peak RSS {int(peak) // 1024} MB"
        )

    def close(self) -> None:
        self.pub.close()
        self.context.term()
        reap(self.procs)


def frontend_run(capacity: int | None) -> None:
    with tempfile.TemporaryDirectory(prefix="kv-hostile-") as tmp:
        stack = Frontend(Path(tmp), capacity)
        try:
            count = 1_000_000
            junk = (
                b"\x93" + msgspec.msgpack.encode(1.0) + b"\xdd" + count.to_bytes(4, "big") + b"\x01" * count
            )
            print(stack.attack("row 16: 1M one-byte events", [junk + b"\xc0"]), flush=True)
            chains = [[chain * 1000 + i for i in range(100)] for chain in range(1000)]
            stored = [
                BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=hashes, block_size=1)
                for hashes in chains
            ]
            held = [
                encode_batch(KVEventBatch(ts=1.0, events=list(stored[n : n + 100])))
                for n in range(0, 1000, 100)
            ]
            print(stack.attack("(100k blocks stored)", held), flush=True)
            removed = [BlockRemoved(block_hashes=[hashes[0]]) for hashes in chains[:500]]
            batch = encode_batch(KVEventBatch(ts=1.0, events=list(removed)))
            print(stack.attack("row 4: 500 removals of 100k", [batch], removals=500), flush=True)
            big = [_stored_batch(10**9 + n * BATCH_BLOCKS, BATCH_BLOCKS, root=not n) for n in range(BATCHES)]
            print(stack.attack(f"row 5: {BATCHES} x {BATCH_BLOCKS // 1000}k blocks", big), flush=True)
        finally:
            stack.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=CASES, action="append")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    parser.add_argument("--frontend", action="store_true", help="the attacks against a real frontend")
    parser.add_argument("--capacity", type=int, help="with --frontend: the blocks the attacker's card says")
    args = parser.parse_args(argv)
    if args.frontend:
        frontend_run(args.capacity)
        return 0
    if args.case:
        print(run_case(args.case), flush=True)
        return 0
    for name in args.only or CASES:
        subprocess.run([sys.executable, "-m", "benchmarks.kv_hostile", "--case", name], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
