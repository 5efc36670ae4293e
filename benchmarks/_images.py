"""Pictures for the suites that send images to mock workers, which fetch and decode them.

``image_server`` serves one small PNG at every path on 127.0.0.1 (workers started with
``LOOPBACK_MEDIA`` may fetch from it; by default a worker fetches from public addresses only);
``PNG_DATA_URL`` is the same picture inline.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import threading
from collections.abc import Iterator
from typing import Any

from dynamo_prep.cli.up import demo_png

__all__ = ["LOOPBACK_MEDIA", "PNG_DATA_URL", "image_server"]

PICTURE = demo_png()
PNG_DATA_URL = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
LOOPBACK_MEDIA = ("--allowed-media-networks", "127.0.0.1/32")


@contextlib.contextmanager
def image_server() -> Iterator[str]:
    """The picture at every path of ``http://127.0.0.1:PORT`` while the block runs; that base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(PICTURE)))
            self.end_headers()
            self.wfile.write(PICTURE)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="bench-images", daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
