"""Scripted mock replies: a JSON Lines file, validated and encoded once, at start-up.

Each line is ``{"when": SUBSTRING, ...}`` with exactly one of

* ``"segments": [[text, allow_special], ...]``: encoded segment by segment, like a prompt: control
  segments may become special ids, text segments never do, whatever they spell;
* ``"text": "..."``: encoded with every registered special allowed, so markers spelled out
  become their ids;
* ``"token_ids": [...]``: taken as they are (each must be in the model's vocabulary).

The first reply whose ``when`` occurs in the last user message wins (an empty ``when`` matches
every prompt). Blank lines are skipped; anything else that is wrong fails the whole file with
its path and line number.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from dynamo_prep.tokenizer import Tokenizer

__all__ = ["MockReply", "RepliesError", "load_replies", "matching_reply"]

_KINDS = ("segments", "text", "token_ids")


class RepliesError(ValueError):
    """The replies file cannot be used; the message names the file and, for a bad line, its number."""


class MockReply(msgspec.Struct, frozen=True):
    """One scripted reply: the token ids streamed when ``when`` occurs in the last user message."""

    when: str
    token_ids: tuple[int, ...]
    line: int


class _ReplyLine(msgspec.Struct, forbid_unknown_fields=True):
    when: str
    segments: list[tuple[str, bool]] | msgspec.UnsetType = msgspec.UNSET
    text: str | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


_decoder = msgspec.json.Decoder(_ReplyLine)


def load_replies(path: str | Path, tokenizer: Tokenizer) -> tuple[MockReply, ...]:
    """Every reply of the file, in order, encoded with ``tokenizer``; raises ``RepliesError``."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RepliesError(f"{path}: cannot read the replies file: {exc}") from exc
    replies: list[MockReply] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            replies.append(_reply(line, number, tokenizer))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise RepliesError(f"{path}:{number}: {exc}") from exc
    return tuple(replies)


def matching_reply(replies: Sequence[MockReply], last_user: str) -> MockReply | None:
    """The first reply whose ``when`` occurs in ``last_user``."""
    return next((reply for reply in replies if reply.when in last_user), None)


def _reply(line: str, number: int, tokenizer: Tokenizer) -> MockReply:
    entry = _decoder.decode(line)
    given = [kind for kind in _KINDS if getattr(entry, kind) is not msgspec.UNSET]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(_KINDS)} (got {', '.join(given) or 'none'})")
    if not isinstance(entry.segments, msgspec.UnsetType):
        token_ids = tokenizer.encode_segments(entry.segments)
    elif not isinstance(entry.text, msgspec.UnsetType):
        token_ids = tokenizer.encode(entry.text, allow_special=True)
    else:
        token_ids = list(entry.token_ids) if not isinstance(entry.token_ids, msgspec.UnsetType) else []
        outside = tokenizer.first_unknown_id(token_ids)
        if outside is not None:
            raise ValueError(f"token id {outside} is outside the vocabulary [0, {tokenizer.n_vocab})")
    return MockReply(when=entry.when, token_ids=tuple(token_ids), line=number)
