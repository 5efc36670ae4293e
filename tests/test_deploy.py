"""The deployment manifests under deploy/ are validated, not hoped for.

Every kustomization is rendered (tests/support/kustomize.py; checked against ``kubectl
kustomize`` where kubectl exists), every object is validated offline against the Kubernetes 1.30
schemas (strict: unknown fields fail), and the manifests are checked against the real CLI: each
container's args are parsed by ``dynamo_prep.cli._parser()`` under the container's environment,
and ports, addresses, probes, NetworkPolicies, CURVE files and grace periods must line up.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from support.kustomize import KustomizeError, build, object_id

from dynamo_prep import cli
from dynamo_prep.discovery.publisher import STOP_LINGER_MS
from dynamo_prep.discovery.trust import ClientCurve, ServerCurve, generate_keys
from dynamo_prep.frontend.http_server import GRACE_S
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

Obj = dict[str, Any]


@pytest.fixture(scope="module", params=RENDERS)
def render(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, build(KUSTOMIZE / request.param)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, build(KUSTOMIZE / request.param)


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
    """Parse with the real CLI parser; its env-var defaults are read from ``env``."""
    with _environ(env):
        parser = cli._parser()
        try:
            return parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{where}: dynamo-prep rejects {argv!r} (exit {exc.code}); see stderr")


def _cli(deployment: Obj) -> argparse.Namespace:
    container = _container(deployment)
    assert container["command"] == ["dynamo-prep"], container["command"]
    return _parse(list(container["args"]), _env(container), deployment["metadata"]["name"])


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


# ---------------------------------------------------------------------------------------------
# rendering and schemas


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
@pytest.mark.parametrize("path", RENDERS)
def test_the_loader_renders_what_kubectl_kustomize_renders(path: str) -> None:
    import yaml  # noqa: PLC0415

    result = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE / path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0 and "unknown command" in result.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert result.returncode == 0, result.stderr
    real = {object_id(obj): obj for obj in yaml.safe_load_all(result.stdout) if obj}
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
    name, objects = render
    images = {_container(d)["image"] for d in _objects(objects, "Deployment")}
    if name == "overlays/prod":
        assert len(images) == 1
        assert not next(iter(images)).endswith(":latest")
    else:
        assert images == {"dynamo-prep:latest"}


# ---------------------------------------------------------------------------------------------
# the manifests against the CLI


def test_every_container_args_parse_with_the_real_cli(render: tuple[str, list[Obj]]) -> None:
    _, objects = render
    commands = {_cli(deployment).command for deployment in _objects(objects, "Deployment")}
    assert commands == {"frontend", "broker", "worker"}


def test_an_unknown_flag_or_a_bad_value_fails_the_check() -> None:
    worker = ["worker", "--model-path", "m", "--discovery", "tcp://b:7555"]
    for argv in ([*worker, "--engine", "vllm"], [*worker, "--bogus"], ["broker", "--bogus"]):
        with pytest.raises(pytest.fail.Exception):
            _parse(argv, {}, "mutated manifest")


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
    overlay: tuple[str, list[Obj]],
) -> None:
    _, objects = overlay
    pairs = _broker_services(objects)
    xsub = [f"tcp://{svc['metadata']['name']}:{_service_port(svc, broker, 'xsub')}" for svc, broker in pairs]
    xpub = [f"tcp://{svc['metadata']['name']}:{_service_port(svc, broker, 'xpub')}" for svc, broker in pairs]
    workers = _component(objects, "worker")
    assert {_cli(worker).flavor for worker in workers} == {"sglang", "vllm"}
    for worker in workers:
        args = _cli(worker)
        assert args.discovery == xsub
        assert args.metrics_port == _port(_container(worker), "metrics")
        annotations = worker["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(args.metrics_port)
        assert args.engine == "mock"
        assert args.endpoint_host == POD_IP, "the request plane must bind and advertise the pod IP"
    frontends = _component(objects, "frontend")
    assert len(frontends) == 1
    args = _cli(frontends[0])
    assert args.discovery == xpub
    assert args.discovery_bind is None
    assert {_cli(worker).namespace for worker in workers} == {args.namespace}


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
        assert _pod_spec(worker)["terminationGracePeriodSeconds"] >= needed + MARGIN_S
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
    deployments = _objects(objects, "Deployment")
    for deployment in deployments:
        assert any(_selects(p["spec"]["podSelector"], _pod_labels(deployment)) for p in policies), (
            f"{deployment['metadata']['name']} is not covered by a NetworkPolicy (ingress open)"
        )
    labels = {c: _pod_labels(_component(objects, c)[0]) for c in ("frontend", "broker", "worker")}

    def allowed(component: str) -> dict[str, set[tuple[int, int]]]:
        """source component (or "*" for anyone) -> allowed (port, endPort) ranges."""
        grants: dict[str, set[tuple[int, int]]] = {}
        for policy in policies:
            if not _selects(policy["spec"]["podSelector"], labels[component]):
                continue
            assert policy["spec"]["policyTypes"] == ["Ingress"]
            for rule in policy["spec"]["ingress"]:
                ranges = {(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]}
                assert all(p["protocol"] == "TCP" for p in rule["ports"])
                sources = ["*"] if not rule.get("from") else []
                for peer in rule.get("from") or []:
                    assert set(peer) == {"podSelector"}, peer
                    sources += [c for c, pod in labels.items() if _selects(peer["podSelector"], pod)]
                for source in sources:
                    grants.setdefault(source, set()).update(ranges)
        return grants

    pairs = _broker_services(objects)
    for _, broker in pairs:
        xsub = _tcp_port(_cli(broker).xsub)[1]
        xpub = _tcp_port(_cli(broker).xpub)[1]
        assert allowed("broker") == {"worker": {(xsub, xsub)}, "frontend": {(xpub, xpub)}}
    (frontend,) = _component(objects, "frontend")
    http = _cli(frontend).http_port
    assert allowed("frontend") == {"*": {(http, http)}}
    # The worker's ROUTER binds an OS-chosen port: frontends (only) may reach the whole range.
    worker_grants = allowed("worker")
    assert set(worker_grants) == {"frontend", "*"}
    assert any(lo <= EPHEMERAL_PORTS[0] and EPHEMERAL_PORTS[1] <= hi for lo, hi in worker_grants["frontend"])
    # Anyone else (Prometheus) reaches only the metrics port.
    metrics = {_cli(worker).metrics_port for worker in _component(objects, "worker")}
    assert worker_grants["*"] == {(port, port) for port in metrics}


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


def test_the_dockerfile_installs_the_project_as_the_manifests_uid() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    (uid,) = re.findall(r"^USER (\d+)$", dockerfile, re.M)
    for path in RENDERS:
        for deployment in _objects(build(KUSTOMIZE / path), "Deployment"):
            assert _pod_spec(deployment)["securityContext"]["runAsUser"] == int(uid)


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
    assert container["env"] == [
        {"name": "X", "value": "1"},
        {"name": "Y", "value": "3"},
        {"name": "Z", "value": "4"},
    ]
    assert container["volumeMounts"] == [] and app["spec"]["template"]["spec"]["volumes"] == []
    assert container["image"] == "registry.local:5000/app:2.0"
    assert app["spec"]["replicas"] == 3


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
