"""``python -m benchmarks._stack STACK [dynamo-prep args]``: the frontend on another HTTP server stack.

How the HTTP suite compares server stacks on the real frontend (same app, same components): the
frontend's own stack is ``uvicorn-uvloop-httptools``; the others swap the server or the loop in
this process only, before the CLI runs.

* ``uvicorn-asyncio-h11``: uvicorn with asyncio's loop and the h11 parser (main's stack before
  this work, with the TCP_NODELAY fix of ``bind_http``; run with ``PYTHONPATH`` on an export of
  an older ``dynamo_prep`` it measures that revision as it was);
* ``granian``: granian's embedded server (Rust HTTP, ASGI on this loop; experimental upstream),
  binding the port the frontend reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from typing import Any

from uvicorn import config as uvicorn_config

from dynamo_prep import cli
from dynamo_prep.frontend import http_server, process

STACKS = ("uvicorn-uvloop-httptools", "uvicorn-asyncio-h11", "granian")


class _GranianServer:
    """``HttpServer``'s interface on granian's embedded server."""

    def __init__(self, app: Any, sock: socket.socket, settings: Any = None) -> None:
        from granian.constants import HTTPModes, Interfaces  # noqa: PLC0415
        from granian.server.embed import Server  # noqa: PLC0415

        del settings
        host, self._port = sock.getsockname()[:2]
        sock.close()  # granian binds by address; the port stays ours on loopback
        self._server = Server(
            app, address=host, port=self._port, interface=Interfaces.ASGINL, http=HTTPModes.http1,
            websockets=False, log_enabled=False,
        )  # fmt: skip

    @property
    def port(self) -> int:
        return self._port

    async def run(self) -> None:
        serving = asyncio.create_task(self._server.serve())
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            self._server.stop()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(serving, 5)
            raise


def main() -> int:
    stack, args = sys.argv[1], sys.argv[2:]
    if stack == "uvicorn-asyncio-h11":
        process.new_event_loop = asyncio.new_event_loop  # type: ignore[assignment]
        http_server._protocol = lambda header_timeout_s: "h11"  # type: ignore[assignment,misc]
        uvicorn_config.HTTP_PROTOCOLS["auto"] = uvicorn_config.HTTP_PROTOCOLS["h11"]  # main's "auto"
    elif stack == "granian":
        process.HttpServer = _GranianServer  # type: ignore[assignment,misc]
    elif stack != STACKS[0]:
        raise SystemExit(f"unknown stack {stack!r}; one of {', '.join(STACKS)}")
    return cli.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
