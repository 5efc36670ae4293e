"""SGLang as a plug-in engine (``--engine sglang``; the mock's ``--flavor sglang``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from dynamo_prep.engines.bridge import (
    EmulatedContract,
    EngineBridge,
    KvDialect,
    reasoning_flags_by,
    refuse_mock_options,
)
from dynamo_prep.engines.sglang.declare import declared_image_token
from dynamo_prep.engines.sglang.translate import engine_argv

if TYPE_CHECKING:
    from dynamo_prep.tokenizer import Tokenizer

__all__ = ["BRIDGE", "FORMATS"]

NAME: Final = "sglang"
# ``--kv-events-config`` ``format``: both send the same events (see ``engines.kv_config``).
FORMATS: Final = ("default", "dynamo")
# SGLang's own --reasoning-parser for ours (vLLM's names); absent: SGLang has none.
_REASONING: Final[Mapping[str, str]] = MappingProxyType(
    {
        "qwen3": "qwen3",
        "deepseek_r1": "deepseek-r1",
        "deepseek_v3": "deepseek-v3",
        "kimi_k3": "kimi_k3",
        "openai_gptoss": "gpt-oss",
        "glm45": "glm45",
        "mistral": "mistral",
    }
)


def _emulate(model_dir: Path, tokenizer: Tokenizer) -> EmulatedContract:
    from dynamo_prep.engines.sglang.contract import emulated_contract  # noqa: PLC0415 - the mock's only

    return emulated_contract(model_dir, tokenizer)


BRIDGE: Final = EngineBridge(
    name=NAME,
    check_options=refuse_mock_options(NAME),
    engine_argv=engine_argv,
    reasoning_flags=reasoning_flags_by(_REASONING.get),
    start="dynamo_prep.engines.sglang.runtime:SglangRuntime",
    kv_dialect=KvDialect(
        needs_enable=False, bind_marks=("*", "::", "0.0.0.0"), honours_bind=True, formats=FORMATS
    ),
    emulate=_emulate,
    declared_image_token=declared_image_token,
)
