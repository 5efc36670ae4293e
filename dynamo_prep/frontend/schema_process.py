"""``python -m dynamo_prep.frontend.schema_process``: a process that checks JSON Schemas against
their metaschemas for the frontend (``schema_checks.py``), one at a time, until its stdin closes.

Frames both ways are a 4-byte big-endian length and that many bytes: a schema's JSON text in, the
problem's UTF-8 text out (empty: the schema is valid). An empty frame out first says the process is
ready (jsonschema loaded, its metaschemas built): a check's deadline counts checking only. The
frontend kills the process to stop a check (its client left, or it ran past its deadline), so no
CPU is spent on an abandoned check.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import BinaryIO

from dynamo_prep.protocol.structured import schema_problem

__all__ = ["check_frames", "frame"]

HEADER_BYTES = 4


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(HEADER_BYTES, "big") + data


def check_frames(source: BinaryIO, sink: BinaryIO) -> None:
    """Answer each schema read from ``source`` with its problem, until ``source`` ends."""
    while len(header := source.read(HEADER_BYTES)) == HEADER_BYTES:
        text = source.read(int.from_bytes(header, "big"))
        try:
            problem = schema_problem(json.loads(text))
        except RecursionError:  # the frontend bounds the depth first; this is only a backstop
            problem = "it is nested too deeply"
        sink.write(frame((problem or "").encode()))
        sink.flush()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend stops it (Ctrl-C reaches the group)
    schema_problem({})  # loads jsonschema and builds the default draft's validator once
    sys.stdout.buffer.write(frame(b""))
    sys.stdout.buffer.flush()
    check_frames(sys.stdin.buffer, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
