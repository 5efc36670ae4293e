"""Hostile input against real processes: a ``dynamo-prep frontend`` with one real mock worker, and an
attacker on loopback speaking raw pyzmq and raw HTTP. Each finding of the issue, reproduced: the
frontend keeps serving the healthy model, and ``/live`` keeps answering at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard, encode_card

K3 = "kimi-k3-demo"
LIVE_S = 1.0  # generous on 2 busy cores; benchmarks measure the real figure (the issue asks 50 ms)


@dataclass
class Target:
    tmp_path: Path
    procs: list[DynamoProcess]
    plane: str = field(default_factory=tcp_endpoint)
    port: int = field(default_factory=free_port)
    frontend: DynamoProcess | None = None
    worker_id: str = ""
    worker_endpoint: str = ""
    context: zmq.Context[Any] = field(default_factory=zmq.Context)
    attacker: zmq.Socket[Any] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        http = ("--http-host", "127.0.0.1", "--http-port", str(self.port))
        self.frontend = start_dynamo(
            "frontend", "--discovery-bind", self.plane, *http, "--cache-dir", str(self.tmp_path / "cache"),
            log_level="info",
        )  # fmt: skip
        self.procs.append(self.frontend)
        worker = start_dynamo(
            "worker",
            "--model-path",
            K3,
            "--discovery",
            self.plane,
            "--token-delay",
            "0",
            "--heartbeat",
            "0.3",
        )
        self.procs.append(worker)
        started = worker.wait_event("worker_started")
        self.worker_id, self.worker_endpoint = started["instance_id"], started["endpoint"]
        self.frontend.wait_event("model_added", timeout=30)

    def send(self, payload: dict[str, Any]) -> None:
        """One raw announce (or withdraw) on the plane, as an attacker writes it."""
        if self.attacker is None:
            self.attacker = self.context.socket(zmq.PUB)
            self.attacker.setsockopt(zmq.LINGER, 0)
            self.attacker.connect(self.plane)
        self.attacker.send_multipart([b"dynamo_prep.v1.card.dynamo", msgspec.msgpack.encode(payload)])

    def flood(self, announces: list[dict[str, Any]], until: Any, what: str) -> None:
        """Send the announces again and again (a fresh PUB's first messages are lost to the slow
        joiner; an attacker repeats anyway) until ``until()`` holds."""
        deadline = time.monotonic() + 20
        while not until():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            for payload in announces:
                self.send(payload)
            time.sleep(0.05)  # a resend period, not a synchronisation: ``until`` decides

    @staticmethod
    def announce(instance_id: str, *, seq: int, endpoint: str, card: dict[str, Any]) -> dict[str, Any]:
        """A raw announce (wire v1), with the longest TTL the schema allows."""
        fields = {"instance_id": instance_id, "seq": seq, "endpoint": endpoint, "card": card}
        return {"v": 1, "kind": "announce", "sent_ms": 0, "ttl_ms": 600_000, **fields}

    def chat(self, content: str = "hello", **fields: Any) -> httpx.Response:
        with httpx.Client(trust_env=False, timeout=60) as http:
            return http.post(
                f"{self.url}/v1/chat/completions",
                json={
                    "model": K3,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 8,
                    **fields,
                },
            )

    def live_s(self) -> float:
        with httpx.Client(trust_env=False, timeout=60) as http:
            started = time.monotonic()
            assert http.get(f"{self.url}/live").status_code == 200
            return time.monotonic() - started

    def close(self) -> None:
        if self.attacker is not None:
            self.attacker.close(linger=0)
        self.context.term()


@pytest.fixture
def target(tmp_path: Path, procs: list[DynamoProcess]) -> Iterator[Target]:
    made = Target(tmp_path, procs)
    made.start()
    yield made
    made.close()


def k3_card(**changes: Any) -> dict[str, Any]:
    card: dict[str, Any] = msgspec.msgpack.decode(encode_card(ModelDeploymentCard.from_model_dir(K3)))
    return {**card, **changes}


def test_a_forged_huge_seq_does_not_lock_the_real_worker_out(target: Target) -> None:
    assert target.frontend is not None
    # The attacker takes over the real worker's instance id with seq 2**64-1 and a black hole.
    forged = target.announce(target.worker_id, seq=2**64 - 1, endpoint="tcp://127.0.0.1:9", card=k3_card())
    target.flood([forged], lambda: target.frontend.find("card_rejected", reason="seq_jump"), "seq_jump")  # type: ignore[union-attr]
    assert [target.chat(f"q{index}").status_code for index in range(3)] == [200] * 3


def test_black_hole_announces_cost_one_fast_failover_not_ten_seconds(target: Target) -> None:
    assert target.frontend is not None
    holes = [  # nine instances of the real model at addresses that never answer
        target.announce(f"hole-{index}", seq=1, endpoint=f"tcp://127.0.0.1:{free_port()}", card=k3_card())
        for index in range(9)
    ]
    target.flood(holes, lambda: len(target.frontend.find("instance_added")) >= 10, "holes admitted")  # type: ignore[union-attr]
    started = time.monotonic()
    statuses = [target.chat(f"q{index}").status_code for index in range(10)]
    assert statuses == [200] * 10  # not 9/10 503s after 10 s each
    assert time.monotonic() - started < 30  # each hole costs at most the connect timeout, once
    assert target.live_s() < LIVE_S


def test_spoofed_model_names_do_not_delay_the_healthy_model(target: Target) -> None:
    assert target.frontend is not None
    spoofs = [  # 60 names, each a build that must fetch its files from a black hole
        target.announce(
            f"spoof-{index}",
            seq=1,
            endpoint=f"tcp://127.0.0.1:{free_port()}",
            card=k3_card(display_name=f"spoof-{index}", slug=f"spoof-{index}"),
        )
        for index in range(60)
    ]
    target.flood(spoofs, lambda: len(target.frontend.find("instance_added")) >= 61, "spoofs admitted")  # type: ignore[union-attr]
    started = time.monotonic()
    assert target.chat().status_code == 200
    assert time.monotonic() - started < 10  # was 97 s: builds have their own bounded threads
    assert target.live_s() < LIVE_S


def test_hostile_request_fields_are_400s_and_never_flood_the_log(target: Target) -> None:
    assert target.frontend is not None
    huge_name = "m" * 900_000
    with httpx.Client(trust_env=False, timeout=60) as http:
        named = http.post(
            f"{target.url}/v1/chat/completions",
            json={"model": huge_name, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-request-id": "huge-name"},
        )
    assert named.status_code == 400
    line = target.frontend.wait_event("request_failed", request_id="huge-name")
    assert len(json.dumps(line)) < 2_000
    for fields in ({"seed": 2**70}, {"max_tokens": 10**30}, {"stop_token_ids": [2**65]}):
        assert target.chat(**fields).status_code == 400, fields
    for url in ("data:text/html;base64,PGgxPg==", "http://exa mple.com/a.png", "javascript:alert(1)"):
        image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
        with httpx.Client(trust_env=False, timeout=60) as http:
            answer = http.post(f"{target.url}/v1/chat/completions", json={"model": K3, "messages": [image]})
        assert answer.status_code == 400 and "image" in answer.json()["error"]["message"], url
    assert not target.frontend.find("request_crashed")


def test_junk_instances_cannot_fill_the_table_against_a_real_worker(target: Target) -> None:
    """The table is bounded (16,384); junk evicts junk, and a new real worker still gets in."""
    assert target.frontend is not None
    junk = [
        target.announce(
            f"junk-{index}",
            seq=1,
            endpoint="tcp://127.0.0.1:9",
            card=k3_card(display_name=f"junk-{index % 30}", slug=f"junk-{index % 30}"),
        )
        for index in range(300)
    ]
    target.flood(junk, lambda: len(target.frontend.find("instance_added")) >= 301, "junk admitted")  # type: ignore[union-attr]
    second = start_dynamo("worker", "--model-path", K3, "--discovery", target.plane, "--token-delay", "0")
    target.procs.append(second)
    instance_id = second.wait_event("worker_started")["instance_id"]
    target.frontend.wait_event("instance_added", instance_id=instance_id, timeout=20)
    assert target.chat().status_code == 200


@pytest.mark.parametrize(
    "changes",
    [
        {"kv_cache_block_size": 0},  # issue 20: the frontend exited in 0.5 s (a component's ValueError)
        {"kv_cache_block_size": 1 << 20},
        {"context_length": 0},
        {"migration_limit": -1},
        {"runtime_config": {"total_kv_blocks": -5}},
        {"runtime_config": {"max_num_seqs": -1}},
    ],
)
def test_a_card_with_figures_no_engine_has_is_refused_at_the_edge(
    target: Target, changes: dict[str, Any]
) -> None:
    """Every figure a component computes with is bounded where the card is decoded: a bad card is
    refused and logged, the frontend and the healthy model keep serving."""
    assert target.frontend is not None
    field_name = next(iter(changes))
    bad = target.announce("bad-card", seq=1, endpoint="tcp://127.0.0.1:9", card=k3_card(**changes))
    target.flood([bad], lambda: target.frontend.find("card_rejected"), "card_rejected")  # type: ignore[union-attr]
    rejected = target.frontend.find("card_rejected")[0]
    assert field_name in rejected["detail"]
    assert not target.frontend.find("instance_added", instance_id="bad-card")
    assert target.frontend.process.poll() is None
    assert target.chat().status_code == 200
    assert target.live_s() < LIVE_S
