"""What each id of a ``tokenizer.json`` vocabulary adds to streamed text, as bytes.

Streamed text is the bytes of the ids joined and decoded as UTF-8 as they arrive, which is what
``tokenizers``' decoders compute for the decoders real checkpoints use: byte-level BPE maps each
character of a token back to its byte, SentencePiece vocabularies turn ``▁`` into a space and
``<0xNN>`` pieces into their byte. Decoders that only act on the first token of a whole decode
(``Strip`` after ``Fuse``, ``Metaspace``'s prefix) do not apply: an answer continues its prompt,
as vLLM's incremental detokenizer, primed with the prompt, streams it. A decoder with no per-token
form here (WordPiece, CTC, ...) falls back to each token decoded alone, and says so.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import structlog
import tokenizers

__all__ = ["stream_bytes_table"]

log = structlog.get_logger()

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_Step = Callable[[str | bytes], str | bytes]


def stream_bytes_table(
    tokenizer: tokenizers.Tokenizer, spec: object, size: int, source: Path
) -> tuple[list[bytes], bool]:
    """Each id's bytes (``spec``: tokenizer.json's ``decoder``), and whether the decoder was read
    exactly (else each token is decoded alone)."""
    steps = _steps(spec)
    tokens: list[str | None] = [None] * size
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if 0 <= token_id < size:
            tokens[token_id] = token
    if steps is None:
        log.warning("tokenizer_decoder_approximate", path=str(source), decoder=_kind(spec))
        return [_alone(tokenizer, token_id, token) for token_id, token in enumerate(tokens)], False
    return [b"" if token is None else _apply(steps, token) for token in tokens], True


def _apply(steps: list[_Step], token: str) -> bytes:
    value: str | bytes = token
    for step in steps:
        value = step(value)
    return value if isinstance(value, bytes) else value.encode("utf-8")


def _alone(tokenizer: tokenizers.Tokenizer, token_id: int, token: str | None) -> bytes:
    if token is None:
        return b""
    text: str = tokenizer.decode([token_id], skip_special_tokens=False)
    return text.encode("utf-8")


def _kind(spec: object) -> str:
    return str(spec.get("type")) if isinstance(spec, dict) else "none"


def _steps(spec: Any) -> list[_Step] | None:
    """The per-token steps of a decoder, or None when it has no per-token form here."""
    if not isinstance(spec, dict):
        return None
    kind = spec.get("type")
    children = spec.get("decoders") or () if kind == "Sequence" else (spec,)
    steps: list[_Step] = []
    fused = False
    for child in children:
        child_kind = child.get("type") if isinstance(child, dict) else None
        if child_kind == "Strip" and not fused:  # stripping each token: no such checkpoint known
            return None
        fused = fused or child_kind == "Fuse"
        child_steps = _child_steps(child)
        if child_steps is None:
            return None
        steps.extend(child_steps)
    return steps


def _child_steps(spec: Any) -> list[_Step] | None:
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "ByteLevel":
        return [_byte_level]
    if kind == "ByteFallback":
        return [_byte_fallback]
    if kind in ("Fuse", "Strip"):  # after Fuse, whole-output steps: an answer never starts the output
        return []
    if kind == "Metaspace":
        return [_replacer(str(spec.get("replacement", "▁")), " ")]
    if kind == "Replace":
        pattern = spec.get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
            return [_replacer(pattern["String"], str(spec.get("content", "")))]
    return None


def _replacer(old: str, new: str) -> _Step:
    def step(value: str | bytes) -> str | bytes:
        return value.replace(old, new) if isinstance(value, str) else value

    return step


def _byte_fallback(value: str | bytes) -> str | bytes:
    if isinstance(value, str) and (match := _BYTE_PIECE.fullmatch(value)):
        return bytes([int(match.group(1), 16)])
    return value


def _byte_level(value: str | bytes) -> str | bytes:
    """GPT-2's byte alphabet back to bytes; a token with a character outside it is its UTF-8."""
    if isinstance(value, bytes):
        return value
    alphabet = _byte_decoder()
    try:
        return bytes(alphabet[char] for char in value)
    except KeyError:
        return value.encode("utf-8")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: printable bytes are themselves, the rest 256 + n."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}
