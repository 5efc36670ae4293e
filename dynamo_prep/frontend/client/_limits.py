"""The request-plane client's limits and defaults, in one place (docs/request-plane.md)."""

from __future__ import annotations

from dynamo_prep.frontend.config import DEFAULT_WORKER_STALL_TIMEOUT_S

DEFAULT_STALL_TIMEOUT_S = DEFAULT_WORKER_STALL_TIMEOUT_S
DEFAULT_IDLE_CLOSE_S = 30.0
# A worker answers a Ping within milliseconds; one that never answered anything this long after
# its first request is not there.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
UNREACHABLE_HOLD_S = 30.0
# Probes per stall timeout: a live worker gets several chances to answer a Ping before it is lost.
PROBES_PER_STALL = 4
# Looks per stream stall timeout: a stream is given up on after that long without a token, at most
# a look's length later.
STALL_CHECKS = 4
# How long past its deadline the client waits for the worker's own "deadline" reply.
DEADLINE_GRACE_S = 1.0
# Tokens of one request received and not yet taken by its consumer (its client does not read):
# past this the worker's stream is cancelled; ~0.6 MB a request.
MAX_BUFFERED_TOKENS = 16_384
# Replies with no stream to go to (unknown or ended request, a file nobody fetched): a burst of
# FLOOD_BURST, then FLOOD_PER_S a second; past that the worker floods and its channel is dropped.
# The late replies of cancelled streams stay far below.
FLOOD_BURST, FLOOD_PER_S = 10_000, 1_000
# Undecodable replies: a worker past this burst (refilled per second) is dropped.
GARBAGE_BURST, GARBAGE_PER_S = 100, 10
# Replies of one stream that carry no token and do not end it; more count as unsolicited.
MAX_EMPTY_OUTPUTS = 64
# Replies (and their bytes) taken per wake of a channel before the other callbacks and tasks run.
DRAIN_BATCH, DRAIN_BYTES = 1024, 1 << 20
# A stream the frontend cancelled may have many replies in flight (ZeroMQ's and TCP's buffers hold
# tens of thousands of frames): for this long they are dropped without counting against the worker.
LATE_GRACE_S = 5.0
# A worker's error message as a client gets it (log lines cut it to DETAIL_CHARS).
MAX_WORKER_MESSAGE_CHARS = 1000
