"""CURVE trust: key generation, allow-listed workers, the authenticated key per message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq
from support.plane import DynamoProcess, SubCollector, start_dynamo, tcp_endpoint, write_model_dir

from dynamo_prep.discovery.trust import (
    ServerCurve,
    TrustError,
    apply_server_curve,
    generate_keys,
    start_authenticator,
)
from dynamo_prep.protocol.discovery import Announce, DiscoveryMessage


def public_key(path: Path) -> str:
    public, _ = zmq.auth.load_certificate(path)
    return public.decode()


def cli_generate(directory: Path, name: str) -> tuple[Path, Path]:
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_prep.cli", "keys", "generate", str(directory), "--name", name],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    files = json.loads(result.stdout)
    return Path(files["public_key_file"]), Path(files["secret_key_file"])


def test_keys_generate_cli(tmp_path: Path) -> None:
    public, secret = cli_generate(tmp_path / "keys", "worker")
    assert public == tmp_path / "keys" / "worker.key"
    assert secret == tmp_path / "keys" / "worker.key_secret"
    assert zmq.auth.load_certificate(secret)[1] is not None
    assert zmq.auth.load_certificate(public)[1] is None
    assert secret.stat().st_mode & 0o077 == 0


def test_loaders_name_the_bad_file(tmp_path: Path) -> None:
    public, _ = generate_keys(tmp_path, "server")
    with pytest.raises(TrustError, match="no secret key"):
        ServerCurve.load(public, tmp_path)
    with pytest.raises(TrustError, match="allow-list"):
        ServerCurve.load(public, tmp_path / "missing")
    with pytest.raises(TrustError, match="cannot load"):
        ServerCurve.load(tmp_path / "nope.key_secret", tmp_path)


class CurveFrontend:
    """A frontend-style CURVE server: bound SUB, ZAP allow-list in the same context."""

    def __init__(self, server: ServerCurve) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.authenticator = start_authenticator(self.context, server.allow_dir)
        self.address = tcp_endpoint()
        self.collector = SubCollector(
            self.address, context=self.context, configure=lambda sock: apply_server_curve(sock, server)
        )

    def close(self) -> None:
        self.collector.close()
        self.authenticator.stop()
        self.context.term()


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    allow = tmp_path / "allow"
    allow.mkdir()
    server_public, server_secret = generate_keys(tmp_path / "server", "frontend")
    allowed_public, allowed_secret = generate_keys(tmp_path / "allowed", "worker-a")
    _, unknown_secret = generate_keys(tmp_path / "unknown", "worker-b")
    shutil.copy(allowed_public, allow)
    return {
        "allow": allow,
        "server_public": server_public,
        "server_secret": server_secret,
        "allowed_public": allowed_public,
        "allowed_secret": allowed_secret,
        "unknown_secret": unknown_secret,
    }


def curve_worker(procs: list[DynamoProcess], model: Path, address: str, secret: Path, server: Path) -> str:
    worker = start_dynamo(
        "worker",
        "--model-path",
        str(model),
        "--discovery",
        address,
        "--heartbeat",
        "0.1",
        "--curve-secret-key",
        str(secret),
        "--curve-server-key",
        str(server),
    )
    procs.append(worker)
    instance_id: str = worker.wait_event("publisher_started", curve=True)["instance_id"]
    return instance_id


def test_allow_list_accepts_a_known_worker_and_rejects_an_unknown_key(
    tmp_path: Path, keys: dict[str, Path], procs: list[DynamoProcess]
) -> None:
    frontend = CurveFrontend(ServerCurve.load(keys["server_secret"], keys["allow"]))
    try:
        model = write_model_dir(tmp_path / "m")
        unknown = curve_worker(procs, model, frontend.address, keys["unknown_secret"], keys["server_public"])
        allowed = curve_worker(procs, model, frontend.address, keys["allowed_secret"], keys["server_public"])

        def from_allowed(message: DiscoveryMessage) -> bool:
            return isinstance(message, Announce) and message.instance_id == allowed

        # Five heartbeats of the allowed worker: the unknown one had as long to get through.
        frontend.collector.wait_messages(from_allowed, count=5)
        received = frontend.collector.snapshot()
        assert {m.decode().instance_id for m in received} == {allowed}
        assert {m.user_id for m in received} == {public_key(keys["allowed_public"])}
        assert unknown not in {m.decode().instance_id for m in frontend.collector.snapshot()}
    finally:
        frontend.close()


def curve_broker(keys: dict[str, Path], procs: list[DynamoProcess]) -> tuple[DynamoProcess, str, str]:
    """A started CURVE broker (the server key, the allow-list directory): it and its XSUB / XPUB."""
    xsub, xpub = tcp_endpoint(), tcp_endpoint()
    secret, allow = str(keys["server_secret"]), str(keys["allow"])
    broker = start_dynamo(
        "broker", "--xsub", xsub, "--xpub", xpub, "--curve-secret-key", secret, "--curve-allow-dir", allow
    )
    procs.append(broker)
    broker.wait_event("broker_started", curve=True)
    return broker, xsub, xpub


def test_curve_broker_authenticates_workers(
    tmp_path: Path, keys: dict[str, Path], procs: list[DynamoProcess]
) -> None:
    _, xsub, xpub = curve_broker(keys, procs)
    with SubCollector(xpub, bind=False) as frontend:
        model = write_model_dir(tmp_path / "m")
        unknown = curve_worker(procs, model, xsub, keys["unknown_secret"], keys["server_public"])
        allowed = curve_worker(procs, model, xsub, keys["allowed_secret"], keys["server_public"])
        frontend.wait_messages(lambda m: m.instance_id == allowed, count=5)
        assert unknown not in {m.instance_id for m in frontend.decoded()}


def test_curve_broker_stops_forwarding_a_key_removed_from_the_allow_list(
    tmp_path: Path, keys: dict[str, Path], procs: list[DynamoProcess]
) -> None:
    revoked_public, revoked_secret = generate_keys(tmp_path / "revoked", "worker-c")
    shutil.copy(revoked_public, keys["allow"])
    broker, xsub, xpub = curve_broker(keys, procs)
    with SubCollector(xpub, bind=False) as frontend:
        model = write_model_dir(tmp_path / "m")
        allowed = curve_worker(procs, model, xsub, keys["allowed_secret"], keys["server_public"])
        revoked = curve_worker(procs, model, xsub, revoked_secret, keys["server_public"])
        frontend.wait_messages(lambda m: m.instance_id == revoked, count=3)
        (keys["allow"] / revoked_public.name).unlink()
        line = broker.wait_event("curve_keys_revoked")
        assert line["keys"] == [public_key(revoked_public)]

        def heard(instance_id: str) -> int:
            return sum(1 for m in frontend.decoded() if m.instance_id == instance_id)

        # Ten more heartbeats of the allowed worker (one second) flush whatever was in flight; ten
        # after that, the revoked worker (still running, still heartbeating) was not heard again.
        frontend.wait_messages(lambda m: m.instance_id == allowed, count=heard(allowed) + 10)
        before = heard(revoked)
        frontend.wait_messages(lambda m: m.instance_id == allowed, count=heard(allowed) + 10)
        assert heard(revoked) == before
        broker.wait_event("broker_dropped_revoked", key=public_key(revoked_public))
