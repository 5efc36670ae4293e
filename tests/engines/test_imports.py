"""With vLLM and SGLang installed, the frontend, the worker and ``import dynamo_prep`` still load
neither (nor torch): an engine is imported only by a worker started with it."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import dynamo_prep, dynamo_prep.cli, dynamo_prep.frontend.serve, dynamo_prep.frontend.app
import dynamo_prep.worker.process, dynamo_prep.engines.vllm.runtime, dynamo_prep.engines.sglang.runtime
from dynamo_prep.cli import main
try:
    main(["worker", "--help"])
except SystemExit:
    pass
print(json.dumps([name for name in ("vllm", "sglang", "torch") if name in sys.modules]))
"""


def test_nothing_but_a_starting_engine_imports_it() -> None:
    import vllm  # noqa: F401, PLC0415 - installed here, so the probe below means something

    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
