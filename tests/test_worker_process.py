"""The ``dynamo-prep worker`` process, end to end on loopback (options, card, files, mock replies)."""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from support.plane import DynamoProcess, SubCollector, announces, start_dynamo, tcp_endpoint, write_model_dir

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig, decode_card
from dynamo_prep.discovery.files import FileFetchError, ModelFileStore, fetch_file
from dynamo_prep.engines.mock.engine import MockEngine
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.models import DEMO_MODELS_DIR, resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.discovery import Announce, Withdraw
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import ErrorReply, FetchFile
from dynamo_prep.worker.config import WorkerConfig

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"


@pytest.fixture
def plane() -> Iterator[tuple[str, SubCollector]]:
    address = tcp_endpoint()
    with SubCollector(address, bind=True) as collector:
        yield address, collector


@pytest.fixture
def model_path(tmp_path: Path) -> str:
    """The demo model when it is installed, else an equivalent directory."""
    if resolve_model_dir(DEMO).is_dir():
        return DEMO
    return str(write_model_dir(tmp_path / DEMO))


def test_worker_announces_the_declared_token_and_withdraws_on_sigterm(
    plane: tuple[str, SubCollector], model_path: str, procs: list[DynamoProcess]
) -> None:
    address, collector = plane
    worker = start_dynamo(
        "worker", "--model-path", model_path, "--discovery", address, "--declare-image-token", MEDIA_PAD
    )
    procs.append(worker)
    started = worker.wait_event("worker_started")
    assert started["declared_token"] == MEDIA_PAD
    assert started["endpoint"].startswith("tcp://127.0.0.1:")
    message = collector.wait_messages(announces)[0]
    assert isinstance(message, Announce)
    assert message.kv_events is msgspec.UNSET  # no --kv-events: the key is not on the wire
    assert message.instance_id == started["instance_id"]
    assert message.endpoint == started["endpoint"]
    decoded = decode_card(message.card)
    assert decoded.card.runtime_config.image_placeholder_token == MEDIA_PAD
    assert decoded.card.mdcsum() == started["mdcsum"]
    assert decoded.legacy == {}

    worker.signal(signal.SIGTERM)
    withdraw = collector.wait_messages(lambda m: isinstance(m, Withdraw))[0]
    assert withdraw.instance_id == started["instance_id"]
    assert worker.wait(5) == 0
    assert worker.find("card_withdrawn", instance_id=started["instance_id"])


def test_legacy_worker_publishes_the_old_key(
    plane: tuple[str, SubCollector], model_path: str, procs: list[DynamoProcess]
) -> None:
    address, collector = plane
    worker = start_dynamo(
        "worker", "--model-path", model_path, "--discovery", address, "--legacy-expands-image-pad-token"
    )
    procs.append(worker)
    message = collector.wait_messages(announces)[0]
    assert isinstance(message, Announce)
    decoded = decode_card(message.card)
    assert decoded.legacy == {"expands_image_pad_token": True}
    assert decoded.card.runtime_config.image_placeholder_token is None
    worker.signal(signal.SIGINT)
    assert worker.wait(5) == 0


def test_frontend_store_fetches_files_from_a_worker(
    plane: tuple[str, SubCollector], model_path: str, procs: list[DynamoProcess], tmp_path: Path
) -> None:
    address, collector = plane
    worker = start_dynamo("worker", "--model-path", model_path, "--discovery", address)
    procs.append(worker)
    message = collector.wait_messages(announces)[0]
    assert isinstance(message, Announce)
    card = decode_card(message.card).card
    path = ModelFileStore(tmp_path / "cache").model_dir_for(card, endpoint=message.endpoint, timeout_s=5)
    assert ModelDeploymentCard.from_model_dir(path, served_name=card.display_name).mdcsum() == card.mdcsum()


def test_missing_model_dir_exits_1_with_a_json_error(tmp_path: Path, procs: list[DynamoProcess]) -> None:
    worker = start_dynamo(
        "worker", "--model-path", str(tmp_path / "nope"), "--discovery", tcp_endpoint(), log_level="info"
    )
    procs.append(worker)
    assert worker.wait(10) == 1
    [failure] = worker.find("worker_start_failed")
    assert failure["level"] == "error"
    assert "nope" in failure["error"]


def test_a_wrong_option_exits_2_before_loading_anything(procs: list[DynamoProcess]) -> None:
    """Restarting cannot help (``dynamo_prep.lifecycle.EXIT_CONFIG``); nothing was announced."""
    args = ("--model-path", DEMO, "--discovery", tcp_endpoint(), "--token-delay", "-1")
    worker = start_dynamo("worker", *args, log_level="info")
    procs.append(worker)
    assert worker.wait(10) == 2
    [failure] = worker.find("worker_start_failed")
    assert failure["error"] == "--token-delay must be >= 0, got -1.0"
    assert not worker.find("worker_declared_image_token")


