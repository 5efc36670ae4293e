"""Write a tiny model directory a REAL engine can serve on the CPU with dummy weights.

The tokenizer files and chat template are the ``qwen-vl-demo`` model's (the frontend renders and
tokenizes with them); ``config.json`` is a text-only ``Qwen2ForCausalLM`` with the same vocabulary
size, small enough that vLLM's CPU build starts in about 30 s and streams a token every few ms
with ``--load-format dummy --skip-tokenizer-init`` (random weights, no download, ids in and out).
CPU attention needs ``head_dim`` >= 64 and a ``--block-size`` that is a multiple of 32.

With ``--tokenizer-json`` it writes a ``tokenizer.json`` converted from the demo vocabulary
(transformers' TikTokenConverter: the same ids) in place of ``tiktoken.model``, so the engine loads
its own tokenizer (no ``--skip-tokenizer-init``), as structured outputs need (grammars are built
over its vocabulary), and the frontend reads the same file through ``tokenizers``.

Usage: python scripts/make_engine_model.py OUT_DIR [--max-position-embeddings N] [--tokenizer-json]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parent.parent / "dynamo_prep" / "models" / "qwen-vl-demo"
COPIED = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def engine_config(demo: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """A 2-layer Qwen2 decoder over the demo vocabulary (its special ids kept)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": demo["vocab_size"],
        "bos_token_id": demo["bos_token_id"],
        "eos_token_id": demo["eos_token_id"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_engine_model(
    out: Path, *, max_position_embeddings: int = 4096, tokenizer_json: bool = False
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if not (tokenizer_json and name == "tiktoken.model"):  # a directory holds one tokenizer
            shutil.copyfile(DEMO / name, out / name)
    demo = json.loads((DEMO / "config.json").read_text(encoding="utf-8"))
    config = engine_config(demo, max_position_embeddings)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if tokenizer_json:
        write_tokenizer_json(out)
    return out


def write_tokenizer_json(out: Path) -> Path:
    """The demo vocabulary as a Hugging Face ``tokenizer.json`` (needs transformers): byte-level BPE
    from the tiktoken ranks, our pre-tokenization pattern, our special tokens at our ids."""
    from transformers.convert_slow_tokenizer import TikTokenConverter  # noqa: PLC0415 - engines' venv only

    from dynamo_prep.tokenizer import Tokenizer  # noqa: PLC0415

    encoding = Tokenizer.from_model_dir(DEMO).encoding
    converter = TikTokenConverter(
        vocab_file=str(DEMO / "tiktoken.model"),
        pattern=encoding._pat_str,
        extra_special_tokens=encoding._special_tokens,
    )
    path = out / "tokenizer.json"
    converter.converted().save(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument("--tokenizer-json", action="store_true", help="tokenizer.json, not tiktoken.model")
    args = parser.parse_args()
    out = write_engine_model(
        args.out, max_position_embeddings=args.max_position_embeddings, tokenizer_json=args.tokenizer_json
    )
    print(out)


if __name__ == "__main__":
    main()
