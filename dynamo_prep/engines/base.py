"""The engine contract: what a worker needs from any engine, real or mock.

An engine streams outputs for a ``PreprocessedRequest`` (``GenerateFn``); each output carries the
new token ids, the finish reason on the last one, and the running token counts. An engine may
also check a request against its prompt contract before any generation (``CheckFn``), raising
``EngineContractError`` with the engine's own wording; the worker answers that with a 400.

A request the engine ends without an answer raises an ``EngineError`` whose ``code`` is the
HTTP-like status the worker replies with: 400 the engine refused the request (its message), 503
the engine aborted it or is gone (retryable on another instance), 500 the engine failed it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from dynamo_prep.protocol.discovery import KvEventsEndpoint
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import TokenLogprob

__all__ = [
    "REPLY_FORMATS",
    "CheckFn",
    "EngineAbortedError",
    "EngineContractError",
    "EngineDeadError",
    "EngineError",
    "EngineFacts",
    "EngineFailedError",
    "EngineOutput",
    "EngineRuntime",
    "GenerateFn",
    "KvPublisher",
    "ReplyFormat",
]

# How the mock engine words a reply nothing scripted: plain echo text, or the model's own format.
ReplyFormat = Literal["echo", "model"]
# Without a scripted reply the mock answers in the model's own format (K3 channels, Hermes calls);
# "echo" is the bare echo text, for tests of the raw token path.
DEFAULT_REPLY_FORMAT: ReplyFormat = "model"
REPLY_FORMATS: tuple[ReplyFormat, ...] = get_args(ReplyFormat)


class EngineError(Exception):
    """The engine ended a request without an answer; ``code`` is the worker's reply status."""

    code = 500


class EngineContractError(EngineError, ValueError):
    """A request breaks the engine's contract (prompt, parameters); the message is the engine's own."""

    code = 400


class EngineAbortedError(EngineError):
    """The engine aborted the request by itself (not a cancel of ours): retryable elsewhere."""

    code = 503


class EngineDeadError(EngineError):
    """The engine is gone: every request fails (retryable elsewhere) and the worker must exit."""

    code = 503


class EngineFailedError(EngineError):
    """The engine reported an error for this request."""

    code = 500


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
    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine's prefix cache served (0 when it does not say)."""
        ...

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One record per token id when the request asked for logprobs, else None."""
        ...


GenerateFn = Callable[[PreprocessedRequest], AsyncIterator[EngineOutput]]
CheckFn = Callable[[PreprocessedRequest], None]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """A running engine's own figures, read once it started: what the worker's card advertises.

    ``kv_events_config`` is the engine's ``--kv-events-config`` (its own config object, or None);
    ``data_parallel_rank`` offsets its ports.
    """

    block_size: int
    total_kv_blocks: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    context_length: int
    data_parallel_rank: int = 0
    kv_events_config: object | None = None

    def logged(self) -> dict[str, int | None]:
        """The figures as log fields."""
        return {
            "block_size": self.block_size,
            "total_kv_blocks": self.total_kv_blocks,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "context_length": self.context_length,
            "data_parallel_rank": self.data_parallel_rank,
        }


class KvPublisher(Protocol):
    """A KV-event publisher the worker starts and closes itself (the mock's ``--kv-events``)."""

    def start(self) -> KvEventsEndpoint:
        """Bind and return the addresses to announce (idempotent)."""
        ...

    async def close(self) -> None:
        """Stop publishing and close its sockets."""
        ...


class EngineRuntime(Protocol):
    """A real engine running in the worker's process, as its runtime adapter presents it."""

    @property
    def flavor(self) -> str:
        """The engine's name (``engines.registry``)."""
        ...

    @property
    def facts(self) -> EngineFacts: ...
    @property
    def declared_image_token(self) -> str | None: ...

    def check(self, request: PreprocessedRequest) -> None:
        """Refuse what the engine cannot serve before anything runs (``EngineContractError``)."""
        ...

    def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request; closing the stream aborts it in the engine exactly once."""
        ...

    def unfinished_requests(self) -> int:
        """The engine's own count of requests it has not finished."""
        ...

    async def wait_dead(self) -> str:
        """Return (with a reason) when the engine is gone; never while it is healthy."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        ...
