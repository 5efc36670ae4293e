"""Smoke test for an operator's GPU box: a real engine behind a real worker and frontend.

What CI cannot run (SGLang's engine, images through a real multimodal model), checked end to end:
an image request (a generated PNG as a data: URL, plus ``--image-url`` if given), the engine's own
KV events reaching the frontend's router, a repeated image prompt reported as cached tokens, a
cancelled stream leaving the engine with nothing unfinished, and SIGTERM draining a stream.

    python scripts/gpu_smoke.py --engine vllm --model-path /models/Qwen2-VL-2B-Instruct -- --block-size 16
    python scripts/gpu_smoke.py --engine sglang --model-path /models/Kimi-K3 -- --tp-size 8 --page-size 16

Everything after ``--`` is the engine's own flags (the KV-events config is added here). Needs this
project installed with its ``engines`` extra beside the engine; no network but what the model's
processor needs. Prints one JSON line per check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

KV_CONFIG = {
    "vllm": {"enable_kv_cache_events": True, "publisher": "zmq"},
    "sglang": {"publisher": "zmq"},
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def png_data_url(width: int = 64, height: int = 48) -> str:
    from PIL import Image  # noqa: PLC0415 - the engines extra has it

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen([sys.executable, "-m", "dynamo_prep.cli", *args], stdout=sink, stderr=sink)


def events(log: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == name:
                found.append(record)
    return found


class Smoke:
    def __init__(self, options: argparse.Namespace, engine_flags: list[str]) -> None:
        self.options = options
        self.engine_flags = engine_flags
        self.work = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
        self.http_port, self.discovery = free_port(), f"tcp://127.0.0.1:{free_port()}"
        self.model = options.served_name or Path(options.model_path).resolve().name
        self.failed = 0
        self.processes: list[subprocess.Popen[bytes]] = []

    def check(self, name: str, run: Callable[[], dict[str, Any]]) -> None:
        try:
            result = {"check": name, "ok": True, **run()}
        except Exception as exc:
            self.failed += 1
            result = {"check": name, "ok": False, "error": repr(exc)[:500]}
        print(json.dumps(result), flush=True)

    def start_cluster(self) -> dict[str, Any]:
        frontend = ["frontend", "--discovery-bind", self.discovery, "--http-port", str(self.http_port)]
        self.processes.append(start([*frontend, "--router-mode", "kv"], self.work / "frontend.log"))
        kv = {**KV_CONFIG[self.options.engine], "endpoint": f"tcp://*:{free_port()}",
              "replay_endpoint": f"tcp://*:{free_port()}"}  # fmt: skip
        worker = [
            "worker", "--engine", self.options.engine, "--model-path", self.options.model_path,
            "--discovery", self.discovery, "--metrics-port", str(free_port()), "--drain-timeout", "60",
            *(["--served-name", self.options.served_name] if self.options.served_name else []),
            *self.engine_flags, "--kv-events-config", json.dumps(kv),
        ]  # fmt: skip
        self.processes.append(start(worker, self.work / "worker.log"))
        wait(
            lambda: events(self.work / "frontend.log", "model_added"),
            self.options.start_timeout,
            "model_added",
        )
        return {"logs": str(self.work)}

    def chat(self, content: Any, **extra: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 32,
            **extra,
        }
        response = httpx.post(
            f"http://127.0.0.1:{self.http_port}/v1/chat/completions", json=body, timeout=300
        )
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def image_request(self) -> dict[str, Any]:
        images = [png_data_url(), *([self.options.image_url] if self.options.image_url else [])]
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        content = [*parts, {"type": "text", "text": "What is in the picture(s)?"}]
        first = self.chat(content)
        again = self.chat(content)
        cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert first["choices"][0]["message"].get("content") is not None
        assert cached > 0, f"a repeated image prompt reused no cache: {again['usage']}"
        return {"usage": first["usage"], "cached_tokens_on_repeat": cached}

    def kv_events(self) -> dict[str, Any]:
        def applied() -> float:
            text = httpx.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=30).text
            lines = [
                line
                for line in text.splitlines()
                if line.startswith("dynamo_frontend_kv_blocks_applied_total")
            ]
            return sum(float(line.rpartition(" ")[2]) for line in lines)

        return {"blocks_applied": wait(applied, 60, "KV events at the frontend")}

    def cancel(self) -> dict[str, Any]:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Count to a million."}],
                "max_tokens": 2000, "stream": True, "ignore_eos": True}  # fmt: skip
        url = f"http://127.0.0.1:{self.http_port}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=300) as response:
            next(response.iter_lines())
        port = events(self.work / "worker.log", "worker_metrics_started")[0]["port"]

        def unfinished() -> bool:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            return "dynamo_worker_engine_unfinished_requests 0.0" in text

        wait(unfinished, 60, "the engine to abort the cancelled request")
        return {}

    def drain(self) -> dict[str, Any]:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 200, "stream": True, "ignore_eos": True}  # fmt: skip
        url = f"http://127.0.0.1:{self.http_port}/v1/chat/completions"
        worker = self.processes[1]
        lines = []
        with httpx.stream("POST", url, json=body, timeout=300) as response:
            for line in response.iter_lines():
                if not lines:
                    worker.send_signal(signal.SIGTERM)
                lines.append(line)
        assert any('"finish_reason":"length"' in line for line in lines), "the stream did not finish"
        code = worker.wait(timeout=300)
        assert code == 0, f"the worker exited {code}"
        return {"events": len(lines)}

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> int:
    argv = sys.argv[1:]
    engine_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--served-name", default=None)
    parser.add_argument("--image-url", default=None, help="an http(s) image the box can reach (optional)")
    parser.add_argument("--start-timeout", type=float, default=1800.0)
    options = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    smoke = Smoke(options, engine_flags)
    try:
        smoke.check("start", smoke.start_cluster)
        smoke.check("image_request", smoke.image_request)
        smoke.check("kv_events", smoke.kv_events)
        smoke.check("cancel", smoke.cancel)
        smoke.check("drain", smoke.drain)
    finally:
        smoke.close()
    return 1 if smoke.failed else 0


if __name__ == "__main__":
    sys.exit(main())
