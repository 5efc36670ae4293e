"""The deployment manifests under deploy/ are validated, not hoped for.

Every kustomization is rendered (tests/support/kustomize.py; checked against ``kubectl
kustomize`` where kubectl exists), every object is validated offline against the Kubernetes 1.30
schemas (strict: unknown fields fail), and the manifests are checked against the real CLI: each
container's args are parsed by ``dynamo_prep.cli.parse_args`` under the container's environment,
every worker's options are validated by ``WorkerConfig.from_options`` (what ``dynamo-prep worker``
hands it, with CURVE keys generated as the Secret holds them), and ports, addresses, probes,
NetworkPolicies, CURVE files and grace periods must line up. Real-engine workers are also checked
for what an engine needs: a GPU per tensor-parallel rank, the model directory mounted read-only,
shared memory, a KV-events config the worker advertises on a declared port that frontends (only)
can reach, and one KV block size per model.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
from support.kustomize import KustomizeError, build, object_id

from dynamo_prep import cli
from dynamo_prep.discovery.publisher import STOP_LINGER_MS
from dynamo_prep.discovery.trust import ClientCurve, ServerCurve, generate_keys
from dynamo_prep.engines.kv_config import kv_events_endpoint
from dynamo_prep.frontend.http_server import GRACE_S
from dynamo_prep.worker import process as worker_process
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.server import STOP_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUSTOMIZE = DEPLOY / "kustomize"
RENDERS = ("base", "overlays/dev", "overlays/prod")
OVERLAYS = ("overlays/dev", "overlays/prod")
K8S_VERSION = "1.30"
MARGIN_S = 2.0
POD_IP = "10.1.2.3"
# Linux's default ephemeral range (ip_local_port_range): where the worker's ROUTER port lands.
EPHEMERAL_PORTS = (32768, 60999)
# The real engines' worker images: deploy/Dockerfile.<engine>, FROM the engine's official image.
ENGINE_IMAGES = {"vllm": "vllm/vllm-openai", "sglang": "lmsysorg/sglang"}
# Engine flags (the engines' own names) for the tensor parallel size, the KV block size (the card's
# kv_cache_block_size: one per model) and the model (overriding --model-path as the engine's model).
TP_FLAGS = {"vllm": ("--tensor-parallel-size", "-tp"), "sglang": ("--tp-size", "--tensor-parallel-size")}
BLOCK_FLAGS = {"vllm": "--block-size", "sglang": "--page-size"}
MODEL_FLAG = "--model"
GPU = "nvidia.com/gpu"
# After the worker has stopped, the engine shuts down: vLLM gives its engine core processes 5 s
# after SIGTERM before it kills them (vllm/v1/utils.py shutdown); SGLang kills its process tree.
ENGINE_SHUTDOWN_S = 5.0
# An engine loads its model before the worker serves (and opens its metrics port): the probes must
# allow at least this long for it.
ENGINE_LOAD_S = 600

Obj = dict[str, Any]


@pytest.fixture(scope="module", params=RENDERS)
def render(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, build(KUSTOMIZE / request.param)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, build(KUSTOMIZE / request.param)


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The dynamo-prep-curve Secret as `dynamo-prep keys generate DIR --name broker|worker` writes
    it: "dynamo-prep-curve/KEY" -> a file holding that key."""
    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys, "broker")
    generate_keys(keys, "worker")
    return {f"dynamo-prep-curve/{path.name}": path for path in keys.iterdir()}


# ---------------------------------------------------------------------------------------------
# helpers


