"""Routing in one room: every ``--router-mode`` builds a ``Router`` with every part, and the migration
loop moves a request off a killed worker with either one, asking neither which one it is."""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from support.images import png_data_url
from support.plane import DynamoProcess
from support.request_plane import StartWorker, echo_workers, serving_catalog

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.frontend.config import FrontendConfig
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.migration import Migration
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.openai import parse_chat_request
from dynamo_prep.protocol.wire import Output
from dynamo_prep.routing.kv import KvRouting
from dynamo_prep.routing.modes import ROUTERS, build_router
from dynamo_prep.routing.router import Router
from dynamo_prep.routing.settings import ROUTER_MODES, RouterMode, RouterSettings

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
IMAGE = {"type": "image_url", "image_url": {"url": png_data_url()}}
LONG_TEXT = "Please describe every detail of this picture, slowly and carefully, one by one."


def _protocol_members() -> dict[str, inspect.Signature]:
    names = [name for name in vars(Router) if not name.startswith("_")]
    return {name: inspect.signature(getattr(Router, name)) for name in names}


def test_every_router_mode_has_a_router() -> None:
    assert set(ROUTERS) == set(ROUTER_MODES)


@pytest.mark.parametrize("mode", ROUTER_MODES)
def test_every_router_provides_every_part_of_the_protocol(mode: RouterMode) -> None:
    router = build_router(RouterSettings(mode=mode))
    try:
        members = _protocol_members()
        assert {"prompts", "choose", "dispatch", "prefilled", "release", "components", "close"} <= set(
            members
        )
        for name, expected in members.items():
            method = getattr(type(router), name, None)
            assert callable(method), f"{mode}: no {name}"
            assert inspect.signature(method).parameters.keys() == expected.parameters.keys(), (mode, name)
            assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(getattr(Router, name))
    finally:
        router.close()


def test_the_kv_router_takes_its_settings_whole() -> None:
    settings = RouterSettings(mode="kv", kv_overlap_score_weight=2.5, temperature=0.5, predict_ttl_s=0.0)
    router = build_router(settings)
    assert isinstance(router, KvRouting) and router.settings is settings
    router.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "random"}, "--router-mode must be one of round-robin, kv, got 'random'"),
        (
            {"temperature": -0.5},
            "--kv-overlap-score-weight, --router-temperature and --kv-predict-ttl must be >= 0",
        ),
        ({"predict_ttl_s": float("nan")}, "--kv-predict-ttl must be >= 0"),
    ],
)
def test_the_routing_settings_are_validated_in_their_record(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RouterSettings(**fields)
    options = {"router_mode": fields.get("mode", "kv"), "router_temperature": fields.get("temperature", 0.0)}
    with pytest.raises(ValueError, match=re.escape(message)):  # the frontend's options, the same record
        FrontendConfig.from_options(**options, kv_predict_ttl_s=fields.get("predict_ttl_s", 0.0))


# -- the migration loop with either router, through real mock workers ------------------------------


@pytest.fixture
def workers() -> Iterator[StartWorker]:
    with echo_workers(DEMO) as start:
        yield start


@pytest.fixture
async def client() -> AsyncIterator[RequestPlaneClient]:
    client = RequestPlaneClient(stall_timeout_s=1.0)
    yield client
    await client.close()


@pytest.mark.parametrize("mode", ROUTER_MODES)
async def test_migration_moves_a_request_off_a_killed_worker_with_either_router(
    mode: RouterMode, workers: Any, client: RequestPlaneClient
) -> None:
    procs: dict[str, DynamoProcess] = {}
    instances: dict[str, Instance] = {}
    for instance_id in ("a", "b"):
        procs[instance_id], endpoint = workers("--token-delay", "0.1")
        instances[instance_id] = Instance(
            instance_id=instance_id, endpoint=endpoint, declared_token=MEDIA_PAD
        )
    card = ModelDeploymentCard.from_model_dir(
        DEMO, migration_limit=1, runtime_config=ModelRuntimeConfig(image_placeholder_token=MEDIA_PAD)
    )
    catalog, model = serving_catalog(card, DEMO, instances.values())
    router = build_router(RouterSettings(mode=mode))
    for instance in instances.values():
        router.instance_added(card, instance)
    policy = Migration(catalog, router, client, DeclarationPreprocessors())
    served = RequestRecord("r", "/v1/chat/completions", FrontendMetrics())
    chat = parse_chat_request(
        {
            "model": DEMO,
            "messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": LONG_TEXT}]}],
        }
    )
    journey = await policy.begin(model, chat, request_id="m1", record=served, timeout_s=30)
    outputs: list[Output] = []
    first = None
    async for output in policy.outputs(journey):
        outputs.append(output)
        if len(outputs) == 3:
            first = served.instance_id
            assert first is not None
            procs[first].kill()
    assert outputs[-1].finish_reason == "stop"
    assert served.instance_id not in {None, first}
    assert outputs[-1].completion_tokens == sum(len(o.token_ids) for o in outputs)
    assert (served.kv_overlap_blocks is not None) == (mode == "kv")  # the KV router's figures, recorded
    if isinstance(router, KvRouting):  # every attempt's load was released, the dead one's too
        assert router.active_blocks(DEMO) == {}
    router.close()
