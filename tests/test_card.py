"""Model cards: reading model directories, checksums, and the wire format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_prep.card import (
    CardDecodeError,
    FileRef,
    ModelCardError,
    ModelDeploymentCard,
    ModelRuntimeConfig,
    decode_card,
    encode_card,
)


def write_model_dir(path: Path, **overrides: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "kimi_k3", "max_position_embeddings": 4096, **overrides}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
    (path / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")
    return path


def test_from_model_dir_reads_files_with_checksums(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "Kimi-K3-Test")
    (model / "generation_config.json").write_text('{"eos_token_id": 2}')
    card = ModelDeploymentCard.from_model_dir(model)
    assert card.display_name == "Kimi-K3-Test"
    assert card.slug == "kimi-k3-test"
    assert card.model_type == "kimi_k3"
    assert card.context_length == 4096
    assert card.model_input == "tokens"
    assert sorted(card.files) == [
        "config.json",
        "generation_config.json",
        "tiktoken.model",
        "tokenizer_config.json",
    ]
    assert card.files["tiktoken.model"].size == len("IQ== 0\nIg== 1\n")
    assert len(card.files["config.json"].sha256) == 64


def test_served_name_and_single_tiktoken_file(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "m")
    (model / "tiktoken.model").rename(model / "vocab.tiktoken")
    card = ModelDeploymentCard.from_model_dir(model, served_name="org/My Model")
    assert card.display_name == "org/My Model"
    assert card.slug == "org-my-model"
    assert "tiktoken.model" in card.files


def test_context_length_from_text_config(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "m", max_position_embeddings=None, text_config={"seq_length": 1234})
    assert ModelDeploymentCard.from_model_dir(model).context_length == 1234


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "config.json: required file is missing"),
        (lambda d: (d / "tiktoken.model").unlink(), "no tokenizer file"),
        (lambda d: (d / "extra.tiktoken").write_text("x"), "two or more tokenizer files"),
        (
            lambda d: (d / "tokenizer_config.json").write_text("{oops"),
            "tokenizer_config.json: malformed JSON",
        ),
        (lambda d: (d / "config.json").write_text("[1]"), "config.json: expected a JSON object"),
        (lambda d: (d / "config.json").write_text("{}"), "no context length"),
    ],
)
def test_bad_model_dirs_name_the_problem(tmp_path: Path, breakage: Any, message: str) -> None:
    model = write_model_dir(tmp_path / "m")
    breakage(model)
    with pytest.raises(ModelCardError, match=message):
        ModelDeploymentCard.from_model_dir(model)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelCardError, match="model directory not found"):
        ModelDeploymentCard.from_model_dir(tmp_path / "nope")


def test_mdcsum_covers_contents_not_paths_or_runtime(tmp_path: Path) -> None:
    card_a = ModelDeploymentCard.from_model_dir(write_model_dir(tmp_path / "a"), served_name="m")
    card_b = ModelDeploymentCard.from_model_dir(
        write_model_dir(tmp_path / "elsewhere" / "b"),
        served_name="m",
        migration_limit=3,
        runtime_config=ModelRuntimeConfig(image_placeholder_token="<|media_pad|>", max_num_seqs=8),
    )
    card_b.user_data = {"rack": 7}
    assert card_a.mdcsum() == card_b.mdcsum()
    assert len(card_a.mdcsum()) == 64

    changed = write_model_dir(tmp_path / "c")
    (changed / "tiktoken.model").write_text("IQ== 0\n")
    assert ModelDeploymentCard.from_model_dir(changed, served_name="m").mdcsum() != card_a.mdcsum()
    bigger = ModelDeploymentCard.from_model_dir(write_model_dir(tmp_path / "d", max_position_embeddings=8192))
    assert msgspec.structs.replace(bigger, display_name="m").mdcsum() != card_a.mdcsum()
    other_block = msgspec.structs.replace(card_a, kv_cache_block_size=32)
    assert other_block.mdcsum() != card_a.mdcsum()
    assert other_block.mdcsum_fields()["kv_cache_block_size"] == 32


def test_mdcsum_is_pinned() -> None:
    """A digest change breaks every mixed-version cluster: it must be deliberate."""
    card = ModelDeploymentCard(
        display_name="m",
        slug="m",
        model_type="kimi_k3",
        context_length=10,
        files={"config.json": FileRef(sha256="ab", size=2)},
    )
    assert card.mdcsum() == "7e54790867ea42e1a793134ed18147b18a2ee1ea18fd10b88c85b157f1c9654c"
    assert decode_card(encode_card(card)).card.mdcsum() == card.mdcsum()


def test_round_trip(tmp_path: Path) -> None:
    card = ModelDeploymentCard.from_model_dir(
        write_model_dir(tmp_path / "m"),
        runtime_config=ModelRuntimeConfig(
            image_placeholder_token="<|media_pad|>",
            total_kv_blocks=100,
            runtime_data={"engine": "sglang"},
        ),
    )
    result = decode_card(encode_card(card))
    assert result.card == card
    assert result.legacy == {}


# The runtime config and card as they were before `image_placeholder_token` existed.
class PreFieldRuntimeConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    context_length: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    data_parallel_size: int = 1
    exclude_tools_when_tool_choice_none: bool = True
    runtime_data: dict[str, Any] = {}


def test_non_declaring_worker_is_byte_identical_to_a_pre_field_card(tmp_path: Path) -> None:
    card = ModelDeploymentCard.from_model_dir(
        write_model_dir(tmp_path / "m"),
        runtime_config=ModelRuntimeConfig(total_kv_blocks=512, max_num_seqs=16),
    )
    old_runtime = PreFieldRuntimeConfig(total_kv_blocks=512, max_num_seqs=16)
    old_card = msgspec.structs.asdict(card) | {"runtime_config": old_runtime}
    assert encode_card(card) == msgspec.msgpack.encode(old_card)
    declaring = msgspec.structs.replace(
        card,
        runtime_config=ModelRuntimeConfig(total_kv_blocks=512, max_num_seqs=16, image_placeholder_token="x"),
    )
    assert encode_card(declaring) != encode_card(card)


def _wire(card: ModelDeploymentCard, **runtime_extra: Any) -> bytes:
    raw = msgspec.to_builtins(card)
    raw["runtime_config"].update(runtime_extra)
    return msgspec.msgpack.encode(raw)


def test_legacy_expands_image_pad_token_decodes_to_none(tmp_path: Path) -> None:
    card = ModelDeploymentCard.from_model_dir(write_model_dir(tmp_path / "m"))
    result = decode_card(_wire(card, expands_image_pad_token=True))
    assert result.card.runtime_config.image_placeholder_token is None
    assert result.legacy == {"expands_image_pad_token": True}
    assert result.card == card


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    card = ModelDeploymentCard.from_model_dir(write_model_dir(tmp_path / "m"))
    raw = msgspec.to_builtins(card) | {"future_field": [1, 2]}
    raw["runtime_config"]["enable_local_indexer"] = False
    assert decode_card(msgspec.msgpack.encode(raw)).card == card


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda raw: raw["runtime_config"].update(max_num_seqs="many"), "$.runtime_config.max_num_seqs"),
        (lambda raw: raw.update(context_length="long"), "$.context_length"),
        (lambda raw: raw["files"].update({"config.json": {"sha256": 1, "size": 2}}), "$.files[...].sha256"),
        (
            lambda raw: raw["runtime_config"].update(data_parallel_size=5000),
            "$.runtime_config.data_parallel_size",
        ),
        (
            lambda raw: raw["runtime_config"].update(expands_image_pad_token="yes"),
            "$.runtime_config.expands_image_pad_token",
        ),
    ],
)
def test_wrong_types_name_the_field_path(tmp_path: Path, mutate: Any, path: str) -> None:
    raw = msgspec.to_builtins(ModelDeploymentCard.from_model_dir(write_model_dir(tmp_path / "m")))
    mutate(raw)
    with pytest.raises(CardDecodeError) as excinfo:
        decode_card(msgspec.msgpack.encode(raw))
    assert path in str(excinfo.value)


def test_garbage_is_a_decode_error() -> None:
    with pytest.raises(CardDecodeError, match="undecodable"):
        decode_card(b"\xc1\xff")
    with pytest.raises(CardDecodeError, match="Expected `object`"):
        decode_card(msgspec.msgpack.encode([1, 2]))
