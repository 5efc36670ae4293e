"""Processes that never render a prompt never load the formatter stack (jinja2, tiktoken) or HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("jinja2", "tiktoken", "starlette", "uvicorn")

# Imports what the command's handler imports, runs the real entry point, then reports which heavy
# modules the process had loaded.
_PROBE = """
import json, sys
for module in {imports!r}:
    __import__(module)
from dynamo_prep.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(json.dumps([name for name in {heavy!r} if name in sys.modules]))
"""


def loaded_after(argv: list[str], imports: tuple[str, ...] = ()) -> list[str]:
    code = _PROBE.format(argv=argv, imports=imports, heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    result: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_watch_runs_without_the_formatter_stack() -> None:
    assert loaded_after(["watch", "--bind", "tcp://127.0.0.1:0", "--json", "--once-after", "0"]) == []


def test_broker_and_keys_load_no_formatter_stack() -> None:
    """The broker runs until signalled, so its handler's module is imported and its help printed."""
    assert loaded_after(["broker", "--help"], ("dynamo_prep.discovery.broker",)) == []
    assert loaded_after(["keys", "--help"], ("dynamo_prep.discovery.trust",)) == []


ENGINES = ("vllm", "sglang", "torch")


def test_no_module_imports_an_engine_at_import_time() -> None:
    """The frontend, the worker and ``import dynamo_prep`` never load vLLM, SGLang or torch: only a
    worker started with ``--engine vllm|sglang`` imports its engine, inside the bridge's functions
    (``tests/engines/test_imports.py`` checks the same with the engines installed)."""
    import ast  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    package = Path(__file__).resolve().parent.parent / "dynamo_prep"
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only: imports inside functions are lazy
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}: {name}" for name in names if name.split(".")[0] in ENGINES]
    assert found == []
