"""Request-plane messages: frontend DEALER <-> worker ROUTER, one MessagePack frame each.

The frontend sends one frame per message (the ROUTER prepends the peer identity). Every message
carries a ``request_id`` chosen by the frontend, so replies can be matched and interleaved: many
requests share one DEALER per worker. ``docs/request-plane.md`` documents every message.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Final, Generic, TypeVar

import msgspec

from dynamo_prep.protocol.decode import WireDecodeError, decoding
from dynamo_prep.protocol.preprocessed import PreprocessedRequest

__all__ = [
    "FINISH_REASONS",
    "MAX_REPLY_BYTES",
    "Answer",
    "Call",
    "Cancel",
    "ErrorReply",
    "FetchFile",
    "FileData",
    "FromWorker",
    "Generate",
    "Output",
    "Ping",
    "Pong",
    "ToWorker",
    "TokenLogprob",
    "Unary",
    "WireDecodeError",
    "aligned_logprobs",
    "decode_body",
    "decode_from_worker",
    "decode_to_worker",
    "encode",
    "encode_body",
    "extend_logprobs",
    "from_worker_decoder",
    "merged",
    "to_worker_decoder",
]

# The largest model file the request plane carries: cards with bigger files are refused on both sides.
MAX_FILE_BYTES = 256 << 20
# The largest reply (Output, Answer, ErrorReply, Pong) a frontend takes: a frame of 1M token ids
# is ~5 MB, far beyond any context. Larger frames are refused by libzmq at the frontend's socket
# (MAXMSGSIZE: the connection is dropped before the frame is allocated).
MAX_REPLY_BYTES = 8 << 20
# The finish reasons a final Output may carry: the engine's own, or the worker's verdict.
FINISH_REASONS: Final = frozenset({"stop", "length", "cancelled", "deadline"})

_Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
_RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Method = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
A = TypeVar("A")


class FetchFile(msgspec.Struct, kw_only=True, tag="fetch_file", tag_field="kind"):
    """Ask a worker for one of its card's files by content hash (never by path)."""

    request_id: _RequestId
    sha256: _Sha256


class Generate(msgspec.Struct, kw_only=True, tag="generate", tag_field="kind"):
    """Start one generation; ``deadline_ms`` is absolute (ms since the epoch), so queueing counts."""

    request_id: _RequestId
    request: PreprocessedRequest
    deadline_ms: int


class Cancel(msgspec.Struct, kw_only=True, tag="cancel", tag_field="kind"):
    """Stop a generation whose consumer went away (e.g. the HTTP client disconnected)."""

    request_id: _RequestId


class Ping(msgspec.Struct, kw_only=True, tag="ping", tag_field="kind"):
    """Liveness probe: a slow worker still answers, a dead one does not."""

    request_id: _RequestId


class Unary(msgspec.Struct, Generic[A], kw_only=True):
    """A non-streamed request kind: the body of a ``Call``, answered by one ``Answer`` whose body is
    an ``A``. A kind sets ``method`` (its name on the wire) and ``answer`` (``A``, to decode it)."""

    method: ClassVar[str]
    answer: ClassVar[type[Any]]


class Call(msgspec.Struct, kw_only=True, tag="call", tag_field="kind"):
    """One non-streamed request: ``body`` is the MessagePack of the ``Unary`` kind ``method`` names;
    ``deadline_ms`` as Generate's. Answered by one ``Answer`` or an ``ErrorReply``."""

    request_id: _RequestId
    method: _Method
    body: msgspec.Raw
    deadline_ms: int


class FileData(msgspec.Struct, kw_only=True, tag="file_data", tag_field="kind"):
    """The bytes of a file the worker's card lists; the receiver verifies the sha256."""

    request_id: _RequestId
    sha256: _Sha256
    data: bytes


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One generated token's log probability and the ``top_logprobs`` most likely ids at its
    position, most likely first (``[id, logprob]`` pairs; empty when none were asked for).
    A compact array on the wire: ``[logprob, [[id, logprob], ...]]``."""

    logprob: float
    # tuples: once a collection has seen them the garbage collector no longer tracks them, where
    # lists of a long answer's buffered records made every full collection walk millions of them
    top: tuple[tuple[int, float], ...] = ()


class Output(msgspec.Struct, kw_only=True, tag="output", tag_field="kind"):
    """One streamed step of a generation; the last one of a request has ``finish_reason`` set.

    ``prompt_tokens`` / ``completion_tokens`` are cumulative usage as of this step;
    ``cached_tokens`` the prompt tokens the engine's prefix cache served (0: none, or not said).
    ``logprobs``: one record per token of ``token_ids`` when the request asked for logprobs
    (None otherwise; a list of another length is ignored by the frontend).
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