def _objects(objects: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def _component(objects: list[Obj], component: str) -> list[Obj]:
    return [
        obj
        for obj in _objects(objects, "Deployment")
        if obj["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]


def _pod_labels(deployment: Obj) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def _pod_spec(deployment: Obj) -> Obj:
    spec: Obj = deployment["spec"]["template"]["spec"]
    return spec


def _container(deployment: Obj) -> Obj:
    containers = _pod_spec(deployment)["containers"]
    assert len(containers) == 1, f"{deployment['metadata']['name']}: one container expected"
    container: Obj = containers[0]
    return container


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked here: {selector}"
    return all(labels.get(key) == value for key, value in (selector.get("matchLabels") or {}).items())


def _env(container: Obj) -> dict[str, str]:
    """The container's environment as the process sees it (the pod IP stands for status.podIP)."""
    env = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, item
            env[item["name"]] = POD_IP
    return env


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    try:
        for name in [name for name in os.environ if name.startswith("DYN")]:
            del os.environ[name]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _parse(argv: list[str], env: dict[str, str], where: str) -> argparse.Namespace:
    """Parse as ``dynamo-prep`` does (``worker``: the flags it does not know become ``engine_args``);
    its env-var defaults are read from ``env``."""
    with _environ(env):
        try:
            return cli.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{where}: dynamo-prep rejects {argv!r} (exit {exc.code}); see stderr")


def _cli(deployment: Obj) -> argparse.Namespace:
    container = _container(deployment)
    assert container["command"] == ["dynamo-prep"], container["command"]
    return _parse(list(container["args"]), _env(container), deployment["metadata"]["name"])


def _worker_options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``dynamo-prep worker`` hands the worker process: its own handler, with ``run_worker``
    (which validates them with ``WorkerConfig.from_options`` first) replaced by a recorder."""
    assert args.command == "worker", args.command
    options: dict[str, Any] = {}

    def record(**given: Any) -> int:
        options.update(given)
        return 0

    with mock.patch.object(worker_process, "run_worker", record):
        assert args.handler(args) == 0
    return options


def _worker_check(
    args: argparse.Namespace, where: str, key_files: dict[str, Path] | None = None
) -> WorkerConfig:
    """The worker's own validation of its options; ``key_files`` maps the CURVE key paths given
    in the args to real key files (nothing else is read from disk: the model directory is loaded
    when the process starts, and the engine flags by the engine's own parser)."""
    options = _worker_options(args)
    for flag in ("curve_secret_key", "curve_server_key"):
        if options.get(flag) is not None:
            assert key_files is not None and str(options[flag]) in key_files, (
                f"{where}: {options[flag]} is not a mounted key of the Secret"
            )
            options[flag] = key_files[str(options[flag])]
    try:
        return WorkerConfig.from_options(**options)
    except ValueError as exc:  # TrustError for the key files is a ValueError too
        pytest.fail(f"{where}: the worker refuses its options: {exc}")


def _worker_config(deployment: Obj, secret: dict[str, Path]) -> WorkerConfig:
    files = {path: secret[key] for path, key in _secret_files(deployment).items()}
    return _worker_check(_cli(deployment), deployment["metadata"]["name"], files)


def _port(container: Obj, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        assert any(p["containerPort"] == name_or_number for p in container["ports"]), name_or_number
        return name_or_number
    matches = [p["containerPort"] for p in container["ports"] if p.get("name") == name_or_number]
    assert len(matches) == 1, f"container port {name_or_number!r} not declared"
    port: int = matches[0]
    return port


def _tcp_port(address: str) -> tuple[str, int]:
    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", address)
    assert match, f"not a tcp://HOST:PORT address: {address}"
    return match.group(1), int(match.group(2))


def _services_for(objects: list[Obj], deployment: Obj) -> list[Obj]:
    return [
        svc
        for svc in _objects(objects, "Service")
        if _selects({"matchLabels": svc["spec"]["selector"]}, _pod_labels(deployment))
    ]


def _broker_services(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(Service, Deployment) per broker: each broker has its own Service."""
    pairs = []
    for broker in _component(objects, "broker"):
        services = _services_for(objects, broker)
        assert len(services) == 1, f"{broker['metadata']['name']}: exactly one Service expected"
        pairs.append((services[0], broker))
    return pairs


def _service_port(service: Obj, deployment: Obj, name: str) -> int:
    """The Service port called ``name``; its targetPort must be the container's port."""
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == name]
    assert _port(_container(deployment), port["targetPort"]) == port["port"], port
    number: int = port["port"]
    return number


def _prestop_s(container: Obj) -> float:
    pre_stop = (container.get("lifecycle") or {}).get("preStop")
    if pre_stop is None:
        return 0.0
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def _secret_files(deployment: Obj) -> dict[str, str]:
    """File path in the container -> Secret key, for every secret volume mount."""
    volumes = {v["name"]: v for v in _pod_spec(deployment).get("volumes") or []}
    files = {}
    for mount in _container(deployment).get("volumeMounts") or []:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        assert mount.get("readOnly") is True, mount
        for item in secret["items"]:
            files[f"{mount['mountPath']}/{item['path']}"] = f"{secret['secretName']}/{item['key']}"
    return files


def _component_of(deployment: Obj) -> str:
    return _pod_labels(deployment)["app.kubernetes.io/component"]


def _ingress(objects: list[Obj], deployment: Obj) -> dict[str, set[tuple[int, int]]]:
    """Who may reach ``deployment``'s pods: source component (or "*" for anyone) -> allowed
    (port, endPort) ranges. A named port counts only where the pod's container declares it."""
    declared = _container(deployment).get("ports") or []
    grants: dict[str, set[tuple[int, int]]] = {}
    for policy in _objects(objects, "NetworkPolicy"):
        if not _selects(policy["spec"]["podSelector"], _pod_labels(deployment)):
            continue
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            ranges: set[tuple[int, int]] = set()
            for port in rule["ports"]:
                assert port["protocol"] == "TCP", port
                if isinstance(port["port"], str):
                    assert "endPort" not in port, port
                    ranges.update(
                        (p["containerPort"],) * 2 for p in declared if p.get("name") == port["port"]
                    )
                else:
                    ranges.add((port["port"], port.get("endPort", port["port"])))
            sources = ["*"] if not rule.get("from") else []
            for peer in rule.get("from") or []:
                assert set(peer) == {"podSelector"}, peer
                sources += [
                    _component_of(d)
                    for d in _objects(objects, "Deployment")
                    if _selects(peer["podSelector"], _pod_labels(d))
                ]
            for source in sources:
                grants.setdefault(source, set()).update(ranges)
    return grants


def _reaches(grants: dict[str, set[tuple[int, int]]], source: str, port: int) -> bool:
    return any(low <= port <= high for low, high in grants.get(source, ()))


def _mount(deployment: Obj, path: str | Path) -> tuple[Obj, Obj]:
    """The container's volumeMount holding ``path`` (the deepest one) and its volume."""
    path = Path(path)
    mounts = [
        m
        for m in _container(deployment).get("volumeMounts") or []
        if path == Path(m["mountPath"]) or Path(m["mountPath"]) in path.parents
    ]
    assert mounts, f"{deployment['metadata']['name']}: nothing is mounted at {path}"
    mount = max(mounts, key=lambda m: len(Path(m["mountPath"]).parts))
    (volume,) = [v for v in _pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def _engine_flags(engine_args: Sequence[str]) -> dict[str, str | None]:
    """The engine flags as {flag: value} (None for a switch), ``--flag value`` or ``--flag=value``."""
    flags: dict[str, str | None] = {}
    rest = list(engine_args)
    while rest:
        arg = rest.pop(0)
        assert arg.startswith("-"), f"engine flags: {arg!r} follows no flag"
        name, equals, value = arg.partition("=")
        given: str | None = value if equals else None
        if not equals and rest and not rest[0].startswith("-"):
            given = rest.pop(0)
        assert name not in flags, f"engine flag {name} is given twice"
        flags[name] = given
    return flags


def _engine(deployment: Obj) -> str:
    """The worker's --engine ("mock" for the mock engine); "" for other commands."""
    args = _cli(deployment)
    return str(args.engine) if args.command == "worker" else ""


def _image_repository(image: str) -> str:
    """registry.example.com/dynamo-prep-vllm:0.1.0 -> dynamo-prep-vllm."""
    name = image.partition("@")[0].rpartition("/")[2]
    return name.partition(":")[0]


def _dockerfile(engine: str) -> Path:
    return DEPLOY / ("Dockerfile" if engine in ("", "mock") else f"Dockerfile.{engine}")


def _dockerfile_env(dockerfile: Path, name: str) -> str:
    (value,) = re.findall(rf"^ENV {name}=(\S+)$", dockerfile.read_text(encoding="utf-8"), re.M)
    return str(value)


# ---------------------------------------------------------------------------------------------
# rendering and schemas


def _kubectl_kustomize(directory: Path) -> dict[tuple[str, str, str], Obj] | None:
    """``kubectl kustomize DIR``'s objects by id; None without a kubectl that has kustomize."""
    import yaml  # noqa: PLC0415

    if shutil.which("kubectl") is None:
        return None
    result = subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0 and "unknown command" in result.stderr:
        return None
    assert result.returncode == 0, result.stderr
    return {object_id(obj): obj for obj in yaml.safe_load_all(result.stdout) if obj}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
@pytest.mark.parametrize("path", [*RENDERS, "engines"])
def test_the_loader_renders_what_kubectl_kustomize_renders(path: str) -> None:
    real = _kubectl_kustomize(KUSTOMIZE / path)
    if real is None:
        pytest.skip("this kubectl has no kustomize")
    ours = {object_id(obj): obj for obj in build(KUSTOMIZE / path)}
    assert ours == real


def test_every_rendered_object_validates_against_the_kubernetes_schemas(
    render: tuple[str, list[Obj]],
) -> None:
    name, objects = render
    assert objects
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:  # pragma: no cover - the failure message
            pytest.fail(f"{name}: {object_id(obj)}: {exc.message} at {list(exc.path)}")


def test_deployment_selectors_match_their_pods_and_services_select_one_workload(
    render: tuple[str, list[Obj]],
) -> None:
    _, objects = render
    deployments = _objects(objects, "Deployment")
    for deployment in deployments:
        assert _selects(deployment["spec"]["selector"], _pod_labels(deployment)), deployment["metadata"]
        # Mock and engine workers share labels: no Deployment may claim another one's pods.
        claimed = [d for d in deployments if _selects(deployment["spec"]["selector"], _pod_labels(d))]
        assert claimed == [deployment], f"{deployment['metadata']['name']}'s selector overlaps another's pods"
    for service in _objects(objects, "Service"):
        selected = [
            d for d in deployments if _selects({"matchLabels": service["spec"]["selector"]}, _pod_labels(d))
        ]
        assert len(selected) == 1, (
            f"Service {service['metadata']['name']} selects {len(selected)} Deployments"
        )
        for port in service["spec"]["ports"]:
            _service_port(service, selected[0], port["name"])


def test_every_container_requests_resources_and_runs_locked_down(render: tuple[str, list[Obj]]) -> None:
    name, objects = render
    for deployment in _objects(objects, "Deployment"):
        pod = _pod_spec(deployment)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), deployment["metadata"]["name"]
            assert "memory" in resources["limits"], deployment["metadata"]["name"]
            if name == "overlays/prod":  # Guaranteed QoS
                assert resources["requests"] == resources["limits"], deployment["metadata"]["name"]
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False


def test_images_are_the_placeholder_in_base_and_dev_and_pinned_in_prod(render: tuple[str, list[Obj]]) -> None:
    """dynamo-prep (deploy/Dockerfile) everywhere but for real engines, which run their engine's
    image with this project (deploy/Dockerfile.<engine>: dynamo-prep-<engine>)."""
    name, objects = render
    images: dict[str, set[str]] = {}
    for deployment in _objects(objects, "Deployment"):
        engine = _engine(deployment)
        image = _container(deployment)["image"]
        expected = "dynamo-prep" if engine in ("", "mock") else f"dynamo-prep-{engine}"
        assert _image_repository(image) == expected, (deployment["metadata"]["name"], image)
        images.setdefault(expected, set()).add(image)
    assert all(len(versions) == 1 for versions in images.values()), f"one version of each image: {images}"
    if name == "overlays/prod":
        assert set(images) == {"dynamo-prep", "dynamo-prep-vllm", "dynamo-prep-sglang"}
        registries = set()
        for (image,) in images.values():
            tag = image.partition("@")[0].rpartition("/")[2].partition(":")[2]
            assert (tag and tag != "latest") or "@" in image, f"{image} is not pinned"
            registries.add(image.rpartition("/")[0])
        assert len(registries) == 1 and "" not in registries, f"one registry expected: {registries}"
    else:
        assert images == {"dynamo-prep": {"dynamo-prep:latest"}}


# ---------------------------------------------------------------------------------------------
# the manifests against the CLI


def test_every_container_args_parse_with_the_real_cli_and_workers_accept_their_options(
    render: tuple[str, list[Obj]], secret: dict[str, Path]
) -> None:
    _, objects = render
    commands = {_cli(deployment).command for deployment in _objects(objects, "Deployment")}
    assert commands == {"frontend", "broker", "worker"}
    for deployment in _objects(objects, "Deployment"):
        args = _cli(deployment)
        if args.command != "worker":
            assert args.engine_args == []
            continue
        config = _worker_config(deployment, secret)
        assert config.engine_args == tuple(args.engine_args)
        assert (config.curve is None) == (args.curve_secret_key is None)


def test_an_unknown_flag_or_a_bad_value_fails_the_check() -> None:
    worker = ["worker", "--model-path", "m", "--discovery", "tcp://b:7555"]
    # A real engine takes the flags the worker does not know (its own parser reads them at start).
    engine = [*worker, "--engine", "vllm", "--block-size", "16", "--kv-events-config", "{}"]
    config = _worker_check(_parse(engine, {}, "engine flags"), "engine flags")
    assert config.engine_args == ("--block-size", "16", "--kv-events-config", "{}")
    refused_by_the_parser = (
        ["broker", "--bogus"],
        ["frontend", "--bogus"],
        ["frontend", "--http-port", "eighty"],
        [*worker, "--engine", "tensorrt"],
        [*worker, "--drain-timeout", "soon"],
    )
    for argv in refused_by_the_parser:
        with pytest.raises(pytest.fail.Exception):
            _parse(argv, {}, "mutated manifest")
    refused_by_the_worker = (
        [*worker, "--bogus"],  # the mock engine takes no engine flags
        [*worker, "--engine", "mock", "--kv-events-config", "{}"],
        [*worker, "--drain", "5"],  # no abbreviations: an engine flag, refused by the mock
        [*worker, "--engine", "vllm", "--flavor", "vllm"],  # a mock option with a real engine
        [*worker, "--engine", "sglang", "--kv-events"],
        [*worker, "--drain-timeout", "-1"],
    )
    for argv in refused_by_the_worker:
        args = _parse(argv, {}, "mutated manifest")
        with pytest.raises(pytest.fail.Exception):
            _worker_check(args, "mutated manifest")


def test_every_dyn_environment_variable_is_one_the_code_reads(render: tuple[str, list[Obj]]) -> None:
    _, objects = render
    source = "\n".join(path.read_text(encoding="utf-8") for path in (ROOT / "dynamo_prep").rglob("*.py"))
    known = set(re.findall(r"\"(DYN_[A-Z_]+)\"", source))
    for deployment in _objects(objects, "Deployment"):
        for name in _env(_container(deployment)):
            if name.startswith("DYN"):
                assert name in known, f"{deployment['metadata']['name']}: {name} is read by nothing"


def test_brokers_listen_on_their_service_ports(overlay: tuple[str, list[Obj]]) -> None:
    name, objects = overlay
    pairs = _broker_services(objects)
    assert len(pairs) == (1 if name == "overlays/dev" else 2)
    for service, broker in pairs:
        args = _cli(broker)
        assert args.command == "broker"
        for flag, port_name in ((args.xsub, "xsub"), (args.xpub, "xpub")):
            host, port = _tcp_port(flag)
            assert host == "0.0.0.0"
            assert port == _port(_container(broker), port_name) == _service_port(service, broker, port_name)
        assert broker["spec"]["strategy"]["type"] == "Recreate", "one pod per broker Service"


def test_workers_announce_to_every_broker_xsub_and_frontends_subscribe_to_every_xpub(
    overlay: tuple[str, list[Obj]], secret: dict[str, Path]
) -> None:
    _, objects = overlay
    pairs = _broker_services(objects)
    xsub = [f"tcp://{svc['metadata']['name']}:{_service_port(svc, broker, 'xsub')}" for svc, broker in pairs]
    xpub = [f"tcp://{svc['metadata']['name']}:{_service_port(svc, broker, 'xpub')}" for svc, broker in pairs]
    workers = _component(objects, "worker")
    configs = [_worker_config(worker, secret) for worker in workers]
    assert {config.flavor for config in configs} == {"sglang", "vllm"}, "both image contracts are served"
    for worker, config in zip(workers, configs, strict=True):
        assert list(config.discovery) == xsub
        assert config.metrics_port == _port(_container(worker), "metrics")
        annotations = worker["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(config.metrics_port)
        assert config.endpoint_host == POD_IP, "the request plane must bind and advertise the pod IP"
    frontends = _component(objects, "frontend")
    assert len(frontends) == 1
    args = _cli(frontends[0])
    assert args.discovery == xpub
    assert args.discovery_bind is None
    assert {config.namespace for config in configs} == {args.namespace}


def test_dev_runs_gpu_free_mock_workers_and_prod_real_engines(
    overlay: tuple[str, list[Obj]], secret: dict[str, Path]
) -> None:
    name, objects = overlay
    engines = {_worker_config(worker, secret).engine for worker in _component(objects, "worker")}
    gpus = [
        deployment["metadata"]["name"]
        for deployment in _objects(objects, "Deployment")
        if GPU in _container(deployment)["resources"].get("limits", {})
    ]
    if name == "overlays/dev":
        assert engines == {"mock"}
        assert gpus == [], "dev runs on any cluster (kind, minikube): no GPU"
    else:
        assert engines == {"vllm", "sglang"}, "prod serves real engines only (no demo model)"
        assert sorted(gpus) == sorted(d["metadata"]["name"] for d in _component(objects, "worker"))


def test_the_frontend_serves_and_probes_on_its_http_port(overlay: tuple[str, list[Obj]]) -> None:
    _, objects = overlay
    (frontend,) = _component(objects, "frontend")
    container = _container(frontend)
    args = _cli(frontend)
    port = _port(container, "http")
    assert args.http_port == port
    assert frontend["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    (service,) = _services_for(objects, frontend)
    assert _service_port(service, frontend, "http") == port
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/live")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert _port(container, get["port"]) == port
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert str(args.cache_dir) in mounts, "the cache must be writable (read-only root filesystem)"


def test_grace_periods_cover_withdraw_and_drain(overlay: tuple[str, list[Obj]]) -> None:
    _, objects = overlay
    for worker in _component(objects, "worker"):
        container = _container(worker)
        args = _cli(worker)
        needed = _prestop_s(container) + args.drain_timeout + STOP_TIMEOUT_S + STOP_LINGER_MS / 1000
        if args.engine != "mock":  # then the engine shuts down
            needed += ENGINE_SHUTDOWN_S
        assert _pod_spec(worker)["terminationGracePeriodSeconds"] >= needed + MARGIN_S, worker["metadata"]
        assert _prestop_s(container) == 0, "a preStop hook would only delay the worker's withdraw"
    (frontend,) = _component(objects, "frontend")
    pre_stop = _prestop_s(_container(frontend))
    assert pre_stop > 0, "the frontend keeps serving while endpoints stop routing to it"
    assert _pod_spec(frontend)["terminationGracePeriodSeconds"] >= pre_stop + GRACE_S + MARGIN_S


def test_curve_is_on_in_base_and_prod_and_off_in_dev(render: tuple[str, list[Obj]], tmp_path: Path) -> None:
    name, objects = render
    brokers = _component(objects, "broker")
    workers = _component(objects, "worker")
    (frontend,) = _component(objects, "frontend")
    assert _cli(frontend).curve_secret_key is None, "behind brokers the frontend takes no CURVE keys"
    if name == "overlays/dev":
        for deployment in [*brokers, *workers]:
            args = _cli(deployment)
            for flag in ("curve_secret_key", "curve_allow_dir", "curve_server_key"):
                assert getattr(args, flag, None) is None, (deployment["metadata"]["name"], flag)
            assert not any("secret" in v for v in _pod_spec(deployment).get("volumes") or [])
        return
    # The Secret's layout is what `dynamo-prep keys generate DIR --name broker|worker` writes.
    keys = tmp_path / "keys"
    generate_keys(keys, "broker")
    generate_keys(keys, "worker")
    secret = {f"dynamo-prep-curve/{path.name}": path for path in keys.iterdir()}
    broker_keys = set()
    for broker in brokers:
        args, files = _cli(broker), _secret_files(broker)
        broker_secret = secret[files[str(args.curve_secret_key)]]
        allow = tmp_path / f"allow-{broker['metadata']['name']}"
        allow.mkdir()
        for path, key in files.items():
            if path.startswith(f"{args.curve_allow_dir}/"):
                shutil.copy(secret[key], allow / Path(path).name)
        broker_keys.add(ServerCurve.load(broker_secret, allow).public_key)
        assert [p.name for p in allow.iterdir()] == ["worker.key"], "the allow-list holds public keys"
    for worker in workers:
        args, files = _cli(worker), _secret_files(worker)
        client = ClientCurve.load(
            secret[files[str(args.curve_secret_key)]], secret[files[str(args.curve_server_key)]]
        )
        assert broker_keys == {client.server_key}, "workers must trust the (one) brokers' key"


def test_network_policies_only_let_workers_reach_xsub(overlay: tuple[str, list[Obj]]) -> None:
    _, objects = overlay
    policies = _objects(objects, "NetworkPolicy")
    for deployment in _objects(objects, "Deployment"):
        assert any(_selects(p["spec"]["podSelector"], _pod_labels(deployment)) for p in policies), (
            f"{deployment['metadata']['name']} is not covered by a NetworkPolicy (ingress open)"
        )
    for _, broker in _broker_services(objects):
        xsub = _tcp_port(_cli(broker).xsub)[1]
        xpub = _tcp_port(_cli(broker).xpub)[1]
        assert _ingress(objects, broker) == {"worker": {(xsub, xsub)}, "frontend": {(xpub, xpub)}}
    (frontend,) = _component(objects, "frontend")
    http = _cli(frontend).http_port
    assert _ingress(objects, frontend) == {"*": {(http, http)}}
    for worker in _component(objects, "worker"):
        grants = _ingress(objects, worker)
        # The worker's ROUTER binds an OS-chosen port: frontends (only) may reach the whole range
        # (and an engine's KV-event ports: test_engine_workers_publish_kv_events_to_frontends_only).
        assert set(grants) == {"frontend", "*"}
        assert any(lo <= EPHEMERAL_PORTS[0] and EPHEMERAL_PORTS[1] <= hi for lo, hi in grants["frontend"])
        # Anyone else (Prometheus) reaches only the metrics port.
        metrics = _cli(worker).metrics_port
        assert grants["*"] == {(metrics, metrics)}


# ---------------------------------------------------------------------------------------------
# real-engine workers (deploy/kustomize/engines, in prod)


EngineWorker = tuple[Obj, WorkerConfig, dict[str, str | None]]


def _engine_workers(objects: list[Obj], secret: dict[str, Path]) -> list[EngineWorker]:
    """(Deployment, validated options, engine flags) of every worker running a real engine."""
    found = []
    for worker in _component(objects, "worker"):
        config = _worker_config(worker, secret)
        if config.real_engine:
            found.append((worker, config, _engine_flags(config.engine_args)))
    return found


def test_engine_workers_publish_kv_events_to_frontends_only(
    overlay: tuple[str, list[Obj]], secret: dict[str, Path]
) -> None:
    _, objects = overlay
    (frontend,) = _component(objects, "frontend")
    engines = _engine_workers(objects, secret)
    for worker, config, flags in engines:
        where = worker["metadata"]["name"]
        text = flags.get("--kv-events-config")
        assert text, f"{where}: no --kv-events-config: the KV router would not see the engine's cache"
        assert isinstance(json.loads(text), dict), f"{where}: --kv-events-config is not a JSON object"
        # What the worker will advertise in its announce (the engine's own publisher).
        endpoint = kv_events_endpoint(text, flavor=config.flavor, endpoint_host=config.endpoint_host)
        assert endpoint is not None, f"{where}: the worker would advertise no KV events (see the log)"
        assert endpoint.replay_endpoint is not None, f"{where}: without replay a gap drops the blocks"
        grants = _ingress(objects, worker)
        for address in (endpoint.endpoint, endpoint.replay_endpoint):
            host, port = _tcp_port(address)
            assert host == POD_IP, f"{where}: frontends must connect to the pod IP, not {address}"
            _port(_container(worker), port)  # a declared container port
            assert _reaches(grants, "frontend", port), f"{where}: frontends cannot reach {address}"
            assert not _reaches(grants, "*", port), f"{where}: {address} is open to anyone"
    if engines:
        assert _cli(frontend).router_mode == "kv", "the engines publish KV events: route by them"


def test_engine_workers_get_gpus_the_model_shared_memory_and_writable_caches(
    overlay: tuple[str, list[Obj]], secret: dict[str, Path]
) -> None:
    _, objects = overlay
    block_sizes: dict[Path, set[int]] = {}
    for worker, config, flags in _engine_workers(objects, secret):
        where = worker["metadata"]["name"]
        resources = _container(worker)["resources"]
        tensor_parallel = next((flags[f] for f in TP_FLAGS[config.engine] if f in flags), "1")
        assert (
            int(resources["requests"][GPU]) == int(resources["limits"][GPU]) == int(str(tensor_parallel))
        ), f"{where}: one GPU per tensor parallel rank, requested and limited"
        # The card is read from --model-path; the engine loads it (or the engine flags' --model).
        engine_model = flags.get(MODEL_FLAG)
        for model in {config.model_dir, *([Path(engine_model)] if engine_model else [])}:
            assert model.is_absolute(), f"{where}: {model} is not a mounted directory"
            mount, volume = _mount(worker, model)
            assert mount.get("readOnly") is True, f"{where}: mount the model read-only"
            claim = volume.get("persistentVolumeClaim")
            assert (claim is not None and claim.get("readOnly") is True) or "hostPath" in volume, volume
        block = flags.get(BLOCK_FLAGS[config.engine])
        assert block is not None and int(block) > 0, f"{where}: set {BLOCK_FLAGS[config.engine]}"
        block_sizes.setdefault(config.model_dir, set()).add(int(block))
        mount, volume = _mount(worker, "/dev/shm")
        assert mount["mountPath"] == "/dev/shm", f"{where}: the engine needs shared memory"
        assert volume["emptyDir"]["medium"] == "Memory"
        # The root filesystem is read-only: the engine's caches (under HOME) and /tmp are not.
        for writable in (_dockerfile_env(_dockerfile(config.engine), "HOME"), "/tmp"):
            mount, volume = _mount(worker, writable)
            assert mount["mountPath"] == writable and "emptyDir" in volume and not mount.get("readOnly")
    for model_dir, sizes in block_sizes.items():
        # The block size is the card's kv_cache_block_size (in its mdcsum), and the KV router's.
        assert len(sizes) == 1, f"the workers of {model_dir} disagree on the KV block size: {sizes}"


def test_engine_workers_are_ready_once_the_engine_serves(
    overlay: tuple[str, list[Obj]], secret: dict[str, Path]
) -> None:
    """The worker opens its metrics port only after the engine has loaded the model: probing it
    holds rollouts and PodDisruptionBudgets until the new engine serves."""
    _, objects = overlay
    for worker, config, _ in _engine_workers(objects, secret):
        container = _container(worker)
        for probe in ("startupProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/metrics"
            assert _port(container, get["port"]) == config.metrics_port
        startup = container["startupProbe"]
        budget = (
            startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
        )
        assert budget >= ENGINE_LOAD_S, f"{worker['metadata']['name']}: {budget} s to load the model"


@pytest.mark.parametrize("engine", sorted(ENGINE_IMAGES))
def test_engine_flags_parse_with_the_engines_own_parsers(engine: str, secret: dict[str, Path]) -> None:
    pytest.importorskip(engine, reason=f"{engine} is not installed")
    runtime = importlib.import_module(f"dynamo_prep.engines.{engine}.runtime")
    translate = importlib.import_module(f"dynamo_prep.engines.{engine}.translate")
    parse = getattr(runtime, "parse_engine_args", None)
    if parse is None:
        pytest.skip(f"dynamo_prep.engines.{engine}.runtime has no parse_engine_args")
    workers = [
        w for w in _engine_workers(build(KUSTOMIZE / "overlays/prod"), secret) if w[1].engine == engine
    ]
    assert workers
    for worker, config, _ in workers:
        argv = translate.engine_argv(config.model_dir, config.engine_args)
        try:
            parse(argv)
        except SystemExit as exc:
            pytest.fail(f"{worker['metadata']['name']}: {engine} refuses {argv!r} (exit {exc.code})")


# ---------------------------------------------------------------------------------------------
# systemd and the image


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "dynamo-prep-frontend.service", encoding="utf-8")
    return unit


def _env_file() -> dict[str, str]:
    env = {}
    for line in (DEPLOY / "systemd" / "dynamo-prep-frontend.env").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name] = value
    return env


def test_the_systemd_unit_runs_a_frontend_the_cli_accepts() -> None:
    unit, env = _unit(), _env_file()
    service = unit["Service"]
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert float(service["TimeoutStopSec"]) >= GRACE_S + MARGIN_S
    assert service["EnvironmentFile"] == "/etc/dynamo-prep/frontend.env"
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "dynamo-prep"
    expanded = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], arg) for arg in argv[1:]]
    args = _parse(expanded, env, "dynamo-prep-frontend.service")
    assert args.command == "frontend"
    assert args.http_port == 8000
    assert [_tcp_port(address)[1] for address in args.discovery] == [7556, 7556]
    source = "\n".join(path.read_text(encoding="utf-8") for path in (ROOT / "dynamo_prep").rglob("*.py"))
    for name in env:
        assert not name.startswith("DYN_") or f'"{name}"' in source, f"{name} is read by nothing"
    assert str(args.cache_dir or env["DYN_PREP_CACHE_DIR"]) == f"/var/cache/{service['CacheDirectory']}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart is executable: point it at this venv's dynamo-prep.
    text = (DEPLOY / "systemd" / "dynamo-prep-frontend.service").read_text(encoding="utf-8")
    executable = Path(shutil.which("dynamo-prep") or Path(sys.executable).parent / "dynamo-prep")
    unit = tmp_path / "dynamo-prep-frontend.service"
    unit.write_text(text.replace("/opt/dynamo-prep/venv/bin/dynamo-prep", str(executable)), encoding="utf-8")
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    own = [line for line in result.stderr.splitlines() if unit.name in line]
    assert result.returncode == 0 and not own, result.stderr


def _instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    instructions: list[str] = []
    pending = ""
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        pending = f"{pending} {text}" if pending else text
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        instructions.append(pending)
        pending = ""
    assert not pending, f"{dockerfile}: ends in a continuation"
    return instructions


def _check_image_build(dockerfile: Path, deployments: list[Obj]) -> None:
    """Copies existing files the .dockerignore lets through, installs the project with pip, runs
    ``dynamo-prep`` as the uid of ``deployments``."""
    instructions = _instructions(dockerfile)
    assert any(re.match(r"RUN .*\bpip install\s(.*\s)?\.(\s|$)", i) for i in instructions), "pip install ."
    ignore = Path(f"{dockerfile}.dockerignore").read_text(encoding="utf-8").splitlines()
    for source in [i.split()[1:-1] for i in instructions if i.startswith("COPY ")]:
        for path in source:
            assert (ROOT / path).exists(), path
            assert f"!{path}" in ignore or f"!{path}/" in ignore, f"{path} is not in the build context"
    assert 'ENTRYPOINT ["dynamo-prep"]' in instructions
    (uid,) = [int(i.split()[1]) for i in instructions if i.startswith("USER ")]
    assert deployments
    for deployment in deployments:
        assert _pod_spec(deployment)["securityContext"]["runAsUser"] == uid


def test_the_dockerfile_installs_the_project_as_the_manifests_uid() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    deployments = [d for path in RENDERS for d in _objects(build(KUSTOMIZE / path), "Deployment")]
    _check_image_build(DEPLOY / "Dockerfile", [d for d in deployments if _engine(d) in ("", "mock")])


@pytest.mark.parametrize("engine", sorted(ENGINE_IMAGES))
def test_the_engine_dockerfiles_install_the_project_into_the_engines_image(engine: str) -> None:
    dockerfile = _dockerfile(engine)
    instructions = _instructions(dockerfile)
    arguments = dict(i[len("ARG ") :].partition("=")[::2] for i in instructions if i.startswith("ARG "))
    (base,) = [i.split()[1] for i in instructions if i.startswith("FROM ")]
    base = re.sub(r"\$\{(\w+)\}", lambda m: arguments[m.group(1)], base)
    repository, _, tag = base.partition(":")
    assert repository == ENGINE_IMAGES[engine] and tag, f"FROM the engine's official image: {base}"
    deployments = [
        d
        for path in (*RENDERS, "engines")
        for d in _objects(build(KUSTOMIZE / path), "Deployment")
        if _engine(d) == engine
    ]
    _check_image_build(dockerfile, deployments)
    # The image the manifests name (before prod pins it) is the one the header says to build.
    (built,) = re.findall(
        rf"docker build -f deploy/{dockerfile.name} -t (\S+) \.", dockerfile.read_text(encoding="utf-8")
    )
    engines = [d for d in _objects(build(KUSTOMIZE / "engines"), "Deployment") if _engine(d) == engine]
    assert [_container(d)["image"] for d in engines] == [built]


# ---------------------------------------------------------------------------------------------
# the loader itself (what it supports, and that it refuses the rest)


def _write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    return directory


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: app, labels: {tier: web}}
spec:
  template:
    spec:
      containers:
        - name: main
          image: registry.local:5000/app:1.0
          args: [a, b]
          env: [{name: X, value: "1"}, {name: Y, value: "2"}]
          volumeMounts: [{name: v, mountPath: /v}]
      volumes: [{name: v, emptyDir: {}}]
"""


def test_loader_strategic_merge_replicas_and_images(tmp_path: Path) -> None:
    _write(tmp_path / "base", {"kustomization.yaml": "resources: [app.yaml]", "app.yaml": DEPLOYMENT})
    patch = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: ignored}
spec:
  template:
    spec:
      containers:
        - name: main
          args: [c]
          env: [{name: Y, value: "3"}, {name: Z, value: "4"}]
          volumeMounts: [{mountPath: /v, $patch: delete}]
      volumes: [{name: v, $patch: delete}]
"""
    kustomization = """
resources: [../base]
patches:
  - path: patch.yaml
    target: {kind: Deployment, labelSelector: tier=web}
replicas: [{name: app, count: 3}]
images: [{name: registry.local:5000/app, newTag: "2.0"}]
"""
    overlay = _write(tmp_path / "overlay", {"kustomization.yaml": kustomization, "patch.yaml": patch})
    (app,) = build(overlay)
    container = app["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["c"]
    # kustomize's order: the patch's elements (merged), then the base's others.
    assert container["env"] == [
        {"name": "Y", "value": "3"},
        {"name": "Z", "value": "4"},
        {"name": "X", "value": "1"},
    ]
    assert container["volumeMounts"] == [] and app["spec"]["template"]["spec"]["volumes"] == []
    assert container["image"] == "registry.local:5000/app:2.0"
    assert app["spec"]["replicas"] == 3
    real = _kubectl_kustomize(overlay)
    if real is not None:
        assert {object_id(app): app} == real


@pytest.mark.parametrize(
    ("kustomization", "patch"),
    [
        ("resources: [app.yaml]\nnamePrefix: x-", None),  # a field outside the subset
        (
            "resources: [app.yaml]\npatches: [{path: p.yaml, target: {kind: Deployment}}]",
            "- {op: remove, path: /spec}",
        ),
        (
            "resources: [app.yaml]\npatches: [{path: p.yaml}]",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: nope}",
        ),
        (
            "resources: [app.yaml]\npatches: [{path: p.yaml}]",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n"
            "spec: {template: {spec: {tolerations: [{key: k}]}}}",
        ),
        (
            "resources: [app.yaml]\npatches: [{path: p.yaml}]",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n$patch: delete\n---\n"
            "apiVersion: v1\nkind: Service\nmetadata: {name: app}\n$patch: delete",
        ),
    ],
    ids=["unknown-field", "json6902", "no-match", "unmergeable-list", "two-deletes-in-one-file"],
)
def test_loader_refuses_what_it_cannot_render_faithfully(
    tmp_path: Path, kustomization: str, patch: str | None
) -> None:
    files = {"kustomization.yaml": kustomization, "app.yaml": DEPLOYMENT}
    if patch is not None:
        files["p.yaml"] = patch
    with pytest.raises(KustomizeError):
        build(_write(tmp_path, files))
