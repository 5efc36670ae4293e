"""Request-plane messages: frontend DEALER <-> worker ROUTER, one MessagePack frame each.

The frontend sends one frame per message (the ROUTER prepends the peer identity). Every message
carries a ``request_id`` chosen by the frontend, so replies can be matched and interleaved.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_FILE_BYTES = 256 << 20

_Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
_RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class FetchFile(msgspec.Struct, kw_only=True, tag="fetch_file", tag_field="kind"):
    """Ask a worker for one of its card's files by content hash (never by path)."""

    request_id: _RequestId
    sha256: _Sha256


class FileData(msgspec.Struct, kw_only=True, tag="file_data", tag_field="kind"):
    """The bytes of a file the worker's card lists; the receiver verifies the sha256."""

    request_id: _RequestId
    sha256: _Sha256
    data: bytes


class ErrorReply(msgspec.Struct, kw_only=True, tag="error", tag_field="kind"):
    """A request the worker cannot serve; ``code`` is HTTP-like (400, 404, 500, 503)."""

    request_id: str
    code: int
    message: str


ToWorker = FetchFile
FromWorker = FileData | ErrorReply

_encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def encode(message: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(message)
