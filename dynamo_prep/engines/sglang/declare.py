"""SGLang: the per-image token a worker declares, read from the processor SGLang actually loaded.

SGLang's multimodal processor states its own prompt contract in ``mm_tokens.image_token`` (Kimi-K3:
one ``<|media_pad|>`` per image). Reading it from the loaded processor, instead of inferring it
from the model name, keeps the declaration true when SGLang's processors change. The reader
never raises: a worker that cannot tell declares nothing, and the frontend renders the
checkpoint default. Stand-ins shaped like SGLang's classes live in ``sglang_standins``.
"""

from __future__ import annotations

import structlog

__all__ = ["declared_image_token"]

log = structlog.get_logger("dynamo_prep.engines")

_ABSENT = object()
_MAX_LOGGED_CHARS = 200


def declared_image_token(engine: object | None) -> str | None:
    """``engine.tokenizer_manager.mm_processor.mm_tokens.image_token`` when it names one spelling.

    None (the checkpoint default is rendered) for: no engine or no tokenizer manager (e.g. an
    encode-only worker), a text-only model (``mm_processor is None``), a processor without
    ``mm_tokens`` (LLaVA-style), several distinct spellings (ambiguous: declined with a warning),
    or a value that is not a non-empty string.
    """
    if engine is None:
        _absent("no_engine")
        return None
    manager = _read(engine, "tokenizer_manager")
    if manager is None or manager is _ABSENT:
        _absent("no_tokenizer_manager")
        return None
    processor = _read(manager, "mm_processor")
    if processor is _ABSENT:
        _absent("no_mm_processor")
        return None
    if processor is None:
        _absent("text_only")
        return None
    processor_name = type(processor).__name__
    mm_tokens = _read(processor, "mm_tokens")
    if mm_tokens is None or mm_tokens is _ABSENT:
        log.info("declared_image_token_no_mm_tokens", processor=processor_name)
        return None
    image_token = _read(mm_tokens, "image_token")
    return _single_spelling(None if image_token is _ABSENT else image_token, processor_name)


def _read(obj: object, name: str) -> object:
    """``getattr`` that never raises: a half-built engine's properties may fail with anything."""
    try:
        return getattr(obj, name, _ABSENT)
    except Exception as exc:
        log.warning("declared_image_token_read_failed", attribute=name, error=repr(exc)[:_MAX_LOGGED_CHARS])
        return _ABSENT


def _absent(reason: str) -> None:
    log.debug("declared_image_token_absent", reason=reason)


def _single_spelling(value: object, processor: str) -> str | None:
    """SGLang's type hint allows a list of spellings; only one distinct spelling is a declaration."""
    token = value
    if isinstance(value, list | tuple) and value and all(isinstance(item, str) for item in value):
        spellings = list(dict.fromkeys(value))
        if len(spellings) > 1:
            log.warning("declared_image_token_declined", processor=processor, spellings=spellings)
            return None
        token = spellings[0]
    if isinstance(token, str) and token:
        log.debug("declared_image_token_read", processor=processor, token=token)
        return token
    log.warning(
        "declared_image_token_invalid",
        processor=processor,
        value_type=type(value).__name__,
        value=repr(value)[:_MAX_LOGGED_CHARS],
    )
    return None
