"""What the request-plane and routing tests share: mock workers on a discovery plane of their own,
and a catalog serving a demo model on given instances."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.discovery import Instance
from support.plane import DynamoProcess, SubCollector, start_dynamo, tcp_endpoint

StartWorker = Callable[..., tuple[DynamoProcess, str]]


@contextlib.contextmanager
def echo_workers(model: str) -> Iterator[StartWorker]:
    """``start(*extra)`` starts a mock sglang worker of ``model`` replying with an echo (``extra``: more
    worker options) and gives its process and endpoint; every worker is stopped on exit."""
    plane = tcp_endpoint()
    started: list[DynamoProcess] = []

    def start(*extra: str) -> tuple[DynamoProcess, str]:
        proc = start_dynamo(
            "worker", "--model-path", model, "--flavor", "sglang", "--reply-format", "echo",
            "--discovery", plane, *extra,
        )  # fmt: skip
        started.append(proc)
        return proc, proc.wait_event("worker_started")["endpoint"]

    with SubCollector(plane, bind=True):
        try:
            yield start
        finally:
            for proc in started:
                proc.stop()


def serving_catalog(
    card: ModelDeploymentCard, model: str, instances: Iterable[Instance]
) -> tuple[ModelCatalog, LiveModel]:
    """A catalog serving the demo ``model`` with ``card`` on ``instances`` (in their order)."""
    live = LiveModel(
        model,
        card,
        card.mdcsum(),
        OpenAIPreprocessor.new(card, model),
        {instance.instance_id: instance for instance in instances},
        model_dir=resolve_model_dir(model),
    )
    catalog = ModelCatalog()
    catalog.publish(live)
    return catalog, live
