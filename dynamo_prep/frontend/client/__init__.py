"""The frontend's side of the request plane: transport only (which instance, and what to do when
one is lost, is ``migration.py``'s policy). docs/request-plane.md, "Client behaviour".

One module per part: ``_client`` (``RequestPlaneClient``), ``_channel`` (one worker endpoint's
socket, watchdog and judgement of its replies), ``_inbox`` (one request's replies), ``_allowance``
(what a worker may send unasked, and the account of what was refused), ``_errors``, ``_limits``.
"""

from dynamo_prep.frontend.client._client import RequestPlaneClient
from dynamo_prep.frontend.client._errors import NoSocketLeft, SlowReader, WorkerError, WorkerLost
from dynamo_prep.frontend.client._limits import (
    DEFAULT_IDLE_CLOSE_S,
    DEFAULT_STALL_TIMEOUT_S,
    FLOOD_BURST,
    MAX_BUFFERED_TOKENS,
    MAX_WORKER_MESSAGE_CHARS,
)

__all__ = [
    "DEFAULT_IDLE_CLOSE_S",
    "DEFAULT_STALL_TIMEOUT_S",
    "FLOOD_BURST",
    "MAX_BUFFERED_TOKENS",
    "MAX_WORKER_MESSAGE_CHARS",
    "NoSocketLeft",
    "RequestPlaneClient",
    "SlowReader",
    "WorkerError",
    "WorkerLost",
]
