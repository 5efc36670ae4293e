"""Model cards: what a worker announces about the model it serves, and how it travels.

Cards are msgspec Structs encoded as MessagePack. Decoding ignores unknown keys (old and new
workers share a plane during rolling upgrades) and reports legacy keys instead of failing.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any

import msgspec

from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.decode import WireDecodeError, decoding
from dynamo_prep.protocol.wire import MAX_FILE_BYTES

__all__ = [
    "CardDecodeError",
    "CardDecodeResult",
    "FileRef",
    "ModelCardError",
    "ModelDeploymentCard",
    "ModelRuntimeConfig",
    "decode_card",
    "encode_card",
]

LEGACY_RUNTIME_KEYS = ("expands_image_pad_token",)
# A model directory's tokenizer, by the file that holds it (its logical name on the card).
TIKTOKEN_FILE = "tiktoken.model"  # Kimi-style tiktoken ranks (or exactly one ``*.tiktoken``)
HF_TOKENIZER_FILE = "tokenizer.json"  # Hugging Face ``tokenizers``
TOKENIZER_FILES = (TIKTOKEN_FILE, HF_TOKENIZER_FILE)
SENTENCEPIECE_FILE = "tokenizer.model"  # read by no one here: named in the error when it is alone
REQUIRED_JSON_FILES = ("config.json",)
# Read when present: templates, special tokens, stop ids, processors (which image token they expand).
OPTIONAL_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)
CARD_FILE_NAMES = frozenset((*REQUIRED_JSON_FILES, *TOKENIZER_FILES, *OPTIONAL_FILES))
_CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length")
# Where a family's config.json leaves the context to its transformers config class's default.
_DEFAULT_CONTEXT_LENGTHS = {"gemma3": 131_072, "gemma3_text": 131_072}


class ModelCardError(ValueError):
    """A model directory cannot be turned into a card; the message names the file."""


class CardDecodeError(WireDecodeError):
    """A card payload does not decode; the message names the field path."""

    def __init__(self, reason: str, detail: str) -> None:
        kind = "invalid" if reason == "invalid" else "undecodable"
        super().__init__(reason, detail, message=f"{kind} model card: {detail}")


class FileRef(msgspec.Struct, frozen=True, gc=False):
    """A model file by content: workers and frontends agree on bytes, never on paths."""

    sha256: str
    size: int


# Figures a component computes with, bounded where the card is decoded (a bad card is refused at the
# edge, never a component failure): a context of 1 token to 2**40, a KV block of 1 to 65,536
# tokens, counts that fit a machine.
_Tokens = Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
_BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_Moves = Annotated[int, msgspec.Meta(ge=0, le=1024)]


class ModelRuntimeConfig(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What one running worker reports about its engine.

    ``image_placeholder_token`` is the per-image token the worker's loaded processor expects in
    the prompt (SGLang: ``<|media_pad|>``); None renders the checkpoint default. Defaults are
    omitted on the wire, so a worker that declares nothing is byte-identical to one from before
    the field existed.

    Known limitation: ``mdcsum`` does not cover runtime_config, so per model the first card's
    declaration wins; a later instance that declares another token is logged as a conflict.
    """

    context_length: _Tokens | None = None
    total_kv_blocks: _Count | None = None
    max_num_seqs: _Count | None = None
    max_num_batched_tokens: _Count | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    exclude_tools_when_tool_choice_none: bool = True
    runtime_data: dict[str, Any] = {}
    image_placeholder_token: str | None = None


# What a peer may put in a card: bounded, so no card can flood a log line or a metrics label.
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Files = Annotated[dict[Annotated[str, msgspec.Meta(max_length=128)], FileRef], msgspec.Meta(max_length=32)]


