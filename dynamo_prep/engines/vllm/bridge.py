"""vLLM as a plug-in engine (``--engine vllm``; the mock's ``--flavor vllm``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Final

from dynamo_prep.engines.bridge import (
    EmulatedContract,
    EngineBridge,
    KvDialect,
    reasoning_flags_by,
    refuse_mock_options,
)
from dynamo_prep.engines.vllm.translate import engine_argv

if TYPE_CHECKING:
    from dynamo_prep.tokenizer import Tokenizer

__all__ = ["BRIDGE"]

NAME: Final = "vllm"


def declared_image_token(engine: object | None) -> str | None:
    """Nothing: vLLM expands the checkpoint's own placeholder string (``contract``)."""
    del engine
    return None


def _same_name(reasoning_parser: str) -> str:
    return reasoning_parser  # our parser names are vLLM's


def _emulate(model_dir: Path, tokenizer: Tokenizer) -> EmulatedContract:
    from dynamo_prep.engines.vllm.contract import emulated_contract  # noqa: PLC0415 - loads the formatter

    return emulated_contract(model_dir, tokenizer)


BRIDGE: Final = EngineBridge(
    name=NAME,
    check_options=refuse_mock_options(NAME),
    engine_argv=engine_argv,
    reasoning_flags=reasoning_flags_by(_same_name),
    start="dynamo_prep.engines.vllm.runtime:VllmRuntime",
    kv_dialect=KvDialect(needs_enable=True, bind_marks=("*", "::")),
    emulate=_emulate,
    declared_image_token=declared_image_token,
)
