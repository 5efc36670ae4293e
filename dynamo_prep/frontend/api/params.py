"""One helper for the surfaces served on the chat path whose request spells a chat parameter its
own way (completions' ``max_tokens``, Responses' ``max_output_tokens``, ``text.format``...)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from dynamo_prep.preprocessor import PreprocessError

__all__ = ["spelled_as"]


@contextlib.contextmanager
def spelled_as(names: Mapping[str, str]) -> Iterator[None]:
    """Inside, a chat-path refusal names the parameter as the surface's request spells it
    (``names``: the chat request's name -> the surface's)."""
    try:
        yield
    except PreprocessError as exc:
        if exc.param is not None and exc.param in names:
            raise PreprocessError(exc.message, param=names[exc.param]) from exc
        raise
