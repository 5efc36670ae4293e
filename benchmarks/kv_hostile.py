"""The KV-plane attacks of issue 20 (rows 4, 5 and 16) against the index and one follower, in-process.

Each case runs in its own process and prints the longest synchronous step (what the event loop would
be held for: one ``on_live`` call, or one ``settle`` slice where the follower has them) and the
process's peak RSS. It uses only what old and new code share, so the same command measures both::

    python -m benchmarks.kv_hostile                      # this tree
    git archive HEAD~1 dynamo_prep | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python -m benchmarks.kv_hostile

Cases: ``removals`` (row 4: 500 removals of blocks whose descendants are held, against 100k held
blocks), ``big_batches`` (row 5: four ``BlockStored`` batches of 750k blocks; with ``capacity`` the
card says 100k blocks), ``pending_fill`` (row 5: live batches of 750k blocks buffered during a replay,
then applied), ``unknown_events`` (row 16: one 1 MB batch of 1,000,000 one-byte events, and one of
62,500 sixteen-byte events of an unknown type).
"""

from __future__ import annotations

import argparse
import inspect
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

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


def _stored_batch(first: int, blocks: int) -> bytes:
    hashes = list(range(first, first + blocks))
    parent = first - 1 if first else None
    event = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[7] * blocks, block_size=1)
    return encode_batch(KVEventBatch(ts=1.0, events=[event]))


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
    return f"500 removals against 100k held blocks: {timed.longest:.1f} ms, {len(index)} blocks left"


def big_batches(capacity: int | None = None) -> str:
    index = KvIndex(1)
    if capacity is not None and hasattr(index, "set_capacity"):
        index.set_capacity("w", capacity)
    follower = _follower(index)
    timed = _Timed()
    for seq in range(4):
        _feed(follower, timed, [b"", encode_seq(seq), _stored_batch(seq * 750_000, 750_000)])
    return (
        f"4 batches of 750k blocks: longest step {timed.longest:.1f} ms, {index.blocks_held('w')} blocks held"
    )


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
        _feed(follower, timed, [b"", encode_seq(seq), _stored_batch(seq * 750_000, 750_000)])
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=CASES, action="append")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    args = parser.parse_args(argv)
    if args.case:
        print(run_case(args.case), flush=True)
        return 0
    for name in args.only or CASES:
        subprocess.run([sys.executable, "-m", "benchmarks.kv_hostile", "--case", name], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
