"""The seeded slice of the KV subscriber's fuzz target (``kv_strategies.TARGETS``); the benchmark run
(``python -m benchmarks.fuzz --target kv_subscriber_frames``) checks the same properties over >= 10,000
cases."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from kv_strategies import TARGETS
from test_fuzz import SEEDED

EXAMPLES = {"kv_subscriber_frames": 400}


def test_kv_subscriber_frames() -> None:
    """Never an exception, only documented outcomes, and at least 5% of the runs apply a batch."""
    strategy, check = TARGETS["kv_subscriber_frames"]
    outcomes: Counter[str] = Counter()

    @settings(SEEDED, max_examples=EXAMPLES["kv_subscriber_frames"])
    @given(strategy)
    def run(example: Any) -> None:
        outcomes[check(example)] += 1

    run()
    assert set(outcomes) <= {"ok", "rejected:KvEventDecodeError"}, dict(outcomes)
    assert outcomes["ok"] >= EXAMPLES["kv_subscriber_frames"] // 20, dict(outcomes)


def test_every_target_is_seeded() -> None:
    assert set(EXAMPLES) == set(TARGETS)
