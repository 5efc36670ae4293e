"""``dynamo-prep worker --tool-call-parser NAME --reasoning-parser NAME``: vLLM's flags and names, with
every engine; the card carries them; an unknown name is refused at start (exit 2) with the known ones."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from support.plane import DynamoProcess, SubCollector, announces, start_dynamo, tcp_endpoint

from dynamo_prep.card import decode_card
from dynamo_prep.cli import parse_args
from dynamo_prep.parsing import TOOL_CALL_PARSERS
from dynamo_prep.protocol.discovery import Announce
from dynamo_prep.worker.config import WorkerConfig

QWEN = "qwen-vl-demo"


@pytest.fixture
def plane() -> Iterator[tuple[str, SubCollector]]:
    address = tcp_endpoint()
    with SubCollector(address, bind=True) as collector:
        yield address, collector


def test_the_card_carries_the_declared_parsers(
    plane: tuple[str, SubCollector], procs: list[DynamoProcess]
) -> None:
    address, collector = plane
    flags = (
        "--tool-call-parser",
        "llama3_json",
        "--reasoning-parser",
        "deepseek_r1",
        "--enable-auto-tool-choice",
    )
    worker = start_dynamo("worker", "--model-path", QWEN, "--discovery", address, *flags)
    procs.append(worker)
    message = collector.wait_messages(announces)[0]
    assert isinstance(message, Announce)
    runtime = decode_card(message.card).card.runtime_config
    assert (runtime.tool_call_parser, runtime.reasoning_parser) == ("llama3_json", "deepseek_r1")
    worker.signal(signal.SIGTERM)
    assert worker.wait(10) == 0


def test_without_flags_the_card_declares_nothing(
    plane: tuple[str, SubCollector], procs: list[DynamoProcess]
) -> None:
    """The frontend then chooses by model family, as before."""
    address, collector = plane
    worker = start_dynamo("worker", "--model-path", QWEN, "--discovery", address)
    procs.append(worker)
    message = collector.wait_messages(announces)[0]
    assert isinstance(message, Announce)
    runtime = decode_card(message.card).card.runtime_config
    assert (runtime.tool_call_parser, runtime.reasoning_parser) == (None, None)
    worker.signal(signal.SIGTERM)
    assert worker.wait(10) == 0


def test_an_unknown_name_exits_2_naming_the_known_ones(procs: list[DynamoProcess]) -> None:
    args = ("--model-path", QWEN, "--discovery", tcp_endpoint(), "--tool-call-parser", "nope")
    worker = start_dynamo("worker", *args, log_level="info")
    procs.append(worker)
    assert worker.wait(10) == 2
    [failure] = worker.find("worker_start_failed")
    assert failure["error"] == f"unknown --tool-call-parser 'nope' (known: {', '.join(TOOL_CALL_PARSERS)})"
    assert not worker.find("worker_declared_image_token")


@pytest.mark.parametrize("engine", ["mock", "vllm", "sglang"])
def test_every_engine_takes_the_flags_and_none_passes_them_as_engine_flags(engine: str) -> None:
    argv = ["worker", "--model-path", QWEN, "--discovery", "tcp://a:1", "--engine", engine]
    argv += ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"]
    args = parse_args(argv + (["--block-size", "32"] if engine != "mock" else []))
    assert args.engine_args == ([] if engine == "mock" else ["--block-size", "32"])
    config = WorkerConfig.from_options(
        model_path=QWEN,
        discovery=["tcp://a:1"],
        engine=engine,
        engine_args=args.engine_args,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")
    with pytest.raises(ValueError, match="unknown --reasoning-parser 'granite'"):
        WorkerConfig.from_options(
            model_path=QWEN, discovery=["tcp://a:1"], engine=engine, reasoning_parser="granite"
        )
