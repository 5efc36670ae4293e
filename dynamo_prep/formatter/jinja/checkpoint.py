"""What a checkpoint directory tells the chat template: the template text and the special tokens.

Read as transformers reads them:

* Special tokens: ``bos/eos/unk/sep/pad/cls/mask_token`` from ``tokenizer_config.json``, plus any
  other ``*_token`` key holding an AddedToken and the named ``extra_special_tokens`` map (e.g.
  ``image_token``), strings or AddedToken dicts.
* Template lookup: ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template``;
  a named list must hold ``"default"``, and ``"tool_use"`` is used when tools are given.

Not read: the ``chat_templates/`` directory and ``special_tokens_map.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from dynamo_prep.formatter.jinja.environment import ChatTemplateError

__all__ = [
    "NAMED_SPECIAL_TOKENS",
    "ChatTemplates",
    "find_templates",
    "image_token_from_config",
    "registered_specials_from_config",
    "special_tokens_from_config",
]

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplates(NamedTuple):
    """A checkpoint's chat templates and where they were read from (for error messages)."""

    default: str
    tool_use: str | None
    source: str


def _token_text(value: object, *, strict: bool = False) -> str | None:
    """A token from tokenizer_config: a string, or an AddedToken dict (``{"content": ...}``).

    ``strict`` wants the ``"__type": "AddedToken"`` marker, as transformers does for tokens
    it only picks up because their key ends in ``_token``.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        return None
    if strict and value.get("__type") != "AddedToken":
        return None
    return str(value["content"])


def special_tokens_from_config(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens transformers passes to templates, read from ``tokenizer_config.json``."""
    tokens: dict[str, str] = {}
    for key, value in tokenizer_config.items():
        if key in NAMED_SPECIAL_TOKENS or key.endswith("_token"):
            text = _token_text(value, strict=key not in NAMED_SPECIAL_TOKENS)
            if text is not None:
                tokens[key] = text
    extra = tokenizer_config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if (text := _token_text(value)) is not None:
                tokens[str(key)] = text
    return tokens


def registered_specials_from_config(tokenizer_config: Mapping[str, Any]) -> list[str]:
    """Every special-token string a tokenizer built from ``tokenizer_config.json`` registers."""
    strings = list(special_tokens_from_config(tokenizer_config).values())
    decoder = tokenizer_config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        strings.extend(text for entry in decoder.values() if (text := _token_text(entry)) is not None)
    additional = tokenizer_config.get("additional_special_tokens")
    if isinstance(additional, list):
        strings.extend(text for entry in additional if (text := _token_text(entry)) is not None)
    return strings


def _templates_from_config(value: object, source: str) -> dict[str, str]:
    """``chat_template`` as a string or HF's named list ``[{"name": ..., "template": ...}]``."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        templates = {k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str)}
        if len(templates) == len(value):
            return templates
    raise ChatTemplateError(
        f"{source}: chat_template must be a string or a list of {{name, template}} objects"
    )


def find_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplates:
    """The checkpoint's templates; ``chat_template.jinja`` wins, as in transformers."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplates(jinja_file.read_text(encoding="utf-8"), None, str(jinja_file))
    source = str(model_dir / "tokenizer_config.json")
    if tokenizer_config.get("chat_template") is None:
        raise ChatTemplateError(
            f"{model_dir}: no chat template "
            "(expected chat_template.jinja or a chat_template entry in tokenizer_config.json)"
        )
    templates = _templates_from_config(tokenizer_config["chat_template"], source)
    if "default" not in templates:
        names = ", ".join(sorted(templates))
        raise ChatTemplateError(f"{source}: named chat templates ({names}) have no 'default'")
    return ChatTemplates(templates["default"], templates.get("tool_use"), source)


def image_token_from_config(config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> str | None:
    """config.json ``image_token``, else ``image_token_id`` looked up in ``added_tokens_decoder``."""
    if isinstance(token := config.get("image_token"), str):
        return token
    token_id = config.get("image_token_id")
    decoder = tokenizer_config.get("added_tokens_decoder")
    if isinstance(token_id, int) and isinstance(decoder, dict):
        return _token_text(decoder.get(str(token_id)))
    return None
