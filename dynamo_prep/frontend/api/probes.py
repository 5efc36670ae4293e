"""``GET /health`` (readiness: 503 until a model is live), ``GET /live`` and ``GET /metrics``
(Prometheus: this frontend's registry only)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamo_prep.frontend.api.common import JSON, Api, SurfaceRoute, encoder
from dynamo_prep.frontend.metrics import CONTENT_TYPE

__all__ = ["routes"]


def routes(api: Api) -> list[Route]:
    async def health(request: Request) -> Response:
        """Readiness: 200 with the live models once one is servable, else 503."""
        del request
        names = api.catalog.names()
        body = {"status": "healthy" if names else "unhealthy", "models": names}
        return Response(encoder.encode(body), status_code=200 if names else 503, media_type=JSON)

    async def live(request: Request) -> Response:
        del request
        return Response(b'{"status":"live"}', media_type=JSON)

    async def metrics(request: Request) -> Response:
        del request
        return Response(api.metrics.exposition(), media_type=CONTENT_TYPE)

    return [
        SurfaceRoute("/health", health, "GET"),
        SurfaceRoute("/live", live, "GET"),
        SurfaceRoute("/metrics", metrics, "GET"),
    ]
