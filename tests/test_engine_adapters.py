"""Engine adapters: the declared image token, read from stand-ins shaped like SGLang's classes."""

from __future__ import annotations

import json
import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from dynamo_prep.card import ModelCardError
from dynamo_prep.engines.mock.standins import (
    EngineStandIn,
    ImageProcessorStandIn,
    KimiK3ImageProcessorStandIn,
    MultimodalSpecialTokens,
    QwenVLImageProcessorStandIn,
    TokenizerManagerStandIn,
    sglang_engine_standin,
)
from dynamo_prep.engines.registry import bridge
from dynamo_prep.engines.sglang import declare as sglang
from dynamo_prep.engines.vllm import contract as vllm
from dynamo_prep.models import DEMO_MODELS_DIR

K3_CONFIG = json.loads((DEMO_MODELS_DIR / "kimi-k3-demo" / "config.json").read_text())
QWEN_CONFIG = json.loads((DEMO_MODELS_DIR / "qwen-vl-demo" / "config.json").read_text())


def engine_with(processor: object) -> EngineStandIn:
    return EngineStandIn(tokenizer_manager=TokenizerManagerStandIn(mm_processor=processor))  # type: ignore[arg-type]


def processor_with(image_token: Any) -> ImageProcessorStandIn:
    return ImageProcessorStandIn({}, MultimodalSpecialTokens(image_token=image_token, image_token_id=7))


class LlavaProcessorStandIn:
    """LLaVA-style: a processor with no ``mm_tokens`` attribute at all."""

    image_token_index = 32000


class NoManagerEngine:
    """An encode-only worker's engine: no tokenizer manager."""


class ExplodingProcessor:
    """A half-built processor whose property raises something other than AttributeError."""

    @property
    def mm_tokens(self) -> MultimodalSpecialTokens:
        raise RuntimeError("processor not initialised")


def events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


# --- sglang.declared_image_token ----------------------------------------------------------------


def test_k3_processor_declares_media_pad() -> None:
    engine = engine_with(KimiK3ImageProcessorStandIn(K3_CONFIG))
    assert sglang.declared_image_token(engine) == "<|media_pad|>"


def test_qwen_multi_token_spelling_is_returned_as_is() -> None:
    engine = engine_with(QwenVLImageProcessorStandIn(QWEN_CONFIG))
    assert sglang.declared_image_token(engine) == "<|vision_start|><|image_pad|><|vision_end|>"


def test_text_only_model_declares_nothing() -> None:
    with structlog.testing.capture_logs() as logs:
        assert sglang.declared_image_token(engine_with(None)) is None
    assert [entry["reason"] for entry in events(logs, "declared_image_token_absent")] == ["text_only"]
    assert events(logs, "declared_image_token_absent")[0]["log_level"] == "debug"


@pytest.mark.parametrize("engine", [None, NoManagerEngine(), EngineStandIn(tokenizer_manager=None)])
def test_no_engine_or_no_tokenizer_manager_declares_nothing(engine: object | None) -> None:
    with structlog.testing.capture_logs() as logs:
        assert sglang.declared_image_token(engine) is None
    expected = "no_engine" if engine is None else "no_tokenizer_manager"
    assert [entry["reason"] for entry in events(logs, "declared_image_token_absent")] == [expected]


def test_processor_without_mm_tokens_has_its_own_log_line() -> None:
    with structlog.testing.capture_logs() as logs:
        assert sglang.declared_image_token(engine_with(LlavaProcessorStandIn())) is None
    assert logs == [
        {
            "event": "declared_image_token_no_mm_tokens",
            "log_level": "info",
            "processor": "LlavaProcessorStandIn",
        }
    ]


def test_list_with_one_distinct_spelling_is_that_spelling() -> None:
    with structlog.testing.capture_logs() as logs:
        token = sglang.declared_image_token(engine_with(processor_with(["<|media_pad|>", "<|media_pad|>"])))
    assert token == "<|media_pad|>"
    assert not [entry for entry in logs if entry["log_level"] == "warning"]


@pytest.mark.parametrize("spellings", [["<|media_pad|>", "<|image_pad|>"], ("<a>", "<b>", "<a>")])
def test_several_distinct_spellings_are_declined_with_a_warning(spellings: list[str] | tuple[str]) -> None:
    with structlog.testing.capture_logs() as logs:
        assert sglang.declared_image_token(engine_with(processor_with(spellings))) is None
    declined = events(logs, "declared_image_token_declined")
    assert len(declined) == 1
    assert declined[0]["log_level"] == "warning"
    assert declined[0]["spellings"] == list(dict.fromkeys(spellings))
    assert declined[0]["processor"] == "ImageProcessorStandIn"


@pytest.mark.parametrize("value", ["", None, 163605, [], ["<|media_pad|>", 3], [""]])
def test_empty_or_other_types_are_none_with_a_warning(value: object) -> None:
    with structlog.testing.capture_logs() as logs:
        assert sglang.declared_image_token(engine_with(processor_with(value))) is None
    invalid = events(logs, "declared_image_token_invalid")
    assert len(invalid) == 1
    assert invalid[0]["log_level"] == "warning"
    assert invalid[0]["value_type"] == type(value).__name__