def aligned_logprobs(outputs: list[Output]) -> list[TokenLogprob] | None:
    """The logprobs of consecutive Outputs joined, when every one has a record per token (None
    otherwise: a gap would misalign every later token)."""
    joined: list[TokenLogprob] = []
    for output in outputs:
        if not output.token_ids:
            continue
        if output.logprobs is None or len(output.logprobs) != len(output.token_ids):
            return None
        joined += output.logprobs
    return joined if joined else None


def extend_logprobs(last: Output, more: Output) -> None:
    """Before ``more``'s ids are appended to ``last``'s: ``last``'s logprobs extended in place (one
    merge costs ``more``'s records, however long ``last`` grew), or None once either misaligns."""
    if not more.token_ids:
        return
    if not last.token_ids:
        last.logprobs = _aligned(more)
    elif last.logprobs is not None and len(last.logprobs) == len(last.token_ids) and _aligned(more):
        last.logprobs.extend(more.logprobs or ())
    else:
        last.logprobs = None


def _aligned(output: Output) -> list[TokenLogprob] | None:
    records = output.logprobs
    return list(records) if records is not None and len(records) == len(output.token_ids) else None


def merged(outputs: list[Output]) -> Output:
    """Consecutive Outputs of one stream as one: every token in order, the last usage and finish
    reason (the worker's frames and the frontend's batches of replies merge the same way)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return Output(
        request_id=last.request_id,
        token_ids=[token for output in outputs for token in output.token_ids],
        finish_reason=last.finish_reason,
        prompt_tokens=next((output.prompt_tokens for output in reversed(outputs) if output.prompt_tokens), 0),
        completion_tokens=last.completion_tokens,
        cached_tokens=next((output.cached_tokens for output in reversed(outputs) if output.cached_tokens), 0),
        logprobs=aligned_logprobs(outputs),
    )


class Pong(msgspec.Struct, kw_only=True, tag="pong", tag_field="kind"):
    """The answer to ``Ping``, same ``request_id``."""

    request_id: str


class ErrorReply(msgspec.Struct, kw_only=True, tag="error", tag_field="kind"):
    """A request the worker cannot serve; ``code`` is HTTP-like.

    400 engine contract violation (the engine's own message) or bad request, 404 unknown file,
    503 the worker is draining, or its engine aborted the request or is gone (retryable
    elsewhere), 504 deadline already passed, 500 otherwise.
    """

    request_id: str
    code: int
    message: str


class Answer(msgspec.Struct, kw_only=True, tag="answer", tag_field="kind"):
    """The answer to a ``Call``, same ``request_id``: ``body`` is the MessagePack of its kind's answer."""

    request_id: str
    body: msgspec.Raw


ToWorker = FetchFile | Generate | Cancel | Ping | Call
FromWorker = FileData | Output | Pong | ErrorReply | Answer

_encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def encode(message: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(message)


def encode_body(value: Any) -> msgspec.Raw:
    """A ``Call``'s or an ``Answer``'s body: ``value`` (a kind, or its answer) as MessagePack."""
    return msgspec.Raw(_encoder.encode(value))


def decode_body(body: msgspec.Raw, kind: type[A]) -> A:
    """A ``Call``'s or an ``Answer``'s body as ``kind``; ``WireDecodeError`` otherwise."""
    with decoding():
        return msgspec.msgpack.decode(body, type=kind)


def decode_to_worker(payload: bytes | memoryview) -> ToWorker:
    """A frontend's message; ``WireDecodeError`` (invalid, undecodable, too_deep) otherwise."""
    with decoding():
        return to_worker_decoder.decode(payload)


def decode_from_worker(payload: bytes | memoryview) -> FromWorker:
    """A worker's reply; ``WireDecodeError`` (invalid, undecodable, too_deep) otherwise."""
    with decoding():
        return from_worker_decoder.decode(payload)
