"""Issue 25, rows 3, 5, 7 and 13: request images as an attacker sends them, at the worker's fetcher.

``python -m benchmarks.hostile_media [--only NAME ...] [--code DIR]``

Each attack runs in a fresh process (``benchmarks/_media_child.py``) with the worker's image
fetcher, as a worker process holds it, and real HTTP servers on loopback (nothing leaves the
machine): the spellings of this host and the scanner's view (row 3), a victim behind two requests
of 64 hung images (row 5), PNGs of 7071x7071 in one request with the process's peak RSS growth and
its event loop's longest lag (row 7), an image that changes at its URL (row 13). ``--code DIR``
measures another tree (``git archive <commit> | tar -x -C DIR``: the child imports only
``dynamo_prep`` from it, and takes the fetcher the way the old code and this one both do). Figures
of this tree go to ``results/hostile_media.json``; docs/hostile-input.md has both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._report import Suite

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_media_child.py"
ATTACKS = ("ssrf", "hung", "pixels_4", "pixels_8", "pixels_rgba_1", "changed")
RUN = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
TIMEOUT_S = 300


def run(attack: str, code: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code), "DYN_LOG_LEVEL": "error"}
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(CHILD), attack],
        cwd=code, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"attack"')]
    if done.returncode != 0 or not lines:
        return {"attack": attack, "failed": done.returncode, "stderr": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def record(suite: Suite, results: dict[str, dict[str, Any]]) -> None:
    if "ssrf" in results:
        ssrf = results["ssrf"]
        fetched, distinct = ssrf["fetched"], ssrf["distinct_scanner_messages"]
        note = f"{distinct} distinct message(s) for a scanner"
        suite.record("row 3: URLs to this host fetched", fetched, f"of {ssrf['of']}", "0", fetched == 0, note)
    if "hung" in results:
        hung = results["hung"]
        served = hung["victim"] == "served" and hung["attackers_still_waiting_when_victim_done"] == 2
        suite.record(
            "row 5: victim's wait behind 2x64 hung images", hung["victim_wait_s"], "s",
            "served while they hang", served, f"attackers end after {hung['attackers_end_s']} s",
        )  # fmt: skip
    for name in ("pixels_4", "pixels_8", "pixels_rgba_1"):
        if name in results:
            row = results[name]
            suite.record(
                f"row 7: {row['images']} {row['mode']} PNG(s) of 7071x7071, worker RSS growth",
                row["rss_growth_mb"], "MB", "bounded by the request's pixel budget", None,
                f"{row['outcome'][:60]}; loop lag max {row['loop_lag_max_ms']} ms",
            )  # fmt: skip
    if "changed" in results:
        changed = results["changed"]
        suite.record(
            "row 13: a changed image at its URL", 1.0 if changed["second"].startswith("blue") else 0.0,
            "new image", "1", changed["second"].startswith("blue"), changed["second"],
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostile_media", description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="attacks whose name contains one of these")
    parser.add_argument("--code", type=Path, default=ROOT, help="the tree to measure (default: this one)")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    for attack in ATTACKS:
        if args.only and not any(name in attack for name in args.only):
            continue
        results[attack] = run(attack, args.code.resolve())
        print(json.dumps(results[attack]), flush=True)
    if args.code.resolve() == ROOT:
        suite = Suite("hostile_media")
        record(suite, results)
        suite.details = results
        suite.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
