"""What a request on the request plane can fail with (``errors.py`` maps each to its status)."""

from __future__ import annotations

from dynamo_prep.frontend.client._limits import MAX_BUFFERED_TOKENS


class WorkerError(Exception):
    """The worker refused or failed the request (an ``ErrorReply``): 400 contract, 503 draining, ..."""

    def __init__(self, code: int, message: str, *, endpoint: str = "") -> None:
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message
        self.endpoint = endpoint


class WorkerLost(Exception):  # noqa: N818 - the name the frontend codes against
    """The worker died or was removed mid-request; the stream will not continue there."""

    def __init__(self, endpoint: str, reason: str = "lost") -> None:
        super().__init__(f"worker {endpoint} {reason}")
        self.endpoint = endpoint
        self.reason = reason


class SlowReader(Exception):  # noqa: N818 - the name the frontend codes against
    """The request's client read its stream slower than the worker wrote it: past
    ``MAX_BUFFERED_TOKENS`` unread tokens the generation was cancelled."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(f"more than {MAX_BUFFERED_TOKENS} tokens unread; the generation was cancelled")
        self.endpoint = endpoint


class NoSocketLeft(WorkerLost):
    """No channel could be opened to the worker: the frontend is at its socket or file limit (the
    request never left; a 503)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, "socket_limit")
