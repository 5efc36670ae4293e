"""The non-streamed request kinds (``wire.Unary``): each is one struct here, one handler on the
worker (``worker/calls.py``) and one ``RequestPlaneClient.call`` (docs/request-plane.md, "Adding a
request kind")."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from dynamo_prep.protocol.wire import Unary

__all__ = ["MAX_ECHO_BYTES", "Echo", "Echoed"]

MAX_ECHO_BYTES = 1 << 20


class Echoed(msgspec.Struct, kw_only=True):
    """``Echo``'s answer: the bytes it carried."""

    data: bytes


class Echo(Unary[Echoed], kw_only=True):
    """Answered with its ``data``, by every worker: the kind that shows the seam (and what a round
    trip on the request plane costs)."""

    method: ClassVar[str] = "echo"
    answer: ClassVar[type[Any]] = Echoed

    data: Annotated[bytes, msgspec.Meta(max_length=MAX_ECHO_BYTES)]
