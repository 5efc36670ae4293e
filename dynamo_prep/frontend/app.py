"""The OpenAI-compatible HTTP frontend, assembled: the state every surface serves from, each
surface's routes (``api/``, one module per surface), the error answers (``api/failures.py``) and the
request-id middleware (``request_ids.py``). Why this stack: docs/frontend.md.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.types import ASGIApp

from dynamo_prep.discovery.catalog import ModelCatalog
from dynamo_prep.frontend.api import chat, completions, models, probes, responses, tokenize
from dynamo_prep.frontend.api.common import Api, Surface
from dynamo_prep.frontend.api.failures import HANDLERS
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.frontend.config import HttpSettings
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.load import LoadBoard
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.migration import Migration
from dynamo_prep.frontend.request_ids import RequestIds
from dynamo_prep.frontend.schema_checks import SchemaChecks
from dynamo_prep.routing.round_robin import RoundRobin
from dynamo_prep.routing.router import Router

__all__ = ["SURFACES", "create_app"]

SURFACES: tuple[Surface, ...] = (chat, completions, responses, models, tokenize, probes)
"""The API's surfaces: each module's ``routes(api)`` are served."""


def create_app(
    catalog: ModelCatalog,
    client: RequestPlaneClient,
    *,
    router: Router | None = None,
    board: LoadBoard | None = None,
    settings: HttpSettings | None = None,
    metrics: FrontendMetrics | None = None,
    on_answered: Callable[[str], None] | None = None,
    schema_checks: SchemaChecks | None = None,
) -> ASGIApp:
    """The ASGI app serving ``catalog``'s live models through ``client``.

    ``router`` chooses each request's instance (else round robin); ``board`` holds the
    instances' load and the requests waiting for room (the watcher's; else a private one, which
    knows only this frontend's own requests). ``metrics`` is the
    frontend's own registry (shared with its watcher and router); without one the app gets a
    private registry, never prometheus_client's global one. ``on_answered`` is told a model's name
    when one of its workers answers a request (the watcher's ``model_answered``). ``schema_checks``
    checks requests' JSON schemas (the caller closes it; else the app makes its own).
    """
    metrics = metrics if metrics is not None else FrontendMetrics()
    settings = settings or HttpSettings()
    declarations = DeclarationPreprocessors(metrics.discovery)
    migration = Migration(
        catalog, router or RoundRobin(), client, declarations, board=board, on_answered=on_answered,
        schema_limits=settings.schema_limits,
    )  # fmt: skip
    schemas = schema_checks or SchemaChecks(settings.schema_limits, metrics)
    api = Api(catalog, migration, settings, metrics, schemas)
    routes = [route for surface in SURFACES for route in surface.routes(api)]
    app = Starlette(routes=routes, exception_handlers=dict(HANDLERS))
    return RequestIds(app, metrics)
