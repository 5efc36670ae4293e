"""The row loop of the hostile benchmarks: the rows ``--only`` names, each measured in its own
temporary directory and printed as one JSON line."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar


class Row(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def row(self) -> Any: ...


R = TypeVar("R", bound=Row)


def named(only: list[str], rows: Iterable[R]) -> Iterator[R]:
    """The rows whose name contains one of ``only`` (all of them when it is empty)."""
    for row in rows:
        if not only or any(name in row.name for name in only):
            yield row


def run_rows(rows: Iterable[R], measure: Callable[[R, Path], dict[str, Any]], key: str) -> int:
    """Measure each row in a fresh temporary directory; one JSON line a row (``key``: its name)."""
    for row in rows:
        with tempfile.TemporaryDirectory(prefix=f"hostile-{row.name}-") as tmp:
            result = measure(row, Path(tmp))
        print(json.dumps({key: row.name, "row": row.row, **result}), flush=True)
    return 0
