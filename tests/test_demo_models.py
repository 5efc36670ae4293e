"""Demo models: the committed package data is exactly what the generator writes, and it loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.models import DEMO_MODEL_NAMES, DEMO_MODELS_DIR
from dynamo_prep.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEMO_BASE = 8192
IMAGE = {"type": "image_url", "image_url": {"url": "http://example.test/a.png"}}


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def test_committed_demo_models_equal_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_demo_models.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(DEMO_MODEL_NAMES)
    for name in DEMO_MODEL_NAMES:
        fresh, committed = files_of(tmp_path / name), files_of(DEMO_MODELS_DIR / name)
        assert sorted(committed) == sorted(fresh), name
        for file_name, data in fresh.items():
            assert committed[file_name] == data, f"{name}/{file_name} differs: run `make demo-models`"


def test_demo_vocabulary_is_the_cl100k_prefix(cl100k_rank_bytes: bytes) -> None:
    expected = b"".join(line + b"\n" for line in cl100k_rank_bytes.splitlines()[:DEMO_BASE])
    for name in DEMO_MODEL_NAMES:
        assert (DEMO_MODELS_DIR / name / "tiktoken.model").read_bytes() == expected


def test_k3_demo_loads_with_k3_specials(k3_demo_tokenizer: Tokenizer) -> None:
    tok = k3_demo_tokenizer
    config = json.loads((DEMO_MODELS_DIR / "kimi-k3-demo" / "config.json").read_text())
    media_pad = tok.token_to_id("<|media_pad|>")
    assert media_pad == DEMO_BASE + 21 == config["media_placeholder_token_id"]
    assert tok.is_special_token("<|media_pad|>")
    assert media_pad in tok.all_special_ids
    assert tok.encode("<|media_pad|>", allow_special=True) == [media_pad]
    assert tok.n_vocab == config["text_config"]["vocab_size"] == DEMO_BASE + 256
    assert tok.bos_token_id == config["bos_token_id"]
    assert tok.eos_token_ids == (DEMO_BASE + 2, DEMO_BASE + 1)
    assert len(tok.all_special_ids) == 13
    assert not tok.is_special_token(config["image_placeholder"])


def test_qwen_demo_loads_with_vision_specials(qwen_demo_tokenizer: Tokenizer) -> None:
    tok = qwen_demo_tokenizer
    config = json.loads((DEMO_MODELS_DIR / "qwen-vl-demo" / "config.json").read_text())
    assert tok.model_type == "qwen2_vl"
    assert tok.is_special_token("<|image_pad|>")
    assert tok.token_to_id("<|image_pad|>") == config["image_token_id"]
    assert tok.token_to_id("<|video_pad|>") == config["video_token_id"]
    assert tok.token_to_id("<|vision_start|>") == config["vision_start_token_id"]
    assert config["image_token_id"] in tok.all_special_ids
    assert len(tok.all_special_ids) == 14
    assert tok.eos_token_ids[0] == config["eos_token_id"] == tok.token_to_id("<|im_end|>")


@pytest.mark.parametrize(("name", "context_length"), [("kimi-k3-demo", 8192), ("qwen-vl-demo", 32768)])
def test_demo_models_make_cards(name: str, context_length: int) -> None:
    card = ModelDeploymentCard.from_model_dir(name)
    assert card.context_length == context_length
    assert "tiktoken.model" in card.files


# --- the Qwen-VL-style chat template -----------------------------------------------------------


def render(**context: Any) -> str:
    """Render the demo template in an environment set up like transformers'."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    source = (DEMO_MODELS_DIR / "qwen-vl-demo" / "chat_template.jinja").read_text()
    context.setdefault("tools", None)
    context.setdefault("add_generation_prompt", False)
    return env.from_string(source).render(**context)


def test_template_default_system_and_generation_prompt() -> None:
    text = render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_images_and_text_parts() -> None:
    content = [IMAGE, {"type": "text", "text": "what?"}, {"type": "image", "image": "x.png"}]
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": content}]
    assert render(messages=messages) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>what?<|vision_start|><|image_pad|><|vision_end|>"
        "<|im_end|>\n"
    )


def test_template_tools_calls_and_responses(qwen_demo_tokenizer: Tokenizer) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    calls = [
        {
            "id": "1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
    ]
    messages = [
        {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "2", "content": "rain"},
    ]
    text = render(messages=messages, tools=[tool], add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    ids = qwen_demo_tokenizer.encode(text, allow_special=True)
    assert ids.count(qwen_demo_tokenizer.token_to_id("<|im_start|>")) == 5
