"""``dynamo-prep watch`` is a faithful view of a real plane: real watch processes, real workers,
real brokers; joins, per-worker declarations, legacy flags, expiry after kill -9 and withdraw."""

from __future__ import annotations

from support.plane import DynamoProcess, start_dynamo, tcp_endpoint, wait_for

DEMO = "kimi-k3-demo"
FAST = ("--heartbeat", "0.2", "--ttl-ms", "1000")


def launch(procs: list[DynamoProcess], *args: str) -> DynamoProcess:
    proc = start_dynamo(*args, log_level="info")
    procs.append(proc)
    return proc


def worker(procs: list[DynamoProcess], discovery: str, *extra: str) -> tuple[DynamoProcess, str]:
    """A mock worker; returns it with its instance id."""
    proc = launch(procs, "worker", "--model-path", DEMO, "--discovery", discovery, *FAST, *extra)
    return proc, proc.wait_event("worker_started", timeout=20)["instance_id"]


def watch_started(proc: DynamoProcess) -> None:
    wait_for(
        lambda: any('"watch_started"' in line for line in proc.stderr_lines), 20, message="watch_started"
    )


def test_watch_json_follows_joins_declarations_legacy_kill_and_withdraw(procs: list[DynamoProcess]) -> None:
    address = tcp_endpoint()
    watch = launch(procs, "watch", "--bind", address, "--json")
    watch_started(watch)
    sglang, sglang_id = worker(procs, address, "--flavor", "sglang")
    vllm, vllm_id = worker(procs, address, "--flavor", "vllm")
    _legacy, legacy_id = worker(procs, address, "--flavor", "vllm", "--legacy-expands-image-pad-token")

    added = {
        instance_id: watch.wait_event("instance_added", instance_id=instance_id, timeout=20)
        for instance_id in (sglang_id, vllm_id, legacy_id)
    }
    assert watch.find("model_added", model=DEMO)
    assert added[sglang_id]["declared_token"] == "<|media_pad|>"  # SGLang's engine declares its pad
    assert added[vllm_id]["declared"] == "checkpoint default"  # vLLM declares nothing
    assert added[vllm_id]["declared_token"] is None
    assert added[legacy_id]["legacy"] == {"expands_image_pad_token": True}
    assert added[sglang_id]["legacy"] == {} and added[vllm_id]["legacy"] == {}
    assert watch.wait_event("legacy_card", instance_id=legacy_id)["legacy"] == {
        "expands_image_pad_token": True
    }
    conflicts = {event["instance_id"] for event in watch.find("runtime_config_conflict")}
    first = watch.find("model_added", model=DEMO)[0]
    assert first["model"] == DEMO
    assert len(conflicts) == 2  # the two instances that disagree with the first card's declaration
    assert added[sglang_id]["endpoint"] == sglang.wait_event("worker_started")["endpoint"]

    sglang.kill()  # no withdraw: gone after its TTL
    removed = watch.wait_event("instance_removed", instance_id=sglang_id, timeout=10)
    assert removed["reason"] == "expired"
    vllm.terminate()
    assert watch.wait_event("instance_removed", instance_id=vllm_id, timeout=10)["reason"] == "withdraw"
    assert vllm.wait() == 0
    assert not watch.find("model_removed")  # the legacy instance still serves the model
    assert not watch.find("instance_removed", instance_id=legacy_id)


def test_watch_behind_a_broker_and_its_one_shot_table(procs: list[DynamoProcess]) -> None:
    xsub, xpub = tcp_endpoint(), tcp_endpoint()
    broker = launch(procs, "broker", "--xsub", xsub, "--xpub", xpub)
    broker.wait_event("broker_started", timeout=20)
    watch = launch(procs, "watch", "--discovery", xpub, "--json")
    watch_started(watch)
    _sglang, sglang_id = worker(procs, xsub, "--flavor", "sglang")
    added = watch.wait_event("instance_added", instance_id=sglang_id, timeout=20)
    assert added["declared_token"] == "<|media_pad|>"

    # A late subscriber converges at once (the worker re-announces on subscription): the table.
    table = launch(procs, "watch", "--discovery", xpub, "--once-after", "2")
    assert table.wait(20) == 0
    text = "\n".join(table.raw)
    assert DEMO in text and sglang_id[:12] in text and "<|media_pad|>" in text, text

    # --json --once-after ends with a snapshot line.
    snap = launch(procs, "watch", "--discovery", xpub, "--json", "--once-after", "2")
    assert snap.wait(20) == 0
    snapshot = snap.find("snapshot")[0]
    assert snapshot["models"] == [DEMO]
    assert [row["instance_id"] for row in snapshot["instances"]] == [sglang_id]
    assert 0 <= snapshot["instances"][0]["heartbeat_age_s"] < 1.0


def test_watch_refuses_to_start_without_an_address(procs: list[DynamoProcess]) -> None:
    proc = launch(procs, "watch", "--json")
    assert proc.wait(20) == 1
    assert any('"watch_config_error"' in line for line in proc.stderr_lines)
