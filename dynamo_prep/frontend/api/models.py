"""``GET /v1/models``: the models servable now."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamo_prep.frontend.api.common import JSON, Api, SurfaceRoute, encoder
from dynamo_prep.protocol.openai import ModelEntry, ModelList

__all__ = ["routes"]


def routes(api: Api) -> list[Route]:
    async def models(request: Request) -> Response:
        del request
        return _models(api)

    return [SurfaceRoute("/v1/models", models, "GET")]


def _models(api: Api) -> Response:
    entries = []
    for name in api.catalog.names():
        model = api.catalog.get(name)
        if model is not None:
            entries.append(ModelEntry(id=name, created=model.created))
    return Response(encoder.encode(ModelList(data=entries)), media_type=JSON)
