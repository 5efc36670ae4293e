"""tiktoken vocabularies loaded from a model directory, the way Kimi's ``TikTokenTokenizer`` does.

The base vocabulary is ``tiktoken.model`` (``base64(token) rank`` lines); the 256 ids above it are
reserved specials, named by ``tokenizer_config.json`` ``added_tokens_decoder`` or
``<|reserved_token_{id}|>``, and all registered with tiktoken. Segments are encoded one by one:
control segments with specials allowed, text segments with special-looking text as plain BPE, so
user text can never forge a control token.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import structlog
import tiktoken

from dynamo_prep.card import TIKTOKEN_FILE
from dynamo_prep.prompt import Run
from dynamo_prep.tokenizer._base import Tokenizer, TokenizerError, TokenizerSource, token_content

__all__ = ["KNOWN_MODEL_TYPES", "NUM_RESERVED_SPECIAL_TOKENS", "TiktokenTokenizer"]

log = structlog.get_logger()

NUM_RESERVED_SPECIAL_TOKENS = 256
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
SEGMENT_CACHE_MAX_CHARS = 64
SEGMENT_CACHE_MAX_ENTRIES = 4096
LINE_CACHE_MAX_CHARS = 2048  # one line kept; tool schemas printed by a template are such lines
LINE_CACHE_BUDGET_CHARS = 1 << 20  # all lines kept by one tokenizer
LINE_CACHE_MAX_ENTRIES = 8192
LINES_SEEN_MAX = 16384
# A line is kept on its third sighting: a request's text is often encoded twice (rendered for the
# model's own declaration and for the instance it goes to), so two sightings do not make it recur.
LINE_KEEP_SIGHTINGS = 3

KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Qwen2's pre-tokenizer (single digits) and Llama-3's (digit triples); both cl100k-style.
QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_KIMI_TYPES = ("kimi", "kimi_k2", "kimi_k25", "kimi_k3")
_QWEN_TYPES = (
    "qwen2",
    "qwen2_moe",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen2_5_omni",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_vl",
    "qwen3_vl_moe",
)
PAT_STR_BY_MODEL_TYPE: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(_KIMI_TYPES, KIMI_PAT_STR),
        **dict.fromkeys(_QWEN_TYPES, QWEN_PAT_STR),
        "llama": LLAMA3_PAT_STR,
    }
)
KNOWN_MODEL_TYPES = tuple(sorted(PAT_STR_BY_MODEL_TYPE))
# Patterns in which no alternative matches across a newline followed by a non-space character (each
# ends at newlines, or cannot hold one): every such position starts a chunk, so a text cut there
# encodes as its pieces do, whatever comes before or after. (Python's ``\S`` is narrower than
# tiktoken's, never wider: ``\x1c``-``\x1f`` are spaces to ``str.isspace`` only.)
LINE_CUT_PATTERNS = frozenset({KIMI_PAT_STR, QWEN_PAT_STR, LLAMA3_PAT_STR})
_LINE = re.compile(r"[^\n]*(?:\n(?!\S)[^\n]*)*\n?")  # up to a newline before a non-space, or the end
_HF_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_SPACE_RUN = re.compile(r"\s*")
_WORD_RUN = re.compile(r"\S*")


class _Vocab(NamedTuple):
    encoding: tiktoken.Encoding
    num_base_tokens: int
    special_tokens: dict[str, int]


# Shared, never owned: an Encoding lives while a Tokenizer holds it, so a model's vocabulary goes
# with its last tokenizer. Keyed by (file sha256, pattern, specials); by file sha256 alone for the
# base-token count (any live Encoding of that file knows it).
_ENCODINGS: weakref.WeakValueDictionary[tuple[str, str, tuple[tuple[str, int], ...]], tiktoken.Encoding] = (
    weakref.WeakValueDictionary()
)
_BY_FILE: weakref.WeakValueDictionary[str, tiktoken.Encoding] = weakref.WeakValueDictionary()
_BUILD_LOCK = threading.Lock()


class TiktokenTokenizer(Tokenizer):
    """One model's tiktoken encoding, its special tokens and its stop ids."""

    kind = "tiktoken"
    source_file = TIKTOKEN_FILE

    def __init__(
        self,
        *,
        name: str,
        model_type: str | None,
        encoding: tiktoken.Encoding,
        num_base_tokens: int,
        special_tokens: Mapping[str, int],
        all_special_ids: frozenset[int],
    ) -> None:
        self.name = name
        self.model_type = model_type
        self.n_vocab = num_base_tokens + len(special_tokens)
        self._specials = dict(special_tokens)
        self.special_tokens: Mapping[str, int] = MappingProxyType(self._specials)
        self.added_tokens = self.special_tokens  # every registered token is a control token
        self.all_special_ids = all_special_ids
        self._encoding = encoding
        self._num_base_tokens = num_base_tokens
        self._special_names = {token_id: text for text, token_id in special_tokens.items()}
        self._allowed = frozenset(special_tokens)
        self._control_cache: dict[str, tuple[int, ...]] = {}
        self._text_cache: dict[str, tuple[int, ...]] = {}
        self._run_ids: dict[Run, tuple[int, ...]] = {}
        self._line_cut = encoding._pat_str in LINE_CUT_PATTERNS
        self._line_ids: dict[str, tuple[int, ...]] = {}
        self._line_chars = 0
        self._lines_seen: dict[int, int] = {}  # line hash -> sightings before it is kept
        self._encoding_cached = False  # whether the load found this file's Encoding already built

    @classmethod
    def load(cls, source: TokenizerSource) -> TiktokenTokenizer:
        """Load a model directory's tiktoken ranks exactly as Kimi's TikTokenTokenizer does."""
        files, tokenizer_config = source.files, source.tokenizer_config
        model_type = _model_type(source.config)
        tc_path = files["tokenizer_config.json"]
        pat_str = _pat_str(model_type, tokenizer_config, tc_path, files["config.json"])
        added = _added_tokens(tokenizer_config, tc_path)
        vocab, cached = _vocab(files[TIKTOKEN_FILE], pat_str, added, tc_path)
        tokenizer = cls(
            name=source.model_dir.resolve().name,
            model_type=model_type,
            encoding=vocab.encoding,
            num_base_tokens=vocab.num_base_tokens,
            special_tokens=vocab.special_tokens,
            all_special_ids=_all_special_ids(vocab.special_tokens, added, tokenizer_config),
        )
        tokenizer._encoding_cached = cached
        return tokenizer

    def load_facts(self) -> dict[str, Any]:
        return {"encoding_cached": self._encoding_cached}

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The bytes of the vocabulary's longest token (specials spelled out), computed once."""
        base = max(map(len, self._encoding._mergeable_ranks), default=1)
        return max(base, *map(len, self._specials)) if self._specials else base

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The tiktoken Encoding, shared by every live tokenizer of the same file, pattern and specials."""
        return self._encoding

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; special-looking text is plain BPE unless ``allow_special``. No BOS/EOS."""
        if len(text) <= MAX_RUN_CHARS:
            return self._encode_run(text, allow_special)
        ids: list[int] = []
        for piece in split_for_encoding(text):
            ids.extend(self._encode_run(piece, allow_special))
        return ids

    def encode_pieces(self, pieces: Iterable[tuple[str, bool] | Run]) -> list[int]:
        """A rendered prompt's ids: each ``Run`` served whole from its kept ids, each segment as
        ``encode_segments`` encodes it."""
        return self._encode(pieces)

    def encode_segments(self, segments: Iterable[tuple[str, bool]]) -> list[int]:
        """Concatenated ``encode(text, allow_special=...)`` of each ``(text, allow_special)`` segment."""
        return self._encode(segments)

    def _encode(self, pieces: Iterable[tuple[str, bool] | Run]) -> list[int]:
        """The hot path, once per request over every piece (hundreds for K3), so the common cases are
        inlined: a ``Run`` is one lookup for all its ids, a control segment that is exactly one special
        is its id, a short segment seen before is a dict hit; only new or long text reaches
        ``_uncached`` (where long text reuses the lines it shares with earlier requests).
        """
        ids: list[int] = []
        append, extend = ids.append, ids.extend
        specials, control_cache, text_cache = self._specials, self._control_cache, self._text_cache
        run_ids = self._run_ids
        for piece in pieces:
            if not isinstance(piece, tuple):  # a Run: a Segment is a tuple
                hit = run_ids.get(piece)
                extend(hit if hit is not None else self._run(piece))
                continue
            text, allow_special = piece
            if allow_special:
                special_id = specials.get(text)
                if special_id is not None:
                    append(special_id)
                    continue
                hit = control_cache.get(text)
            else:
                hit = text_cache.get(text)
            extend(hit if hit is not None else self._uncached(text, allow_special))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (bytes joined, invalid UTF-8 replaced); skipping drops ``all_special_ids`` only."""
        bad = self.first_unknown_id(ids)
        if bad is not None:
            raise TokenizerError(f"{self.name}: token id {bad} is out of range [0, {self.n_vocab})")
        if skip_special_tokens:
            ids = [token_id for token_id in ids if token_id not in self.all_special_ids]
        data: bytes = self._encoding.decode_bytes(list(ids))
        return data.decode("utf-8", errors="replace")

    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Kimi's tokenizer adds no BOS; its specials are ids only when asked for."""
        return self.encode(text, allow_special=add_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        try:
            data: bytes = self._encoding.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError):  # tiktoken: unknown id, or a negative one
            return b""
        return data

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        data: bytes = self._encoding.decode_bytes(list(ids))
        return data

    def token_to_id(self, text: str) -> int | None:
        """The id of a registered special, or of text that is exactly one base-vocabulary token."""
        special_id = self._specials.get(text)
        if special_id is not None:
            return special_id
        try:
            token_id: int = self._encoding.encode_single_token(text.encode("utf-8"))
        except (KeyError, UnicodeEncodeError):
            return None
        return token_id

    def id_to_token(self, token_id: int) -> str | None:
        """A special's name, or a base token's text (lossy for byte fragments); None when out of range."""
        if token_id in self._special_names:
            return self._special_names[token_id]
        if not 0 <= token_id < self._num_base_tokens:
            return None
        data: bytes = self._encoding.decode_single_token_bytes(token_id)
        return data.decode("utf-8", errors="replace")

    def _encode_run(self, text: str, allow_special: bool) -> list[int]:
        if allow_special:
            ids: list[int] = self._encoding.encode(text, allowed_special=self._allowed, disallowed_special=())
        else:
            ids = self._encoding.encode_ordinary(text)
        return ids

    def _run(self, run: Run) -> tuple[int, ...]:
        """A run's ids, kept: runs are a formatter's constants (bounded all the same)."""
        ids = tuple(self._encode(run.segments))
        if len(self._run_ids) >= SEGMENT_CACHE_MAX_ENTRIES:
            self._run_ids.clear()
        self._run_ids[run] = ids
        return ids

    def _uncached(self, text: str, allow_special: bool) -> Sequence[int]:
        """A segment the caches do not hold: short ones are encoded once and kept (tags, roles,
        quotes repeat on every request), longer ones go straight to the encoder."""
        if len(text) > SEGMENT_CACHE_MAX_CHARS:
            if allow_special or len(text) > MAX_RUN_CHARS:
                return self.encode(text, allow_special=allow_special)
            if self._line_cut:
                return self._encode_lines(text)
            return self._encoding.encode_ordinary(text)  # new prose: the common miss
        ids = tuple(self._encode_run(text, allow_special))
        cache = self._control_cache if allow_special else self._text_cache
        if len(cache) >= SEGMENT_CACHE_MAX_ENTRIES:
            cache.clear()  # bounded under adversarial input; hot entries refill at once
        cache[text] = ids
        return ids

    def _encode_lines(self, text: str) -> list[int]:
        """A text segment cut into lines (``LINE_CUT_PATTERNS``): a line seen ``LINE_KEEP_SIGHTINGS``
        times is kept and served from then on (a template's literal lines recur on every request,
        user text rarely); the lines between kept ones are encoded together, one call per span."""
        ids: list[int] = []
        extend, encode = ids.extend, self._encoding.encode_ordinary
        kept, seen = self._line_ids, self._lines_seen
        pending = start = 0  # text[pending:start]: lines not kept, still to encode
        for line in _LINE.findall(text):
            if not line:  # the empty match at the end
                break
            end = start + len(line)
            hit = kept.get(line)
            if hit is None and len(line) <= LINE_CACHE_MAX_CHARS:
                sightings = seen.get(key := hash(line), 0) + 1
                if sightings >= LINE_KEEP_SIGHTINGS:
                    del seen[key]
                    hit = self._keep(line)
                else:
                    if len(seen) >= LINES_SEEN_MAX:
                        seen.clear()
                    seen[key] = sightings
            if hit is not None:
                if pending < start:
                    extend(encode(text[pending:start]))
                extend(hit)
                pending = end
            start = end
        if pending < start:
            extend(encode(text[pending:]))
        return ids

    def _keep(self, line: str) -> tuple[int, ...]:
        """A recurring line: encoded and kept (within the ``LINE_CACHE_*`` bounds)."""
        if (
            self._line_chars + len(line) > LINE_CACHE_BUDGET_CHARS
            or len(self._line_ids) >= LINE_CACHE_MAX_ENTRIES
        ):
            self._line_ids.clear()  # bounded under adversarial input; hot lines come back on next sight
            self._line_chars = 0
        ids = self._line_ids[line] = tuple(self._encoding.encode_ordinary(line))
        self._line_chars += len(line)
        return ids


