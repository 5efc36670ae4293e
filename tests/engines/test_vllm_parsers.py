"""A vLLM worker takes vLLM's parser flags: the card carries them (the frontend parses the answers);
vLLM's engine gets its own ``--reasoning-parser`` only when it has its tokenizer (with
``--skip-tokenizer-init``, as here, vLLM would refuse to start with one)."""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import ENGINE_START_S, start_vllm_worker
from support.plane import SubCollector, announces, tcp_endpoint

from dynamo_prep.card import decode_card
from dynamo_prep.protocol.discovery import Announce


def test_a_vllm_worker_declares_the_parsers_in_its_card(engine_model: Path) -> None:
    discovery = tcp_endpoint()
    with SubCollector(discovery, bind=True) as collector:
        worker = start_vllm_worker(
            engine_model, discovery, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"
        )
        try:
            [message] = collector.wait_messages(announces, timeout=ENGINE_START_S)[:1]
            assert isinstance(message, Announce)
            runtime = decode_card(message.card).card.runtime_config
            assert (runtime.tool_call_parser, runtime.reasoning_parser) == ("hermes", "qwen3")
            [skipped] = worker.find("engine_reasoning_parser_not_passed")
            assert (skipped["engine"], skipped["reasoning_parser"]) == ("vllm", "qwen3")
            [starting] = worker.find("engine_starting")
            assert "--reasoning-parser" not in starting["engine_args"]
            assert "--tool-call-parser" not in starting["engine_args"]
        finally:
            worker.signal(signal.SIGTERM)
            assert worker.wait(120) == 0