def test_request_plane_refuses_garbage_and_unknown_files(
    plane: tuple[str, SubCollector], model_path: str, procs: list[DynamoProcess]
) -> None:
    address, _ = plane
    worker = start_dynamo("worker", "--model-path", model_path, "--discovery", address)
    procs.append(worker)
    endpoint = worker.wait_event("worker_started")["endpoint"]
    context: zmq.Context[Any] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send(b"\xc1 not msgpack")
        assert dealer.poll(5000)
        garbage = wire.from_worker_decoder.decode(dealer.recv())
        assert isinstance(garbage, ErrorReply) and garbage.code == 400
        dealer.send(wire.encode(FetchFile(request_id="r1", sha256="0" * 64)))
        assert dealer.poll(5000)
        unknown = wire.from_worker_decoder.decode(dealer.recv())
        assert isinstance(unknown, ErrorReply) and (unknown.request_id, unknown.code) == ("r1", 404)
    finally:
        dealer.close(linger=0)
        context.term()
    with pytest.raises(FileFetchError, match="404"):
        fetch_file(None, endpoint, "0" * 64, timeout_s=5)


# --- WorkerConfig: every option checked once, before anything starts ------------------------------


def test_worker_config_defaults_and_resolution() -> None:
    config = WorkerConfig.from_options(model_path=DEMO, discovery=["tcp://127.0.0.1:7555"])
    assert config.model_dir == DEMO_MODELS_DIR / DEMO
    assert config.discovery == ("tcp://127.0.0.1:7555",)
    assert (config.engine, config.flavor, config.reply_format) == ("mock", "sglang", "model")
    assert config.replies is None and config.curve is None
    replies = WorkerConfig.from_options(
        model_path=DEMO, discovery=["tcp://a:1"], replies="r.jsonl", reply_format="model", flavor="vllm"
    )
    assert (replies.replies, replies.reply_format, replies.flavor) == (Path("r.jsonl"), "model", "vllm")
    assert (config.kv_events, config.kv_blocks, config.prefill_ms_per_1k) == (False, 2048, 0.0)
    kv = WorkerConfig.from_options(
        model_path=DEMO, discovery=["tcp://a:1"], kv_events=True, kv_blocks=64, prefill_ms_per_1k=12.5
    )
    assert (kv.kv_events, kv.kv_blocks, kv.prefill_ms_per_1k) == (True, 64, 12.5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"discovery": []}, "--discovery needs at least one address"),
        ({"declared_image_token": MEDIA_PAD, "legacy_expands_image_pad_token": True}, "exclude each other"),
        ({"declared_image_token": ""}, "--declare-image-token must not be empty"),
        ({"engine": "trtllm"}, "unknown --engine 'trtllm' (known: mock, vllm, sglang)"),
        ({"engine_args": ["--block-size", "32"]}, "unrecognized arguments for --engine mock: --block-size"),
        ({"engine": "vllm", "token_delay_s": 0.0}, "--token-delay: options of --engine mock, not of"),
        (
            {"engine": "sglang", "flavor": "sglang", "kv_events": True},
            "--flavor, --kv-events: options of --engine mock, not of --engine sglang",
        ),
        ({"flavor": "trtllm"}, "unknown --flavor 'trtllm' (known: sglang, vllm)"),
        ({"reply_format": "xml"}, "unknown --reply-format 'xml' (known: echo, model)"),
        ({"heartbeat_s": 0}, "--heartbeat must be > 0, got 0"),
        ({"ttl_ms": -5}, "--ttl-ms must be > 0, got -5"),
        ({"token_delay_s": -0.1}, "--token-delay must be >= 0, got -0.1"),
        ({"migration_limit": -1}, "--migration-limit must be >= 0, got -1"),
        ({"drain_timeout_s": float("nan")}, "--drain-timeout must be >= 0, got nan"),
        ({"metrics_port": 70000}, "--metrics-port must be in 0..65535, got 70000"),
        ({"kv_blocks": 64}, "--kv-blocks needs --kv-events"),
        ({"prefill_ms_per_1k": 5.0}, "--prefill-ms-per-1k needs --kv-events"),
        ({"kv_events": True, "kv_blocks": 0}, "--kv-blocks must be >= 1, got 0"),
        ({"kv_events": True, "prefill_ms_per_1k": -1.0}, "--prefill-ms-per-1k must be a finite number >= 0"),
        ({"kv_events": True, "prefill_ms_per_1k": float("inf")}, "--prefill-ms-per-1k must be a finite"),
    ],
)
def test_worker_config_names_the_bad_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        WorkerConfig.from_options(**{"model_path": DEMO, "discovery": ["tcp://a:1"], **options})
    assert message in str(raised.value)


