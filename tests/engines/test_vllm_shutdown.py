"""How a real-engine worker ends (runs last, conftest.ENDS_THE_CLUSTER: it takes the shared
cluster's workers down). An engine that dies: the worker withdraws and exits 1. SIGTERM to the worker's main
process during a stream: withdraw, the stream finishes, the engine shuts down, exit 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from conftest import MODEL, Cluster, children
from support.plane import wait_for


def test_an_engine_that_dies_makes_its_worker_withdraw_and_exit_1(vllm_cluster: Cluster) -> None:
    doomed = vllm_cluster.workers[1]
    engine_processes = children(doomed.process.pid)
    assert engine_processes, "the vLLM engine runs in processes of its own"
    for pid in engine_processes:
        os.kill(pid, signal.SIGKILL)
    doomed.process.wait_event("engine_dead", timeout=60)
    assert doomed.process.wait(timeout=120) == 1
    assert doomed.process.find("card_withdrawn")
    vllm_cluster.frontend.wait_event(
        "instance_removed", timeout=30, instance_id=doomed.instance_id, reason="withdraw"
    )
    answer = vllm_cluster.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Still there?"}], max_tokens=4
    )
    assert answer.choices[0].finish_reason == "length"  # the other worker serves


def test_sigterm_during_a_stream_drains_it_then_stops_the_engine(vllm_cluster: Cluster) -> None:
    """The issue's scenario: SIGTERM to the worker's main process while a 400-token stream runs."""
    worker = vllm_cluster.workers[0]
    stream = vllm_cluster.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A long answer, please."}],
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    engine_processes = children(worker.process.pid)
    worker.process.terminate()  # SIGTERM to the main process only, as Kubernetes sends it
    rest = list(chunks)
    finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 400
    assert worker.process.wait(timeout=120) == 0
    order = [e["event"] for e in worker.process.snapshot()]
    steps = ["card_withdrawn", "worker_draining", "worker_stopped", "engine_stopped"]
    assert [order.index(step) for step in steps] == sorted(order.index(step) for step in steps)
    assert not worker.process.find("worker_drain_timeout")
    wait_for(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in engine_processes),
        30,
        message="the engine's processes to exit",
    )
