"""uvicorn as one supervised component of the frontend process (same event loop as the watcher).

The listening socket is bound by the caller before anything starts, so a busy port is a clean
start-up error (uvicorn would ``sys.exit`` from inside a task) and ``--http-port 0`` works (the
real port is logged). uvicorn's own signal capture is switched off: the frontend process owns
SIGTERM / SIGINT and stops every component together. Cancelling ``run`` shuts uvicorn down
gracefully (in-flight responses get ``GRACE_S`` to finish) instead of dropping connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

__all__ = ["GRACE_S", "HttpServer", "bind_http"]

GRACE_S = 5.0


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` is an IPv6 literal)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """The frontend process handles signals for every component; uvicorn must not."""
        yield


class HttpServer:
    """Serve ``app`` on an already bound socket until cancelled."""

    def __init__(self, app: ASGIApp, sock: socket.socket) -> None:
        self.socket = sock
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(GRACE_S),
        )
        self._server = _Server(config)

    @property
    def port(self) -> int:
        port: int = self.socket.getsockname()[1]
        return port

    async def run(self) -> None:
        serving = asyncio.create_task(self._server.serve(sockets=[self.socket]), name="uvicorn")
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            self._server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(serving, GRACE_S + 1)
            raise
        finally:
            self.socket.close()