def split_for_encoding(
    text: str, *, window: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS
) -> Iterator[str]:
    """Kimi's pieces: 400,000-char windows, each cut inside whitespace / non-whitespace runs over 25,000.

    Only overlong runs are cut (every ``max_run`` chars from the run start), as the reference's
    ``_split_whitespaces_or_nonwhitespaces`` does; ``\\s`` in ``re`` is exactly ``str.isspace()``.
    Linear in the text (``_long_runs``).
    """
    for start in range(0, len(text), window):
        chunk = text[start : start + window]
        cut = 0
        for run_start, run_end in _long_runs(chunk, max_run):
            for position in range(run_start + max_run, run_end, max_run):
                yield chunk[cut:position]
                cut = position
        yield chunk[cut:]


def _long_runs(chunk: str, max_run: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of every whitespace / non-whitespace run longer than ``max_run``, in order.

    Such a run spans more than ``max_run`` positions, so it holds a multiple of ``max_run``: only
    those probes are looked at. A probe's run is measured forward from the probe and at most
    ``max_run`` back (a run reaching further back would hold the previous probe, which measured it),
    and probes inside a measured run are skipped, so every character is read O(1) times. (A regex
    such as ``\\s{25001,}`` retries from every position of a long run that falls short: quadratic.)
    """
    measured = 0
    for probe in range(0, len(chunk), max_run):
        if probe < measured:
            continue
        run = _SPACE_RUN if chunk[probe].isspace() else _WORD_RUN
        end = probe + _run_length(run, chunk, probe)
        start = probe - _run_length(run, chunk[max(probe - max_run, 0) : probe][::-1], 0)
        measured = end
        if end - start > max_run:
            yield start, end


def _run_length(run: re.Pattern[str], text: str, position: int) -> int:
    match = run.match(text, position)
    return match.end() - position if match else 0


def _model_type(config: dict[str, Any]) -> str | None:
    value = config.get("model_type")
    return value if isinstance(value, str) else None


def _pat_str(
    model_type: str | None, tokenizer_config: dict[str, Any], tc_path: Path, config_path: Path
) -> str:
    """tokenizer_config ``pat_str`` wins; else the registry entry for config.json ``model_type``."""
    override = tokenizer_config.get("pat_str")
    if override is not None:
        if not isinstance(override, str) or not override:
            raise TokenizerError(f"{tc_path}: pat_str must be a non-empty string, got {override!r}")
        return override
    pat_str = PAT_STR_BY_MODEL_TYPE.get(model_type or "")
    if pat_str is None:
        raise TokenizerError(
            f"{config_path}: no pre-tokenization pattern for model_type {model_type!r} "
            f"(known: {', '.join(KNOWN_MODEL_TYPES)}); set pat_str in {tc_path.name}"
        )
    return pat_str


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read tokenizer file: {exc}") from exc


def _added_tokens(tokenizer_config: dict[str, Any], path: Path) -> dict[int, tuple[str, bool]]:
    """``added_tokens_decoder`` as id -> (content, HF special flag)."""
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{path}: added_tokens_decoder must be an object")
    added: dict[int, tuple[str, bool]] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not key.isdigit() or not isinstance(content, str) or not content:
            raise TokenizerError(f"{path}: malformed added_tokens_decoder entry {key!r}: {entry!r}")
        added[int(key)] = (content, bool(entry.get("special", False)))
    return added


def _vocab(
    path: Path, pat_str: str, added: dict[int, tuple[str, bool]], tc_path: Path
) -> tuple[_Vocab, bool]:
    """The Encoding for this file's bytes, pattern and specials: shared while any tokenizer holds it."""
    data = _read_bytes(path)
    sha256 = hashlib.sha256(data).hexdigest()
    with _BUILD_LOCK:
        ranks = None
        sibling = _BY_FILE.get(sha256)
        if sibling is not None:
            num_base = sibling.n_vocab - NUM_RESERVED_SPECIAL_TOKENS  # specials fill the slots above
        else:
            ranks = _parse_ranks(data, path)
            num_base = len(ranks)
        _check_added_range(added, num_base, tc_path)
        specials = _special_tokens(num_base, added)
        key = (sha256, pat_str, tuple(specials.items()))
        encoding = _ENCODINGS.get(key)
        if encoding is not None:
            return _Vocab(encoding, num_base, specials), True
        if ranks is None:
            ranks = _parse_ranks(data, path)
        try:
            encoding = tiktoken.Encoding(
                path.name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials
            )
        except ValueError as exc:
            raise TokenizerError(
                f"{path}: cannot build the tiktoken encoding (pat_str {pat_str!r}): {exc}"
            ) from exc
        _ENCODINGS[key] = encoding
        _BY_FILE[sha256] = encoding
        return _Vocab(encoding, num_base, specials), False


def _parse_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """``load_tiktoken_bpe``'s format, parsed here: that function caches local files by path in the
    temp dir and serves a stale copy when the file changes."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{path}: line {number} is not 'base64token rank': {line[:80]!r}") from exc
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be exactly 0..N-1, one per distinct token")
    return ranks


def _check_added_range(added: dict[int, tuple[str, bool]], num_base: int, tc_path: Path) -> None:
    last = num_base + NUM_RESERVED_SPECIAL_TOKENS - 1
    for token_id, (content, _) in sorted(added.items()):
        if not num_base <= token_id <= last:
            raise TokenizerError(
                f"{tc_path}: added token {token_id} {content!r} is outside the reserved special range "
                f"[{num_base}, {last}] of this tiktoken vocabulary"
            )


def _special_tokens(num_base: int, added: dict[int, tuple[str, bool]]) -> dict[str, int]:
    """All 256 reserved slots, named or ``<|reserved_token_{id}|>``, in id order."""
    specials: dict[str, int] = {}
    for token_id in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS):
        name = added[token_id][0] if token_id in added else f"<|reserved_token_{token_id}|>"
        if name in specials:
            raise TokenizerError(f"special token {name!r} names both id {specials[name]} and id {token_id}")
        specials[name] = token_id
    return specials


def _all_special_ids(
    specials: Mapping[str, int], added: dict[int, tuple[str, bool]], tokenizer_config: dict[str, Any]
) -> frozenset[int]:
    """HF semantics: added tokens flagged special, plus bos/eos/unk/pad and additional_special_tokens."""
    ids = {token_id for token_id, (_, special) in added.items() if special}
    names = [token_content(tokenizer_config.get(key)) for key in _HF_SPECIAL_KEYS]
    additional = tokenizer_config.get("additional_special_tokens")
    if isinstance(additional, list):
        names.extend(token_content(item) for item in additional)
    ids.update(specials[name] for name in names if name is not None and name in specials)
    return frozenset(ids)
