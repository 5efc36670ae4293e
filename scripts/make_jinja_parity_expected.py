"""Render the Jinja parity cases with real transformers and write the expected outputs.

The committed expectations let ``make test`` check ``JinjaFormatter`` byte for byte against
transformers without installing it. Run this in a separate venv (no torch needed)::

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install transformers jinja2
    /tmp/tfvenv/bin/python scripts/make_jinja_parity_expected.py

Every case builds a real offline tokenizer (a one-word WordLevel vocabulary) carrying the case's
special tokens and template, and calls ``apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jinja2
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def build_tokenizer(template: str, special_tokens: dict[str, str]) -> Any:
    """A real PreTrainedTokenizerFast without any download: named tokens plus model-specific extras."""
    named = {key: value for key, value in special_tokens.items() if key in NAMED_SPECIAL_TOKENS}
    extra = {key: value for key, value in special_tokens.items() if key not in NAMED_SPECIAL_TOKENS}
    backend = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, extra_special_tokens=extra or None, **named
    )


def render_case(case: dict[str, Any], templates_dir: Path) -> dict[str, Any]:
    """``{"text": ...}`` or ``{"error": message, "error_type": name}`` for one case."""
    template = (templates_dir / case["template"]).read_text(encoding="utf-8")
    tokenizer = build_tokenizer(template, case.get("special_tokens", {}))
    try:
        text = tokenizer.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            documents=case.get("documents"),
            add_generation_prompt=case.get("add_generation_prompt", False),
            tokenize=False,
            **case.get("kwargs", {}),
        )
    except Exception as exc:
        return {"error": str(exc), "error_type": type(exc).__name__}
    return {"text": text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=DATA / "jinja_parity_cases.json")
    parser.add_argument("--templates", type=Path, default=DATA / "chat_templates")
    parser.add_argument("--out", type=Path, default=DATA / "jinja_parity_expected.json")
    args = parser.parse_args(argv)

    cases = json.loads(args.cases.read_text(encoding="utf-8"))
    results = {case["name"]: render_case(case, args.templates) for case in cases}
    expected = {
        "transformers_version": transformers.__version__,
        "jinja2_version": jinja2.__version__,
        "cases": results,
    }
    args.out.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    errors = sum("error" in result for result in results.values())
    print(
        f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}: "
        f"{len(results)} cases ({errors} expected errors) -> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
