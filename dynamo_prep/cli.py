"""The ``dynamo-prep`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.formatter import prompt_formatter_for
from dynamo_prep.logging import configure_logging
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessError
from dynamo_prep.tokenizer import Tokenizer

EXIT_ERROR = 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynamo-prep`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(level=args.log_level)
    result: int = args.handler(args)
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynamo-prep", description=__doc__)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)
    render = commands.add_parser("render", help="render and tokenize one chat request, print JSON")
    render.add_argument("--model-path", required=True, help="model directory, or kimi-k3-demo / qwen-vl-demo")
    render.add_argument("--served-name", default=None, help="model name (default: the directory name)")
    render.add_argument("--image-token", default=None, help="the per-image token a worker would declare")
    render.add_argument("--hosted", action="store_true", help="Kimi-K3: stop before the channel opener")
    render.add_argument("request", type=Path, help="OpenAI chat completion request JSON ('-' for stdin)")
    render.set_defaults(handler=_render)
    return parser


def _render(args: argparse.Namespace) -> int:
    try:
        request = _read_request(args.request)
        model_dir = resolve_model_dir(args.model_path)
        card = ModelDeploymentCard.from_model_dir(
            model_dir,
            served_name=args.served_name,
            runtime_config=ModelRuntimeConfig(image_placeholder_token=args.image_token),
        )
        formatter = prompt_formatter_for(
            card,
            model_dir,
            image_placeholder_token=args.image_token,
            generation_prompt="hosted" if args.hosted else "reference",
        )
        preprocessor = OpenAIPreprocessor.new_with_parts(card, formatter, Tokenizer.from_model_dir(model_dir))
        prompt = preprocessor.tokenize(request)
    except (ValueError, OSError) as exc:  # PreprocessError, ModelCardError, TokenizerError
        _print_error(exc)
        return EXIT_ERROR
    segments = prompt.rendered.segments
    output = {
        "model": card.display_name,
        "formatter": formatter.kind,
        "image_token": formatter.image_token,
        "segments": None if segments is None else [[s.text, s.allow_special] for s in segments],
        "text": prompt.rendered.text,
        "token_ids": prompt.token_ids,
        "num_tokens": len(prompt.token_ids),
        "images": [image.url for image in prompt.images],
    }
    print(json.dumps(output, ensure_ascii=False, indent=2))
    return 0


def _read_request(path: Path) -> Any:
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PreprocessError(f"{path}: request is not valid JSON: {exc}") from exc


def _print_error(exc: Exception) -> None:
    error = {"message": str(exc), "type": "invalid_request_error", "code": 400}
    print(json.dumps({"error": error}, ensure_ascii=False), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
