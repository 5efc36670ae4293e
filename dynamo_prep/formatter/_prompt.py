"""What every prompt formatter returns: a rendered prompt, optionally cut into segments."""

from __future__ import annotations

from typing import NamedTuple

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


class RenderedPrompt(msgspec.Struct, frozen=True):
    """A rendered prompt.

    ``segments`` is None for a prompt that is tokenized as one string (Jinja templates); when
    present, joining the segment texts gives ``text``. ``image_count`` is the number of image
    placeholders the formatter rendered, checked against the request's image parts.
    """

    text: str
    segments: list[Segment] | None = None
    image_count: int = 0
