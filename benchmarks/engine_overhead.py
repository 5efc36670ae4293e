"""What frontend + worker add to a REAL vLLM engine: TTFT and per-token CPU, and throughput.

``python -m benchmarks.engine_overhead [--rounds 4] [--requests 8] [--tokens 64]``
(``make bench-engines``: the engines' venv, vLLM's CPU build, the tiny dummy-weight model).

One vLLM ``AsyncLLM`` runs in THIS process, built from the engine flags exactly as
``dynamo-prep worker --engine vllm`` builds it, with the worker's own ``Worker`` serving it on the
same event loop (as the worker process does). A real ``dynamo-prep frontend`` runs as a process;
the HTTP load comes from a separate client process (``client`` subcommand: keep-alive connections
parsed by httptools, ``benchmarks._load``), so its CPU is nobody's. The same prompts go,
interleaved round by round so the shared machine's noise hits both alike:

* ``direct``: straight into the engine's ``generate`` (vLLM's own ``SamplingParams``, DELTA
  outputs, the ids the frontend would send), TTFT from the call to the first output;
* ``http``: the openai-style streaming chat through the frontend and the worker, TTFT from the
  request to the first SSE event (the role chunk travels with the first token).

Figures: added TTFT p50 (http - direct, one stream at a time), tokens/s at 8 concurrent streams
(http / direct), and CPU per streamed token of the frontend (its process) and of the worker (this
process's CPU during http runs minus during direct runs of the same tokens: the engine's own
main-process work cancels out; its core and model processes are not counted either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq.asyncio

from benchmarks._load import Connection, encode_post
from benchmarks._plane import FileProcess, cpu_seconds, summary, tcp_endpoint
from benchmarks._report import Suite

REPO = Path(__file__).resolve().parent.parent
MODEL = "engmodel"
FLAGS = (
    "--load-format", "dummy", "--skip-tokenizer-init", "--gpu-memory-utilization", "0.05",
    "--block-size", "32", "--max-num-seqs", "16", "--seed", "0",
)  # fmt: skip
CONCURRENCY = 8


def _messages(index: int, nonce: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"[{nonce}:{index}] Tell me a story about the harbour, please."}]


# ----------------------------------------------------------------------------- client process


async def _client(
    url: str, prompts: list[list[dict[str, str]]], tokens: int, concurrency: int
) -> dict[str, Any]:
    """Stream every prompt through the frontend, ``concurrency`` keep-alive connections at a time
    (httptools' parser: the client's own CPU stays small): TTFTs and tokens/s."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    ttfts: list[float] = []
    counted = 0
    queue = list(prompts)

    async def worker() -> None:
        nonlocal counted
        connection = await Connection.open(host, int(port))
        try:
            while queue:
                body = {
                    "model": MODEL, "messages": queue.pop(), "max_tokens": tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True},
                }  # fmt: skip
                started = time.perf_counter()
                events = await connection.request(encode_post("/v1/chat/completions", body))
                ttfts.append((connection.first_body_at or started) - started)
                counted += _usage_tokens(events)
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttft_s": ttfts, "tokens": counted, "wall_s": time.perf_counter() - started}


