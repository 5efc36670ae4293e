"""Hugging Face checkpoints served end to end: a real frontend and real mock workers on loopback,
the official openai client.

Workers of two checkpoints as Hugging Face ships them (a Llama 3.1-style and a Qwen2.5-style
directory, ``tokenizer.json``): the frontend fetches their files, tokenizes with their own
tokenizers (``/tokenize`` equals transformers' ids) and streams their answers; a card whose
``tokenizer.json`` is malformed, announced on the plane by a raw publisher, fails its build
(``model_build_failed`` naming the file) while the other models keep serving; a worker pointed at
a bad directory refuses to start, naming the file and the field.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from support import hf_reference as ref
from support.cluster import Cluster, mock_cluster, openai_client
from support.hf_models import built_models
from support.plane import start_dynamo, tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SERVED = ("llama3", "qwen2_5")
BAD = "bad_malformed_json"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there, ünïcödé 日本語!"},
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    models = built_models()
    workers = [["--model-path", str(models[name])] for name in SERVED]
    frontend = ["--model-path", str(models[BAD])]  # the bad card's files are found locally
    with mock_cluster(tmp_path_factory.mktemp("hf"), workers, frontend_args=frontend) as running:
        yield running


def test_tokenize_gives_transformers_ids_for_each_checkpoint(cluster: Cluster) -> None:
    models = built_models()
    for name in SERVED:
        body = {"model": name, "messages": CHAT}
        tokens = httpx.post(f"{cluster}/tokenize", json=body, trust_env=False, timeout=30).json()["tokens"]
        assert tokens == ref.chat_ids(models[name], body)


@pytest.mark.parametrize("name", SERVED)
def test_answers_stream_as_they_answer_whole(cluster: Cluster, name: str) -> None:
    client = openai_client(cluster)
    whole = client.chat.completions.create(model=name, messages=CHAT, max_tokens=200)  # type: ignore[arg-type]
    content = whole.choices[0].message.content or ""
    assert "Hello there, ünïcödé 日本語!" in content
    chunks = client.chat.completions.create(model=name, messages=CHAT, max_tokens=200, stream=True)  # type: ignore[arg-type]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == content


def raw_announce(card: ModelDeploymentCard) -> list[bytes]:
    payload: dict[str, Any] = {
        "v": 1,
        "kind": "announce",
        "instance_id": "raw-bad-checkpoint",
        "seq": 1,
        "sent_ms": 0,
        "ttl_ms": 600_000,
        "endpoint": tcp_endpoint(),  # nothing listens: the files are the frontend's local copy
        "card": msgspec.to_builtins(card),
    }
    return [b"dynamo_prep.v1.card.dynamo", msgspec.msgpack.encode(payload)]


def test_a_card_with_a_malformed_tokenizer_fails_its_build_and_the_others_serve(cluster: Cluster) -> None:
    card = ModelDeploymentCard.from_model_dir(built_models()[BAD])
    context: zmq.Context[Any] = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    try:
        publisher.connect(cluster.discovery)
        deadline = time.monotonic() + 30
        while not cluster.frontend.find("model_build_failed"):  # a new PUB's first sends may be lost
            assert time.monotonic() < deadline, "the bad card was never built"
            publisher.send_multipart(raw_announce(card))
            time.sleep(0.1)  # a resend period, not a synchronisation: the log line decides
    finally:
        publisher.close(linger=0)
        context.term()
    failed = cluster.frontend.find("model_build_failed")[0]
    assert failed["reason"] == "tokenizer" and "tokenizer.json" in failed["error"]
    client = openai_client(cluster)
    assert sorted(model.id for model in client.models.list().data) == sorted(SERVED)
    answer = client.chat.completions.create(model=SERVED[0], messages=CHAT, max_tokens=50)  # type: ignore[arg-type]
    assert answer.choices[0].message.content


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("bad_sentencepiece_only", "has no tokenizer.json beside it"),
        ("bad_malformed_json", "not a valid tokenizer.json"),
        ("bad_two_tokenizers", "two or more tokenizer files"),
        ("bad_template_undefined", "its chat_template cannot render a one-line chat"),
    ],
)
def test_a_worker_refuses_a_bad_directory_naming_the_file(name: str, message: str, tmp_path: Path) -> None:
    worker = start_dynamo("worker", "--model-path", str(built_models()[name]), "--discovery", tcp_endpoint())
    assert worker.process.wait(timeout=120) == 1
    failed = worker.wait_event("worker_start_failed")
    assert message in failed["error"], failed