def test_a_raising_attribute_never_escapes() -> None:
    with structlog.testing.capture_logs() as logs:
        assert sglang.declared_image_token(engine_with(ExplodingProcessor())) is None
    assert [entry["event"] for entry in logs] == [
        "declared_image_token_read_failed",
        "declared_image_token_no_mm_tokens",
    ]


# --- the stand-ins ---------------------------------------------------------------------------------


def test_k3_standin_is_shaped_like_sglangs_kimi_k3_processor() -> None:
    engine = sglang_engine_standin("kimi-k3-demo")
    assert engine.tokenizer_manager is not None
    processor = engine.tokenizer_manager.mm_processor
    assert isinstance(processor, KimiK3ImageProcessorStandIn)
    mm_tokens = processor.mm_tokens
    assert mm_tokens.image_token == "<|media_pad|>"
    assert mm_tokens.image_token_id == K3_CONFIG["media_placeholder_token_id"]
    assert mm_tokens.image_token_regex is not None
    assert mm_tokens.image_token_regex.fullmatch("<|media_pad|><|media_pad|>")
    assert sglang.declared_image_token(engine) == "<|media_pad|>"


def test_qwen_standin_counts_the_image_pad_id() -> None:
    engine = sglang_engine_standin("qwen-vl-demo")
    assert engine.tokenizer_manager is not None
    processor = engine.tokenizer_manager.mm_processor
    assert isinstance(processor, QwenVLImageProcessorStandIn)
    assert processor.mm_tokens.image_token_id == QWEN_CONFIG["image_token_id"]
    regex = processor.mm_tokens.image_token_regex
    assert isinstance(regex, re.Pattern)
    assert regex.fullmatch("<|vision_start|><|image_pad|><|image_pad|><|vision_end|>")


def model_dir_with(tmp_path: Path, **config: Any) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_text_model_standin_has_no_processor(tmp_path: Path) -> None:
    engine = sglang_engine_standin(model_dir_with(tmp_path, model_type="qwen2"))
    assert engine.tokenizer_manager is not None
    assert engine.tokenizer_manager.mm_processor is None
    assert sglang.declared_image_token(engine) is None


def test_k3_standin_without_media_placeholder_id_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelCardError, match=r"config\.json: media_placeholder_token_id"):
        sglang_engine_standin(model_dir_with(tmp_path, model_type="kimi_k3"))


# --- vllm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", [None, object(), engine_with(KimiK3ImageProcessorStandIn(K3_CONFIG))])
def test_vllm_declares_nothing(engine: object | None) -> None:
    assert bridge("vllm").declared_image_token(engine) is None


def test_the_flavor_picks_the_adapter() -> None:
    engine = engine_with(KimiK3ImageProcessorStandIn(K3_CONFIG))
    assert bridge("sglang").declared_image_token(engine) == "<|media_pad|>"
    with pytest.raises(ValueError, match="unknown --engine 'trtllm'"):
        bridge("trtllm").declared_image_token(engine)


def test_vllm_expands_the_checkpoint_placeholder(tmp_path: Path) -> None:
    assert vllm.expanded_image_placeholder("kimi-k3-demo") == "<|kimi_image_placeholder|>"
    assert vllm.expanded_image_placeholder("qwen-vl-demo") is None
    assert vllm.expanded_image_placeholder(model_dir_with(tmp_path, model_type="kimi_k3")) == (
        "<|kimi_image_placeholder|>"
    )
    custom = tmp_path / "custom"
    custom.mkdir()
    assert vllm.expanded_image_placeholder(model_dir_with(custom, image_placeholder="<img>")) == "<img>"


def test_kimi_k25_checkpoints_get_sglangs_kimi_k3_processor(tmp_path: Path) -> None:
    engine = sglang_engine_standin(model_dir_with(tmp_path, **{**K3_CONFIG, "model_type": "kimi_k25"}))
    assert engine.tokenizer_manager is not None
    assert isinstance(engine.tokenizer_manager.mm_processor, KimiK3ImageProcessorStandIn)
    assert sglang.declared_image_token(engine) == "<|media_pad|>"


def test_without_a_model_type_the_directory_name_decides_kimi_k3(tmp_path: Path) -> None:
    """The formatter's rule (``dynamo_prep.formatter.is_kimi_k3``), so engine and prompt agree."""
    config = {key: K3_CONFIG[key] for key in K3_CONFIG if key not in ("model_type", "image_placeholder")}
    named = tmp_path / "my-kimi-k3"
    named.mkdir()
    engine = sglang_engine_standin(model_dir_with(named, **config))
    assert engine.tokenizer_manager is not None
    assert isinstance(engine.tokenizer_manager.mm_processor, KimiK3ImageProcessorStandIn)
    assert vllm.expanded_image_placeholder(named) == "<|kimi_image_placeholder|>"
    other = tmp_path / "other"
    other.mkdir()
    assert vllm.expanded_image_placeholder(model_dir_with(other, **config)) is None
