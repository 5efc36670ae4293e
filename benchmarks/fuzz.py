"""Fuzzing at benchmark scale: >= 10,000 hypothesis cases per target, the same properties as the tests.

``python -m benchmarks.fuzz [--cases N] [--seed S] [--target NAME ...]`` runs every target of
``tests/strategies.py`` (card payloads and round trips, discovery envelopes and registry sequences,
chat requests on both demo models, the Kimi-K3 renderer), of ``tests/kv_strategies.py`` (the KV
subscriber's frame handling) and of ``tests/strategies_hostile.py`` (the tokenizer's long-run split,
stop strings, chat templates under their bounds). The strategies live in ``tests/`` so the seeded
slices in ``make test`` and this run share one definition; this module puts ``tests/`` on
``sys.path`` to import them.

Per target it prints how many cases were accepted, rejected with the documented error, or hit an
already reported bug (``strategies.KNOWN_BUGS``, with the smallest example seen), any new failure
with hypothesis' minimal failing example, and the wall time. Results go to
``benchmarks/results/fuzz.json`` and the shared Markdown table (``benchmarks._report``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings

from benchmarks._report import Suite

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import kv_strategies  # noqa: E402  (lives in tests/, shared with tests/test_kv_fuzz.py)
import strategies  # noqa: E402  (lives in tests/, shared with tests/test_fuzz.py)
import strategies_hostile  # noqa: E402  (lives in tests/, shared with tests/test_hostile_fuzz.py)

DEFAULT_CASES = 10_000
MIN_CASES = 10_000
TARGETS = {**strategies.TARGETS, **kv_strategies.TARGETS, **strategies_hostile.TARGETS}


@dataclass
class TargetResult:
    """What one target's run saw: outcome counts, the smallest known-bug examples, new failures."""

    name: str
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    known_examples: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "ok": self.outcomes["ok"],
            "rejected": sum(n for k, n in self.outcomes.items() if k.startswith("rejected:")),
            "known": {k[len("known:") :]: n for k, n in self.outcomes.items() if k.startswith("known:")},
            "outcomes": dict(sorted(self.outcomes.items())),
            "known_examples": self.known_examples,
            "failures": self.failures,
            "seconds": round(self.seconds, 2),
        }


def run_target(name: str, cases: int, seed_value: int) -> TargetResult:
    """Run one target; a new failure stops it after hypothesis has shrunk the example."""
    strategy, check = TARGETS[name]
    result = TargetResult(name)

    @settings(
        max_examples=cases,
        database=None,
        deadline=None,
        derandomize=False,
        print_blob=False,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=True,
    )
    @seed(seed_value)
    @given(strategy)
    def run(example: Any) -> None:
        outcome = check(example)
        result.cases += 1
        result.outcomes[outcome] += 1
        if outcome.startswith("known:"):
            shown = _short_repr(example)
            if outcome not in result.known_examples or len(shown) < len(result.known_examples[outcome]):
                result.known_examples[outcome] = shown

    started = time.perf_counter()
    try:
        run()
    except BaseException as exc:  # every failure is reported, then the next target runs
        if isinstance(exc, KeyboardInterrupt):
            raise
        result.failures.extend(_describe(exc))
    result.seconds = time.perf_counter() - started
    return result


def _describe(exc: BaseException) -> list[str]:
    """One line block per distinct failure: exception, crash site, hypothesis' minimal example."""
    if isinstance(exc, BaseExceptionGroup):
        return [line for inner in exc.exceptions for line in _describe(inner)]
    notes = "\n".join(getattr(exc, "__notes__", []))
    head = f"{type(exc).__name__}: {str(exc)[:300]} at {strategies.crash_site(exc)}"
    return [f"{head}\n{notes}"]


def _short_repr(example: Any, limit: int = 2000) -> str:
    text = repr(example)
    return text if len(text) <= limit else text[:limit] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=DEFAULT_CASES, help="hypothesis cases per target")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (a run is reproducible)")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="repeatable")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results")
    args = parser.parse_args(argv)
    names = args.target or list(TARGETS)
    suite = Suite("fuzz")
    total_started = time.perf_counter()
    results = []
    for name in names:
        print(f"fuzz {name}: {args.cases} cases ...", file=sys.stderr, flush=True)
        result = run_target(name, args.cases, args.seed)
        results.append(result)
        summary = result.summary()
        known = sum(summary["known"].values())
        note = f"ok {summary['ok']}, rejected {summary['rejected']}, known bugs {known}"
        if summary["known"]:
            note += " (" + ", ".join(f"{k} {n}" for k, n in sorted(summary["known"].items())) + ")"
        note += f", new failures {len(result.failures)}, {result.seconds:.1f} s"
        suite.record(
            f"{name}: cases without a new failure",
            result.cases,
            "cases",
            target=f">= {MIN_CASES}, 0 new failures",
            met=result.cases >= MIN_CASES and not result.failures,
            note=note,
        )
        suite.details[name] = summary
    wall = time.perf_counter() - total_started
    suite.record("fuzz wall time", wall, "s", note=f"{len(names)} targets, seed {args.seed}")
    suite.details["known_bugs"] = {
        key: f"{kind} in {where}" for (kind, where), key in strategies.KNOWN_BUGS.items()
    }
    _print_report(results, wall)
    if not args.no_write:
        print(f"wrote {suite.write()}", file=sys.stderr)
    return 1 if any(r.failures for r in results) else 0


def _print_report(results: list[TargetResult], wall: float) -> None:
    print()
    print(f"{'target':<20} {'cases':>7} {'ok':>7} {'rejected':>9} {'known':>7} {'new':>4} {'seconds':>8}")
    for result in results:
        summary = result.summary()
        print(
            f"{result.name:<20} {result.cases:>7} {summary['ok']:>7} {summary['rejected']:>9} "
            f"{sum(summary['known'].values()):>7} {len(result.failures):>4} {result.seconds:>8.1f}"
        )
    print(f"wall time {wall:.1f} s")
    for result in results:
        for outcome, example in sorted(result.known_examples.items()):
            print(f"\n[{result.name}] {outcome} ({result.outcomes[outcome]} cases), smallest example seen:")
            print(f"  {example}")
        for failure in result.failures:
            print(f"\n[{result.name}] NEW FAILURE\n{failure}")


# ---------------------------------------------------------------------------- answer parsers
# Random output ids through the answer parsers (K3 on ids, Hermes on text and on ids). The target
# lives with its seeded slice in tests/test_parsing_fuzz.py; it is added to this run's targets,
# not to strategies.TARGETS, whose seeded slice tests/test_fuzz.py keeps to its own list.

import test_parsing_fuzz  # noqa: E402  (lives in tests/, like strategies)

TARGETS.setdefault("answer_parser", (test_parsing_fuzz.answer_ids(), test_parsing_fuzz.check_answer_ids))

if __name__ == "__main__":
    raise SystemExit(main())
