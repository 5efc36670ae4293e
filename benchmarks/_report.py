"""Shared benchmark reporting: one JSON file per suite and one Markdown table for all of them.

Every figure is recorded with its unit, its target and whether the target is met, so a suite only
says what it measured; the README table (``benchmarks/results/README.md``) is regenerated from
the JSON files of every suite that has run, so suites can run alone or together.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TABLE_FILE = RESULTS_DIR / "README.md"


@dataclass
class Record:
    """One measured figure; ``met`` is None when there is no target or it could not be measured."""

    name: str
    value: float | None
    unit: str
    target: str = ""
    met: bool | None = None
    note: str = ""


@dataclass
class Suite:
    """The records of one suite run, written as ``results/<name>.json`` and into the Markdown table."""

    name: str
    records: list[Record] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def record(  # noqa: PLR0917 (record(name, value, unit, target, met, note) reads best positionally)
        self,
        name: str,
        value: float | None,
        unit: str,
        target: str = "",
        met: bool | None = None,
        note: str = "",
    ) -> Record:
        entry = Record(name, value, unit, target, met, note)
        self.records.append(entry)
        print(_row(self.name, entry), flush=True)
        return entry

    def write(self) -> Path:
        """Write the JSON file and regenerate the table from every suite's JSON; returns the JSON path."""
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{self.name}.json"
        payload = {
            "suite": self.name,
            "machine": machine(),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "records": [asdict(entry) for entry in self.records],
            "details": self.details,
        }
        path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        TABLE_FILE.write_text(markdown_table(), encoding="utf-8")
        return path


def machine() -> dict[str, Any]:
    """What the numbers were measured on: cores, CPU model, Python."""
    return {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": _git_revision(),
    }


def markdown_table() -> str:
    """Every suite's records as one Markdown table, with the machine line of the latest run."""
    files = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(RESULTS_DIR.glob("*.json"))]
    suites = [suite for suite in files if "records" in suite and "finished_at" in suite]  # a Suite's file
    lines = ["# Benchmark results", ""]
    if suites:
        info = max(suites, key=lambda suite: suite["finished_at"])["machine"]
        lines += [
            f"Machine: {info['nproc']} CPU(s), {info['cpu']}, Python {info['python']} "
            f"({info['platform']}), revision {info['git']}.",
            "",
        ]
    lines += ["| suite | figure | value | target | met | note |", "|---|---|---|---|---|---|"]
    for suite in suites:
        for entry in suite["records"]:
            lines.append(_row(suite["suite"], Record(**entry)))
    return "\n".join(lines) + "\n"


def _row(suite: str, entry: Record) -> str:
    value = "n/a" if entry.value is None else f"{_number(entry.value)} {entry.unit}".strip()
    met = {True: "yes", False: "**no**", None: "-"}[entry.met]
    return f"| {suite} | {entry.name} | {value} | {entry.target or '-'} | {met} | {entry.note} |"


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