class ModelDeploymentCard(msgspec.Struct, kw_only=True, gc=False):
    """Everything a frontend needs to serve a model: identity, limits, and its files by content."""

    display_name: _Name
    slug: _Name
    model_type: _Name | None
    model_input: str = "tokens"
    context_length: _Tokens
    kv_cache_block_size: _BlockSize = 16
    migration_limit: _Moves = 0
    files: _Files
    runtime_config: ModelRuntimeConfig = msgspec.field(default_factory=ModelRuntimeConfig)
    user_data: dict[str, Any] | None = None

    @classmethod
    def from_model_dir(
        cls,
        path: str | Path,
        *,
        served_name: str | None = None,
        kv_cache_block_size: int = 16,
        migration_limit: int = 0,
        runtime_config: ModelRuntimeConfig | None = None,
        context_length: int | None = None,
    ) -> ModelDeploymentCard:
        """Read a model directory (or a demo model name) into a card with content checksums.

        ``context_length`` is the engine's own when a running engine says (vLLM ``max_model_len``);
        None reads it from the model's files."""
        model_dir = resolve_model_dir(path)
        files = model_files(model_dir)
        config = read_json(model_dir / "config.json")
        tokenizer_config = read_optional_json(files, "tokenizer_config.json")
        display_name = served_name or model_dir.resolve().name
        return cls(
            display_name=display_name,
            slug=slugify(display_name),
            model_type=_str_or_none(config.get("model_type")),
            context_length=context_length or _context_length(config, tokenizer_config, model_dir),
            kv_cache_block_size=kv_cache_block_size,
            migration_limit=migration_limit,
            files={name: file_ref(file) for name, file in files.items()},
            runtime_config=runtime_config or ModelRuntimeConfig(),
        )

    def mdcsum(self) -> str:
        """Hex sha256 over what every worker of this model must share (``covered()``)."""
        canonical = json.dumps(self.covered(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def covered(self) -> dict[str, Any]:
        """What ``mdcsum`` covers: display_name, model_type, model_input, context_length,
        kv_cache_block_size, and each file's logical name with its content sha256 and size (never
        a path). Not covered: slug (derived from the name), migration_limit, runtime_config,
        user_data."""
        return {
            "display_name": self.display_name,
            "model_type": self.model_type,
            "model_input": self.model_input,
            "context_length": self.context_length,
            "kv_cache_block_size": self.kv_cache_block_size,
            "files": {name: [ref.sha256, ref.size] for name, ref in sorted(self.files.items())},
        }

    def mdcsum_fields(self) -> dict[str, Any]:
        """The covered values flat, by name (files as ``files.<name>``), so a mismatch says what differs."""
        fields = self.covered()
        files: dict[str, list[Any]] = fields.pop("files")
        return {**fields, **{f"files.{name}": sha256 for name, (sha256, _size) in files.items()}}


class CardDecodeResult(msgspec.Struct, frozen=True, gc=False):
    """A decoded card, plus the legacy keys its sender still carried (e.g. ``expands_image_pad_token``)."""

    card: ModelDeploymentCard
    legacy: dict[str, Any]


class _LegacyRuntimeKeys(msgspec.Struct):
    expands_image_pad_token: bool | None = None


class _LegacyProbe(msgspec.Struct):
    runtime_config: _LegacyRuntimeKeys = msgspec.field(default_factory=_LegacyRuntimeKeys)


_encoder = msgspec.msgpack.Encoder()
_card_decoder = msgspec.msgpack.Decoder(ModelDeploymentCard)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyProbe)


def encode_card(card: ModelDeploymentCard) -> bytes:
    """MessagePack bytes of a card (runtime_config defaults omitted)."""
    return _encoder.encode(card)


def decode_card(data: bytes | memoryview) -> CardDecodeResult:
    """Decode a card; unknown keys are ignored, legacy keys are reported in ``.legacy``."""
    with decoding(CardDecodeError):
        card = _card_decoder.decode(data)
        probe = _legacy_decoder.decode(data)
    legacy = {
        key: value for key in LEGACY_RUNTIME_KEYS if (value := getattr(probe.runtime_config, key)) is not None
    }
    return CardDecodeResult(card=card, legacy=legacy)


def model_files(model_dir: Path) -> dict[str, Path]:
    """Logical file name -> path of every file a card covers; clear errors for bad layouts."""
    if not model_dir.is_dir():
        raise ModelCardError(f"model directory not found: {model_dir}")
    files: dict[str, Path] = {}
    for name in REQUIRED_JSON_FILES:
        path = model_dir / name
        if not path.is_file():
            raise ModelCardError(f"{path}: required file is missing")
        files[name] = path
    name, path = _tokenizer_file(model_dir)
    files[name] = path
    for name in OPTIONAL_FILES:
        if (model_dir / name).is_file():
            files[name] = model_dir / name
    if TIKTOKEN_FILE in files and "tokenizer_config.json" not in files:
        raise ModelCardError(f"{model_dir / 'tokenizer_config.json'}: required file is missing")
    return files


def _tokenizer_file(model_dir: Path) -> tuple[str, Path]:
    """The directory's one tokenizer, by its logical name: ``tokenizer.json`` or tiktoken ranks."""
    candidates = sorted(model_dir.glob("*.tiktoken"))
    if (model_dir / TIKTOKEN_FILE).is_file():
        candidates.insert(0, model_dir / TIKTOKEN_FILE)
    if (model_dir / HF_TOKENIZER_FILE).is_file():
        candidates.insert(0, model_dir / HF_TOKENIZER_FILE)
    if len(candidates) > 1:
        names = ", ".join(c.name for c in candidates)
        raise ModelCardError(f"{model_dir}: two or more tokenizer files ({names}); keep exactly one")
    if not candidates:
        raise ModelCardError(f"{model_dir}: {_no_tokenizer(model_dir)}")
    found = candidates[0]
    return (HF_TOKENIZER_FILE if found.name == HF_TOKENIZER_FILE else TIKTOKEN_FILE), found


def _no_tokenizer(model_dir: Path) -> str:
    if (model_dir / SENTENCEPIECE_FILE).is_file():
        return (
            f"{SENTENCEPIECE_FILE} (SentencePiece) has no {HF_TOKENIZER_FILE} beside it; convert it once "
            "with transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    return f"no tokenizer file (expected {HF_TOKENIZER_FILE}, {TIKTOKEN_FILE} or one *.tiktoken)"


def file_ref(path: Path) -> FileRef:
    """Content checksum and size of a file; a file the request plane could not carry is refused."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ModelCardError(f"{path}: {size} bytes, over the {MAX_FILE_BYTES}-byte limit of a model file")
    data = path.read_bytes()
    return FileRef(sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model file; malformed JSON names the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelCardError(f"{path}: required file is missing") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelCardError(f"{path}: malformed JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelCardError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_optional_json(files: dict[str, Path], name: str) -> dict[str, Any]:
    """A JSON object from one of the card's optional files, empty when the directory has none."""
    return read_json(files[name]) if name in files else {}


def slugify(name: str) -> str:
    """URL- and subject-safe form of a model name."""
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") or "model"


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _context_length(config: dict[str, Any], tokenizer_config: dict[str, Any], model_dir: Path) -> int:
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_LENGTH_KEYS:
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, int) and value > 0:
                return value
    value = tokenizer_config.get("model_max_length")
    if isinstance(value, int) and 0 < value < 1 << 40:  # transformers writes 1e30 for "no limit"
        return value
    for source in (config, config.get("text_config") or {}):
        family = source.get("model_type") if isinstance(source, dict) else None
        default = _DEFAULT_CONTEXT_LENGTHS.get(family) if isinstance(family, str) else None
        if default is not None:
            return default
    raise ModelCardError(
        f"{model_dir / 'config.json'}: no context length "
        f"(expected one of {', '.join(_CONTEXT_LENGTH_KEYS)}, also under text_config)"
    )