def _usage_tokens(events: bytes) -> int:
    """The completion tokens of a stream's usage chunk (the last event before ``[DONE]``)."""
    for line in reversed(events.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            return int(json.loads(line[6:])["usage"]["completion_tokens"])
    raise RuntimeError(f"a stream without usage: {events[-300:]!r}")


def client_main(args: argparse.Namespace) -> int:
    prompts = [_messages(i, args.nonce) for i in range(args.requests)]
    result = asyncio.run(_client(args.url, prompts, args.tokens, args.concurrency))
    print(json.dumps(result))
    return 0


def _run_client(url: str, requests: int, tokens: int, concurrency: int, nonce: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "benchmarks.engine_overhead", "client", "--url", url,
        "--requests", str(requests), "--tokens", str(tokens), "--concurrency", str(concurrency),
        "--nonce", nonce,
    ]  # fmt: skip
    done = subprocess.run(command, check=False, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"the client failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ----------------------------------------------------------------------------- direct, in process


async def _direct(
    runtime: Any, preprocessor: Any, requests: int, tokens: int, *, concurrency: int, nonce: str
) -> dict[str, Any]:
    """The same prompts straight into the engine's ``generate``."""
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415
    from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

    engine = runtime._engine
    queue = [
        preprocessor.preprocess({"model": MODEL, "messages": _messages(i, nonce), "max_tokens": tokens})
        for i in range(requests)
    ]
    ttfts: list[float] = []
    counted = 0

    async def one(index: int, request: Any) -> None:
        nonlocal counted
        params = SamplingParams(
            max_tokens=tokens, ignore_eos=True, temperature=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        started = time.perf_counter()
        first = None
        async for output in engine.generate(
            TokensPrompt(prompt_token_ids=request.token_ids), params, f"d-{nonce}-{index}"
        ):
            if first is None:
                first = time.perf_counter() - started
            counted += len(output.outputs[0].token_ids)
        ttfts.append(first or 0.0)

    async def worker() -> None:
        while queue:
            index = len(queue)
            await one(index, queue.pop())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttft_s": ttfts, "tokens": counted, "wall_s": time.perf_counter() - started}


# ----------------------------------------------------------------------------- the run


async def _serve(model_dir: Path, discovery: str) -> tuple[Any, Any, Any]:
    """The worker as ``dynamo-prep worker --engine vllm`` builds it, in this process and loop."""
    from dynamo_prep.engines.images import ImageFetcher  # noqa: PLC0415
    from dynamo_prep.engines.vllm.runtime import VllmRuntime  # noqa: PLC0415
    from dynamo_prep.engines.vllm.translate import engine_argv  # noqa: PLC0415
    from dynamo_prep.worker.config import WorkerConfig  # noqa: PLC0415
    from dynamo_prep.worker.engine import engine_card, engine_worker  # noqa: PLC0415

    config = WorkerConfig.from_options(
        model_path=model_dir, discovery=[discovery], engine="vllm", engine_args=list(FLAGS)
    )
    runtime = VllmRuntime.start(engine_argv(model_dir, FLAGS), ImageFetcher(), model_dir)
    worker = engine_worker(config, engine_card(config, runtime, None), runtime, zmq.asyncio.Context())
    await worker.start()
    return runtime, worker, asyncio.create_task(worker.run())


async def _measure(args: argparse.Namespace, suite: Suite) -> None:
    from dynamo_prep.card import ModelDeploymentCard  # noqa: PLC0415
    from dynamo_prep.preprocessor import OpenAIPreprocessor  # noqa: PLC0415

    sys.path.insert(0, str(REPO / "scripts"))
    from make_engine_model import write_engine_model  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="engine-overhead-"))
    model_dir = write_engine_model(work / MODEL)
    discovery = tcp_endpoint()
    frontend = FileProcess(
        ["frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", "0",
         "--cache-dir", str(work / "cache")],
        work / "frontend.log",
    )  # fmt: skip
    runtime, worker, serving = await _serve(model_dir, discovery)
    try:
        port = frontend.wait_event("frontend_started", timeout=60)["http_port"]
        await asyncio.to_thread(frontend.wait_event, "model_added", 120)
        url = f"http://127.0.0.1:{port}/v1"
        preprocessor = OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir(model_dir), model_dir)
        await _direct(runtime, preprocessor, 4, 8, concurrency=1, nonce="warm")
        await asyncio.to_thread(_run_client, url, 4, 8, 1, "warm")
        results: dict[str, dict[str, list[Any]]] = {}
        cpu: dict[str, float] = {}  # "<process>@<concurrency>": seconds
        for round_ in range(args.rounds):
            for concurrency in (1, CONCURRENCY):
                nonce = f"r{round_}c{concurrency}"
                for mode in ("direct", "http") if round_ % 2 == 0 else ("http", "direct"):
                    own, front = cpu_seconds(os.getpid()), cpu_seconds(frontend.pid)
                    if mode == "direct":
                        got = await _direct(
                            runtime,
                            preprocessor,
                            args.requests,
                            args.tokens,
                            concurrency=concurrency,
                            nonce=nonce,
                        )
                    else:
                        got = await asyncio.to_thread(
                            _run_client, url, args.requests, args.tokens, concurrency, nonce
                        )
                        cpu[f"frontend@{concurrency}"] = cpu.get(f"frontend@{concurrency}", 0.0) + (
                            cpu_seconds(frontend.pid) - front
                        )
                    key = f"{mode}@{concurrency}"
                    cpu[key] = cpu.get(key, 0.0) + cpu_seconds(os.getpid()) - own
                    slot = results.setdefault(
                        f"{mode}@{concurrency}", {"ttft_s": [], "tps": [], "tokens": []}
                    )
                    slot["ttft_s"] += got["ttft_s"]
                    slot["tps"].append(got["tokens"] / got["wall_s"])
                    slot["tokens"].append(got["tokens"])
        _report(suite, results, cpu)
    finally:
        await worker.stop()
        serving.cancel()
        await runtime.shutdown()
        frontend.stop()


