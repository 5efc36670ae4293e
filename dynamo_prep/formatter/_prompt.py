"""What every prompt formatter returns: a rendered prompt, optionally cut into segments."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, final

import msgspec


class PromptRenderError(ValueError):
    """The request cannot be rendered; the message tells the user what to change (HTTP 400)."""


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

    A formatter builds its runs once, as constants, and lists them whole in ``Segments.pieces``;
    a tokenizer then keeps each run's ids and serves it with one lookup instead of one per
    segment. Runs compare and hash by identity: a run is a constant, not a value.
    """

    __slots__ = ("segments", "text")

    def __init__(self, segments: Iterable[Segment]) -> None:
        self.segments = tuple(segments)
        self.text = "".join(segment.text for segment in self.segments)

    def __repr__(self) -> str:
        return f"Run({list(self.segments)!r})"


class Segments(list[Segment]):
    """A prompt's segments, flat, remembering the ``pieces`` they were emitted as.

    ``pieces`` holds the same segments in order, constant stretches as ``Run`` objects and every
    other segment on its own; joining the pieces' texts gives the prompt text.
    """

    __slots__ = ("pieces",)

    def __init__(self, pieces: list[Run | Segment]) -> None:
        super().__init__()
        self.pieces = pieces
        append, extend = self.append, self.extend
        for piece in pieces:
            if type(piece) is Run:
                extend(piece.segments)
            else:
                append(piece)


class RenderedPrompt(msgspec.Struct, frozen=True):
    """A rendered prompt.

    ``segments`` is None for a prompt that is tokenized as one string (Jinja templates); when
    present, joining the segment texts gives ``text``. ``image_count`` is the number of image
    placeholders the formatter rendered, checked against the request's image parts.
    """

    text: str
    segments: list[Segment] | None = None
    image_count: int = 0
