"""Error bodies per API surface: a failure's status is ``errors.py``'s, whichever surface failed, and
its body the failing surface's shape (``ErrorShape`` on its ``SurfaceRoute``), so a non-OpenAI
surface can answer in its own. Two surfaces in one app assembled as ``app.py`` assembles (the
frontend's exception handlers and request-id middleware), served by the frontend's own HTTP server
on loopback and driven with httpx."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest_asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamo_prep.frontend.api.common import SurfaceRoute
from dynamo_prep.frontend.api.failures import HANDLERS
from dynamo_prep.frontend.api.params import spelled_as
from dynamo_prep.frontend.errors import OPENAI_ERRORS, ErrorShape, OpenAIError
from dynamo_prep.frontend.http_server import HttpServer, bind_http
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.request_ids import RequestIds
from dynamo_prep.preprocessor import PreprocessError

PLAIN = ErrorShape(
    lambda error: f"{error.status} {error.param or '-'}: {error.message}".encode(),
    media_type="text/plain; charset=utf-8",
)


def _surface(prefix: str, errors: ErrorShape) -> list[Route]:
    async def refuse(request: Request) -> Response:
        del request
        with spelled_as({"max_completion_tokens": "max_tokens"}):
            raise PreprocessError("max_completion_tokens is too large", param="max_completion_tokens")

    async def busy(request: Request) -> Response:
        del request
        raise OpenAIError(503, "busy", retry_after_s=2)

    async def crash(request: Request) -> Response:
        del request
        raise RuntimeError("a bug")

    return [
        SurfaceRoute(f"/{prefix}/refuse", refuse, "POST", errors),
        SurfaceRoute(f"/{prefix}/busy", busy, "POST", errors),
        SurfaceRoute(f"/{prefix}/crash", crash, "POST", errors),
    ]


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    metrics = FrontendMetrics()
    routes = [*_surface("plain", PLAIN), *_surface("openai", OPENAI_ERRORS)]
    app = RequestIds(Starlette(routes=routes, exception_handlers=dict(HANDLERS)), metrics)
    server = HttpServer(app, bind_http("127.0.0.1", 0))
    url = f"http://127.0.0.1:{server.port}"
    serving = asyncio.create_task(server.run())
    try:
        async with httpx.AsyncClient(base_url=url, timeout=20.0, trust_env=False) as client:
            yield client
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


async def test_each_surface_answers_a_failure_in_its_own_shape_with_the_one_status(
    http: httpx.AsyncClient,
) -> None:
    for path, status, param, message in (
        ("refuse", 400, "max_tokens", "max_completion_tokens is too large"),
        ("busy", 503, None, "busy"),
        ("crash", 500, None, "internal error"),
    ):
        plain, openai = await http.post(f"/plain/{path}"), await http.post(f"/openai/{path}")
        assert plain.status_code == openai.status_code == status
        assert plain.headers["content-type"] == "text/plain; charset=utf-8"
        assert plain.text == f"{status} {param or '-'}: {message}"
        assert openai.headers["content-type"] == "application/json"
        error = openai.json()["error"]
        assert (error["code"], error["param"], error["message"]) == (status, param, message)
        for answer in (plain, openai):
            assert answer.headers["x-request-id"]
            assert answer.headers.get("retry-after") == ("2" if path == "busy" else None)


async def test_a_wrong_method_answers_in_the_routes_shape_and_no_route_in_openais(
    http: httpx.AsyncClient,
) -> None:
    wrong = await http.get("/plain/refuse")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.text == "405 -: GET /plain/refuse: Method Not Allowed"
    missing = await http.post("/nowhere")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "POST /nowhere: Not Found"