def _report(suite: Suite, results: dict[str, dict[str, list[Any]]], cpu: dict[str, float]) -> None:
    direct, http = summary(results["direct@1"]["ttft_s"]), summary(results["http@1"]["ttft_s"])
    added_ms = (http["p50"] - direct["p50"]) * 1000
    suite.record("added TTFT p50, one stream (http - direct)", added_ms, "ms", "<= 2 ms", added_ms <= 2.0)
    suite.record(
        "TTFT p50 direct / http", direct["p50"] * 1000, "ms", note=f"http {http['p50'] * 1000:.1f} ms"
    )
    tps_direct = _median(results[f"direct@{CONCURRENCY}"]["tps"])
    tps_http = _median(results[f"http@{CONCURRENCY}"]["tps"])
    ratio = tps_http / tps_direct
    suite.record(
        f"tokens/s at {CONCURRENCY} streams, http / direct", ratio, "x", ">= 0.9x", ratio >= 0.9,
        note=f"{tps_http:.0f} / {tps_direct:.0f} tokens/s",
    )  # fmt: skip
    for streams in (1, CONCURRENCY):
        tokens = sum(results[f"http@{streams}"]["tokens"])
        frontend_us = cpu[f"frontend@{streams}"] / tokens * 1e6
        worker_us = (cpu[f"http@{streams}"] - cpu[f"direct@{streams}"]) / tokens * 1e6
        suite.record(
            f"CPU per streamed token at {streams} stream(s), frontend + worker",
            frontend_us + worker_us,
            "us",
            note=f"frontend {frontend_us:.0f} us, worker {worker_us:.0f} us (its process, http - direct)",
        )  # fmt: skip
    suite.details = {
        "ttft_s": {mode: summary(values["ttft_s"]) for mode, values in results.items()},
        "tokens_per_s": {mode: values["tps"] for mode, values in results.items()},
        "cpu_s": cpu,
        "flags": list(FLAGS),
    }
    print(suite.write(), flush=True)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client")
    client.add_argument("--url", required=True)
    client.add_argument("--requests", type=int, required=True)
    client.add_argument("--tokens", type=int, required=True)
    client.add_argument("--concurrency", type=int, required=True)
    client.add_argument("--nonce", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.command == "client":
        return client_main(args)
    from dynamo_prep.logging import configure_logging  # noqa: PLC0415

    configure_logging(level="warning", log_format="json", stream=sys.stderr, component="bench")
    asyncio.run(_measure(args, Suite("engine_overhead")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
