"""Demo models: the committed package data is exactly what the generator writes, and it loads."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from support import hf_reference as ref

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.models import DEMO_MODEL_NAMES, DEMO_MODELS_DIR
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.tokenizer import HfTokenizer, Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEMO_BASE = 8192
TIKTOKEN_DEMOS = ("kimi-k3-demo", "qwen-vl-demo")
LLAMA = "llama3-demo"
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
    for name in TIKTOKEN_DEMOS:
        assert (DEMO_MODELS_DIR / name / "tiktoken.model").read_bytes() == expected
    llama = Tokenizer.from_model_dir(LLAMA)
    ranks = [base64.b64decode(line.split()[0]) for line in cl100k_rank_bytes.splitlines()[:DEMO_BASE]]
    assert [llama.token_bytes(token_id) for token_id in range(DEMO_BASE)] == ranks


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


@pytest.mark.parametrize(
    ("name", "context_length", "vocabulary"),
    [
        ("kimi-k3-demo", 8192, "tiktoken.model"),
        ("qwen-vl-demo", 32768, "tiktoken.model"),
        (LLAMA, 8192, "tokenizer.json"),
    ],
)
def test_demo_models_make_cards(name: str, context_length: int, vocabulary: str) -> None:
    card = ModelDeploymentCard.from_model_dir(name)
    assert card.context_length == context_length
    assert vocabulary in card.files


# --- the Llama-3.1-style demo: a tokenizer.json, Llama 3's specials, a JSON tool template ----------


LLAMA_SPECIALS = {
    "<|begin_of_text|>": 0,
    "<|end_of_text|>": 1,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "<|eom_id|>": 8,
    "<|eot_id|>": 9,
    "<|python_tag|>": 10,
    "<|reserved_special_token_3|>": 11,
    "<|reserved_special_token_247|>": 255,
}


def test_llama_demo_loads_with_tokenizers_and_llama_3_specials_at_their_offsets() -> None:
    tok = Tokenizer.from_model_dir(LLAMA)
    config = json.loads((DEMO_MODELS_DIR / LLAMA / "config.json").read_text())
    assert isinstance(tok, HfTokenizer) and tok.model_type == "llama"
    assert {name: tok.token_to_id(name) for name in LLAMA_SPECIALS} == {
        name: DEMO_BASE + offset for name, offset in LLAMA_SPECIALS.items()
    }
    assert all(tok.is_special_token(name) for name in LLAMA_SPECIALS)
    assert tok.n_vocab == config["vocab_size"] == DEMO_BASE + 256
    assert tok.bos_token_id == config["bos_token_id"] == DEMO_BASE
    assert list(tok.eos_token_ids) == config["eos_token_id"] == [DEMO_BASE + 1, DEMO_BASE + 8, DEMO_BASE + 9]
    assert tok.encode("<|python_tag|>") != [DEMO_BASE + 10]  # typed text stays text


LLAMA_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
LLAMA_CHATS = {
    "one_turn": {"messages": [{"role": "user", "content": "Hello there 日本語 🙂, 12345 cats"}]},
    "system": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    "tools_offered": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [LLAMA_TOOL]},
    "tools_in_the_system_message": {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [LLAMA_TOOL],
        "chat_template_kwargs": {"tools_in_user_message": False},
    },
    "calls_and_results": {
        "messages": [
            {"role": "user", "content": "Paris and Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "2", "content": "rain"},
        ],
        "tools": [LLAMA_TOOL],
    },
}


@pytest.mark.parametrize("case", list(LLAMA_CHATS))
def test_llama_demo_chat_ids_are_transformers_ids(case: str) -> None:
    preprocessor = OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir(LLAMA), DEMO_MODELS_DIR / LLAMA)
    request = {"model": LLAMA, **json.loads(json.dumps(LLAMA_CHATS[case]))}
    ours = preprocessor.tokenize(request).token_ids
    assert ours == ref.chat_ids(DEMO_MODELS_DIR / LLAMA, request)


def test_llama_demo_template_writes_calls_as_llama3_json_and_results_as_ipython_turns() -> None:
    text = ref.tokenizer(DEMO_MODELS_DIR / LLAMA).decode(
        ref.chat_ids(DEMO_MODELS_DIR / LLAMA, {"model": LLAMA, **LLAMA_CHATS["calls_and_results"]})
    )
    assert (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eom_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "sunny"}<|eot_id|>'
    ) in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "Environment: ipython\n" in text and '"name": "get_weather"' in text


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
