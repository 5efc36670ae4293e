"""Tokenizers from a model directory, behind one interface (``Tokenizer``).

``Tokenizer.from_model_dir`` picks the kind by what the directory holds: ``tokenizer.json``
(Hugging Face ``tokenizers``: byte-level BPE, SentencePiece- and tekken-converted vocabularies) or
tiktoken ranks (``tiktoken.model`` / one ``*.tiktoken``, as Kimi ships them). Prompts are encoded
segment-wise: control segments may give control ids, text segments never do.
"""

from dynamo_prep.tokenizer._base import Tokenizer, TokenizerError
from dynamo_prep.tokenizer._hf import HfTokenizer
from dynamo_prep.tokenizer._tiktoken import (
    KIMI_PAT_STR,
    KNOWN_MODEL_TYPES,
    LINE_CACHE_MAX_CHARS,
    LINE_KEEP_SIGHTINGS,
    LINES_SEEN_MAX,
    LLAMA3_PAT_STR,
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    NUM_RESERVED_SPECIAL_TOKENS,
    QWEN_PAT_STR,
    SEGMENT_CACHE_MAX_ENTRIES,
    TiktokenTokenizer,
    split_for_encoding,
)

__all__ = [
    "KIMI_PAT_STR",
    "KNOWN_MODEL_TYPES",
    "LINES_SEEN_MAX",
    "LINE_CACHE_MAX_CHARS",
    "LINE_KEEP_SIGHTINGS",
    "LLAMA3_PAT_STR",
    "MAX_ENCODE_CHARS",
    "MAX_RUN_CHARS",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "QWEN_PAT_STR",
    "SEGMENT_CACHE_MAX_ENTRIES",
    "HfTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "split_for_encoding",
]
