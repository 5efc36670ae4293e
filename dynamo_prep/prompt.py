"""What a formatter hands to a tokenizer: a rendered prompt, as segments and constant runs.

Below both (floor 1), so the tokenizer encodes these types without importing the formatter package.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, final

import msgspec

__all__ = ["Piece", "PromptRenderError", "RenderedPrompt", "Run", "Segment", "flatten"]


class PromptRenderError(ValueError):
    """The request cannot be rendered; the message tells the user what to change (HTTP 400).

    ``param`` names the request field at fault when it is not the messages (the default).
    """

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Segment(NamedTuple):
    """A piece of prompt text tokenized on its own.

    Control segments (``allow_special=True``) may produce special ids; text segments never do,
    whatever they spell.
    """

    text: str
    allow_special: bool


@final
class Run:
    """Segments a formatter always emits together, such as the seven of
    ``<|open|>message role="user"<|sep|>``.

    A formatter builds its runs once, as constants, and lists them whole among a prompt's pieces;
    a tokenizer then keeps each run's ids and serves it with one lookup instead of one per
    segment. Runs compare and hash by identity: a run is a constant, not a value.
    """

    __slots__ = ("segments", "text")

    def __init__(self, segments: Iterable[Segment]) -> None:
        self.segments = tuple(segments)
        self.text = "".join(segment.text for segment in self.segments)

    def __repr__(self) -> str:
        return f"Run({list(self.segments)!r})"


Piece = Segment | Run
"""One item of a rendered prompt: a single segment, or a constant run of them."""


def flatten(pieces: Iterable[Piece]) -> list[Segment]:
    """The segments of ``pieces``, in order, runs expanded."""
    segments: list[Segment] = []
    append, extend = segments.append, segments.extend
    for piece in pieces:
        if type(piece) is Run:
            extend(piece.segments)
        else:
            append(piece)
    return segments


class RenderedPrompt(msgspec.Struct, frozen=True):
    """A rendered prompt.

    ``pieces`` is None for a prompt that is tokenized as one string (strict HF tokenization);
    when present, joining the pieces' texts gives ``text``. ``image_count`` is the number of image
    placeholders the formatter rendered, checked against the request's image parts.
    ``open_channel`` is the output channel the prompt leaves open for the model (``think`` or
    ``response``); None when the model opens its own (an answer parser starts from it).
    """

    text: str
    pieces: Sequence[Piece] | None = None
    image_count: int = 0
    open_channel: str | None = None

    @property
    def segments(self) -> list[Segment] | None:
        """The pieces as flat segments (runs expanded), or None; built on each call, off the hot path."""
        return None if self.pieces is None else flatten(self.pieces)
