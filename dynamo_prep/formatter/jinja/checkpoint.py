"""What a checkpoint directory tells the chat template: the template text and the special tokens.

Read as transformers reads them:

* Special tokens: ``bos/eos/unk/sep/pad/cls/mask_token`` from ``tokenizer_config.json``, plus any
  other ``*_token`` key holding an AddedToken and the named ``extra_special_tokens`` map (e.g.
  ``image_token``), strings or AddedToken dicts.
* Template lookup: ``chat_template.jinja``, then a processor's ``chat_template.json``, then
  ``tokenizer_config.json``'s ``chat_template``; a named list must hold ``"default"``, and
  ``"tool_use"`` is used when tools are given.
* The per-image token: what the checkpoint's processor writes into the prompt for one image
  (``image_token_of``).

Not read: the ``additional_chat_templates/`` directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from dynamo_prep.card import ModelCardError, read_json
from dynamo_prep.formatter.jinja.environment import ChatTemplateError

__all__ = [
    "NAMED_SPECIAL_TOKENS",
    "ChatTemplates",
    "find_templates",
    "image_token_from_config",
    "image_token_of",
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
    for key in ("additional_special_tokens", "extra_special_tokens"):  # transformers 4 and 5 spellings
        listed = tokenizer_config.get(key)
        if isinstance(listed, list):
            strings.extend(text for entry in listed if (text := _token_text(entry)) is not None)
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
    """The checkpoint's templates: ``chat_template.jinja``, a processor's ``chat_template.json``,
    then ``tokenizer_config.json`` (vLLM asks the processor before the tokenizer)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplates(jinja_file.read_text(encoding="utf-8"), None, str(jinja_file))
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        try:
            value = read_json(json_file).get("chat_template")
        except ModelCardError as exc:
            raise ChatTemplateError(str(exc)) from exc
        return _chosen(value, str(json_file))
    if tokenizer_config.get("chat_template") is None:
        raise ChatTemplateError(
            f"{model_dir}: no chat template (expected chat_template.jinja, chat_template.json or a "
            "chat_template entry in tokenizer_config.json)"
        )
    return _chosen(tokenizer_config["chat_template"], str(model_dir / "tokenizer_config.json"))


def _chosen(value: object, source: str) -> ChatTemplates:
    templates = _templates_from_config(value, source)
    if "default" not in templates:
        names = ", ".join(sorted(templates))
        raise ChatTemplateError(f"{source}: named chat templates ({names}) have no 'default'")
    return ChatTemplates(templates["default"], templates.get("tool_use"), source)


class _ImageToken(NamedTuple):
    """Where a family's processor finds the token the template writes per image."""

    tokenizer_key: str | None  # the tokenizer attribute the processor reads, when it reads one
    default: str


# What transformers' (and vLLM's) processor for each model_type looks for in the rendered prompt,
# one per image, before expanding it: Qwen-VL's ``image_token``, Gemma 3's ``boi_token`` (the
# template writes ``<start_of_image>``; ``<image_soft_token>`` is what it expands to), Llama 4's and
# Mllama's ``<|image|>``. LLaVA-style processors (Pixtral's ``[IMG]`` too) save theirs in
# processor_config.json.
_FAMILY_IMAGE_TOKENS: Mapping[str, _ImageToken] = {
    **dict.fromkeys(
        ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "qwen3_vl", "qwen3_vl_moe"),
        _ImageToken("image_token", "<|image_pad|>"),
    ),
    "gemma3": _ImageToken("boi_token", "<start_of_image>"),
    "llama4": _ImageToken(None, "<|image|>"),
    "mllama": _ImageToken(None, "<|image|>"),
}
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def image_token_of(
    model_dir: Path, config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]
) -> str | None:
    """The token the checkpoint's processor expects once per image in the rendered prompt: the
    family's rule, else the processor's saved ``image_token``, else config.json's."""
    model_type = config.get("model_type")
    family = _FAMILY_IMAGE_TOKENS.get(model_type) if isinstance(model_type, str) else None
    if family is not None:
        named = _token_text(tokenizer_config.get(family.tokenizer_key)) if family.tokenizer_key else None
        return named or family.default
    for name in _PROCESSOR_FILES:
        path = model_dir / name
        try:
            saved = read_json(path).get("image_token") if path.is_file() else None
        except ModelCardError as exc:
            raise ChatTemplateError(str(exc)) from exc
        if isinstance(saved, str) and saved:
            return saved
    return image_token_from_config(config, tokenizer_config)


def image_token_from_config(config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> str | None:
    """config.json ``image_token``, else ``image_token_id`` looked up in ``added_tokens_decoder``."""
    if isinstance(token := config.get("image_token"), str):
        return token
    token_id = config.get("image_token_id")
    decoder = tokenizer_config.get("added_tokens_decoder")
    if isinstance(token_id, int) and isinstance(decoder, dict):
        return _token_text(decoder.get(str(token_id)))
    return None
