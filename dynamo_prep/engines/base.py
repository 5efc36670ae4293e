"""The engine contract: what a worker needs from any engine, real or mock.

An engine streams outputs for a ``PreprocessedRequest`` (``GenerateFn``); each output carries the
new token ids, the finish reason on the last one, and the running token counts. An engine may
also check a request against its prompt contract before any generation (``CheckFn``), raising
``EngineContractError`` with the engine's own wording; the worker answers that with a 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Literal, Protocol, get_args

from dynamo_prep.protocol.preprocessed import PreprocessedRequest

__all__ = [
    "FLAVORS",
    "REPLY_FORMATS",
    "CheckFn",
    "EngineContractError",
    "EngineOutput",
    "Flavor",
    "GenerateFn",
    "ReplyFormat",
]

Flavor = Literal["sglang", "vllm"]
FLAVORS: tuple[Flavor, ...] = get_args(Flavor)
# How the mock engine words a reply nothing scripted: plain echo text, or the model's own format.
ReplyFormat = Literal["echo", "model"]
# Without a scripted reply the mock answers in the model's own format (K3 channels, Hermes calls);
# "echo" is the bare echo text, for tests of the raw token path.
DEFAULT_REPLY_FORMAT: ReplyFormat = "model"
REPLY_FORMATS: tuple[ReplyFormat, ...] = get_args(ReplyFormat)


class EngineContractError(ValueError):
    """A request breaks the engine's real prompt contract; the message is the engine's own."""


class EngineOutput(Protocol):
    """One streamed step as an engine yields it (``MockOutput`` is one)."""

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


GenerateFn = Callable[[PreprocessedRequest], AsyncIterator[EngineOutput]]
CheckFn = Callable[[PreprocessedRequest], None]