def test_worker_config_needs_both_curve_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CURVE needs both"):
        WorkerConfig.from_options(
            model_path=DEMO, discovery=["tcp://a:1"], curve_secret_key=tmp_path / "worker.key_secret"
        )


# --- the mock engine's replies: --replies FILE, --reply-format ----------------------------------------


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
REPLIES = [
    {"when": "scripted", "segments": [["Scripted ", False], ["<|close|>", True], ["<|close|>", False]]},
    {"when": "never", "text": "not this one"},
]


@pytest.fixture
async def client() -> AsyncIterator[RequestPlaneClient]:
    client = RequestPlaneClient()
    yield client
    await client.close()


@pytest.fixture
def replies(tmp_path: Path) -> Path:
    path = tmp_path / "replies.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in REPLIES), encoding="utf-8")
    return path


def preprocess(text: str, **fields: Any) -> PreprocessedRequest:
    card = ModelDeploymentCard.from_model_dir(
        DEMO, runtime_config=ModelRuntimeConfig(image_placeholder_token=MEDIA_PAD)
    )
    messages = [{"role": "user", "content": text}]
    return OpenAIPreprocessor.new(card, DEMO).preprocess({"model": DEMO, "messages": messages, **fields})


def start_worker(procs: list[DynamoProcess], plane: tuple[str, SubCollector], *extra: str) -> str:
    args = ("--model-path", DEMO, "--discovery", plane[0], "--token-delay", "0", *extra)
    worker = start_dynamo("worker", *args)
    procs.append(worker)
    return str(worker.wait_event("worker_started")["endpoint"])


async def test_a_worker_streams_scripted_replies_and_model_format_answers(
    plane: tuple[str, SubCollector], procs: list[DynamoProcess], client: RequestPlaneClient, replies: Path
) -> None:
    endpoint = start_worker(procs, plane, "--replies", str(replies), "--reply-format", "model")
    expected = MockEngine(DEMO, flavor="sglang", replies=replies, reply_format="model")
    close_id = expected.tokenizer.special_tokens["<|close|>"]
    for request_id, request in (
        ("scripted", preprocess("a scripted answer, please")),
        ("model", preprocess("What is the weather in Paris?", tools=[WEATHER])),
    ):
        outputs = [o async for o in client.generate(endpoint, request, request_id=request_id, timeout_s=10)]
        token_ids = [t for o in outputs for t in o.token_ids]
        assert (token_ids, outputs[-1].finish_reason) == expected.plan(request)
        assert close_id in token_ids
    assert 'call tool="get_weather"' in expected.tokenizer.decode(token_ids)


async def test_the_echo_reply_format_is_the_plain_echo(
    plane: tuple[str, SubCollector], procs: list[DynamoProcess], client: RequestPlaneClient
) -> None:
    endpoint = start_worker(procs, plane, "--reply-format", "echo")
    request = preprocess("Hello", tools=[WEATHER])
    outputs = [o async for o in client.generate(endpoint, request, request_id="echo", timeout_s=10)]
    text = MockEngine(DEMO, flavor="sglang").tokenizer.decode([t for o in outputs for t in o.token_ids])
    assert text == f"[mock sglang] 0 image(s), {len(request.token_ids)} prompt tokens. You said: Hello"


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ('{"when": "a", "text": "ok"}\n{"when": "b"}\n', ":2: give exactly one of segments, text, token_ids"),
        ('{"when": "a", "token_ids": [1, 99999]}\n', ":1: token id 99999 is outside the vocabulary"),
    ],
)
def test_a_bad_replies_file_fails_start_up_naming_the_line(
    tmp_path: Path, procs: list[DynamoProcess], content: str, error: str
) -> None:
    path = tmp_path / "replies.jsonl"
    path.write_text(content, encoding="utf-8")
    args = ("--model-path", DEMO, "--discovery", tcp_endpoint(), "--replies", str(path))
    worker = start_dynamo("worker", *args, log_level="info")
    procs.append(worker)
    assert worker.wait(10) == 1
    [failure] = worker.find("worker_start_failed")
    assert failure["level"] == "error"
    assert f"{path}{error}" in failure["error"]
    assert not worker.find("worker_started")
