"""The frontend's view of instance load (``frontend/load.py``): saturation, busy, the model queue."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.frontend.load import LoadBoard, SaturatedError
from dynamo_prep.protocol.discovery import Instance, Load

MODEL = "kimi-k3-demo"


@pytest.fixture
def card() -> ModelDeploymentCard:
    return ModelDeploymentCard.from_model_dir(MODEL)


def instance(name: str, capacity: int | None = 2) -> Instance:
    return Instance(instance_id=name, endpoint=f"tcp://127.0.0.1:1{len(name)}", max_num_seqs=capacity)


def test_an_instance_is_saturated_by_its_own_and_the_others_requests(card: ModelDeploymentCard) -> None:
    board, a = LoadBoard(), instance("a")
    board.instance_added(card, a)
    board.acquire("a")
    assert not board.saturated(a)
    board.report("a", Load(unfinished=3))  # this frontend's one and two of others
    assert board.load("a") == 3 and board.saturated(a)
    board.release("a")  # ours ended: the others' two remain until the next report says otherwise
    assert board.load("a") == 2 and board.saturated(a)
    board.report("a", Load(unfinished=1))
    assert not board.saturated(a)
    assert not board.saturated(instance("b", capacity=None))  # a card without max_num_seqs: never


def test_busy_is_a_queue_whose_engine_steps(card: ModelDeploymentCard) -> None:
    board, a = LoadBoard(), instance("a")
    board.instance_added(card, a)
    assert not board.busy(a.endpoint)  # no report yet
    board.report("a", Load(unfinished=4, waiting=2, stalled_ms=100))
    assert board.busy(a.endpoint)
    board.report("a", Load(unfinished=4, waiting=2, stalled_ms=60_000))  # a queue that does not move
    assert not board.busy(a.endpoint)
    board.report("a", Load(unfinished=4, waiting=0))
    assert not board.busy(a.endpoint)
    board.instance_removed(MODEL, a)
    assert not board.busy(a.endpoint)


async def test_the_queue_is_bounded_and_wakes_its_waiters_in_order(card: ModelDeploymentCard) -> None:
    board = LoadBoard(max_queued=2, queue_timeout_s=30)
    board.instance_added(card, instance("a"))
    first, second = board.enqueue(MODEL), board.enqueue(MODEL)
    with pytest.raises(SaturatedError) as refused:
        board.enqueue(MODEL)
    assert refused.value.status == 503 and refused.value.retry_after_s
    deadline = asyncio.get_running_loop().time() + 30
    woken: list[str] = []

    async def wait(name: str, ticket: object) -> None:
        await board.wait(ticket, deadline)  # type: ignore[arg-type]
        woken.append(name)

    waiters = [asyncio.create_task(wait("first", first)), asyncio.create_task(wait("second", second))]
    board.release("a")  # a request ended on one of the model's instances (a wake before a wait counts)
    await asyncio.gather(*waiters)
    assert woken == ["first", "second"]
    board.leave(first)
    assert board.queued(MODEL) == 1


async def test_a_wait_past_its_deadline_is_a_503_with_retry_after(card: ModelDeploymentCard) -> None:
    board = LoadBoard(max_queued=4, queue_timeout_s=30)
    board.instance_added(card, instance("a"))
    ticket = board.enqueue(MODEL)
    with pytest.raises(SaturatedError) as refused:
        await board.wait(ticket, asyncio.get_running_loop().time())
    assert refused.value.retry_after_s
    board.leave(ticket)
    assert board.queued(MODEL) == 0
