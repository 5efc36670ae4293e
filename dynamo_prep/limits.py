"""The process's file and socket budget: raised at start, and the error that says it is spent;
and the bounds of a request's template variables, checked at the edge and by every formatter.

docs/discovery.md ("Sockets and files") has the budget per instance and why; docs/hostile-input.md
the request bounds.
"""

from __future__ import annotations

import errno
import resource
from dataclasses import dataclass
from typing import Any

import structlog
import zmq

__all__ = [
    "FDS_PER_SOCKET",
    "TEMPLATE_ARGS_LIMITS",
    "TemplateArgsLimits",
    "is_exhausted",
    "raise_limits",
    "raise_open_files",
    "socket_budget",
]

log = structlog.get_logger("dynamo_prep.limits")

# A connecting socket holds its mailbox and one connection; the budget assumes the worst of it.
FDS_PER_SOCKET = 2
# Descriptors kept for everything that is not a ZeroMQ socket: HTTP connections, files, the runtime.
RESERVED_FDS = 64
RESERVED_SHARE = 16  # and 1/16 of the limit on top
UNLIMITED_FILES = 1 << 20  # what an unlimited soft limit counts as (Linux's default fs.nr_open)


def raise_open_files() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (never above it); (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, UNLIMITED_FILES
    if hard in (resource.RLIM_INFINITY, soft):
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # e.g. macOS caps the soft limit below an "unlimited" hard one
        log.warning("open_files_limit_kept", soft=soft, hard=hard, error=str(exc))
        return soft, soft
    return soft, hard


def socket_budget(open_files: int, socket_limit: int) -> int:
    """The ZeroMQ sockets ``open_files`` descriptors carry once the reserve is set aside (at least
    1, at most libzmq's own ``socket_limit``)."""
    spare = open_files - RESERVED_FDS - open_files // RESERVED_SHARE
    return max(1, min(spare // FDS_PER_SOCKET, socket_limit))


def raise_limits(context: zmq.Context[Any]) -> None:
    """At a process's start: the open-file limit raised to the hard limit, then ``context``'s
    MAX_SOCKETS fitted to it (libzmq reads it when the context makes its first socket), logged."""
    files_before, files_after = raise_open_files()
    sockets_before = context.get(zmq.MAX_SOCKETS)
    sockets_after = socket_budget(files_after, context.get(zmq.SOCKET_LIMIT))
    context.set(zmq.MAX_SOCKETS, sockets_after)
    log.info(
        "process_limits_set",
        open_files_before=files_before,
        open_files=files_after,
        zmq_max_sockets_before=sockets_before,
        zmq_max_sockets=sockets_after,
    )


def is_exhausted(exc: zmq.ZMQError) -> bool:
    """Whether ``exc`` says the process (or the context's MAX_SOCKETS) has no socket left."""
    return exc.errno in (errno.EMFILE, errno.ENFILE)


@dataclass(frozen=True, slots=True)
class TemplateArgsLimits:
    """What a request's ``chat_template_kwargs`` (and ``chat_template_args``) may hold, each field
    on its own: a large body's field is refused by its bytes before it is decoded
    (``protocol.openai``), every request's by all three before it is rendered
    (``formatter.template_args``), whatever the formatter and tokenization mode."""

    max_bytes: int = 1 << 20  # its JSON; 1 MiB of text is more tokens than most contexts hold
    max_depth: int = 32  # nested lists and objects (the field itself is depth 1)
    max_items: int = 1 << 16  # keys and values, at every depth


TEMPLATE_ARGS_LIMITS = TemplateArgsLimits()
