"""Answer parsers: cost per output token at 1k, 10k and 100k tokens (linear means a flat cost).

``python -m benchmarks.parsing [--sizes 1000 10000 100000] [--only NAME ...]``

Each parser family (K3 in the reference form after its think channel, K3 hosted, Hermes, Llama 3
JSON, DeepSeek V3 / V3.1 and Qwen3-Coder on the qwen-vl-demo vocabulary where their markers are text
and on it with the markers added as tokens, as real vocabularies have them; GPT-OSS Harmony, Kimi-K2
and GLM-4.5 on their scripts/make_hf_models.py vocabularies; plain) parses three kinds of output of
each size:

* ``whitespace``: message-level whitespace ids (a degenerate but ordinary output: K3 after the
  think channel closed, K3 hosted before any channel, Hermes before a possible ``<think>``, and
  after a tool call);
* ``text``: ordinary words in a text channel;
* ``markers``: structure all along (K3 tool calls with an argument each, Hermes ``<tool_call>``
  blocks, DeepSeek calls in one calls section, Qwen3-Coder ``<function=...>`` blocks, Harmony
  analysis and call messages, Kimi-K2 calls in a section, GLM-4.5 call blocks, Mistral
  ``[TOOL_CALLS]`` calls in both forms, plain text with stray special ids between words).

Both ways the frontend uses a parser: ``streamed`` (one id per ``feed``, the worst chunking) and
``whole`` (``parse_answer`` on every id at once). Each size is run over about the same number of
tokens (1k 100 times, 10k 10 times, 100k once); the figure is the ratio of the per-token cost at
the largest size to that at the smallest, target <= 2x (a quadratic parser is ~100x).

``--streams 16`` (the default) adds the serving case: 16 responses at once, each parser fed one id
in turn (as the frontend does with 16 streams open), per-token cost in microseconds for each family
(target <= 2 us), and its ratio to the plain parser measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from benchmarks._report import Suite

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from support.hf_models import built_models  # noqa: E402

from dynamo_prep.models import resolve_model_dir  # noqa: E402
from dynamo_prep.parsing import (  # noqa: E402
    AnswerParser,
    HermesAnswerParser,
    KimiK3AnswerParser,
    ParseOptions,
    PlainAnswerParser,
    parse_answer,
    parser_for,
)
from dynamo_prep.parsing._tokens import Vocab, vocab_of  # noqa: E402
from dynamo_prep.tokenizer import Tokenizer  # noqa: E402

SIZES = (1_000, 10_000, 100_000)
TARGET_RATIO = 2.0
STREAMS = 16
TARGET_STREAM_US = 2.0
STREAM_TOKENS = 4_000
"""Tokens per stream in the 16-stream case."""
K3_MODEL = "kimi-k3-demo"
QWEN_MODEL = "qwen-vl-demo"


class Workload(NamedTuple):
    name: str
    make: Callable[[], AnswerParser]
    prefix: list[int]
    body: list[int]
    """Repeated (and cut) to the size; the prefix does not count."""


def segments(tokenizer: Tokenizer, *parts: tuple[str, bool]) -> list[int]:
    return tokenizer.encode_segments(list(parts))


def k3_tag(tag: str, attrs: str = "", *, close: bool = False) -> list[tuple[str, bool]]:
    return [("<|close|>" if close else "<|open|>", True), (tag + attrs, False), ("<|sep|>", True)]


def k3_workloads(tokenizer: Tokenizer) -> list[Workload]:
    vocab = vocab_of(tokenizer)
    blank = tokenizer.encode(" ") + tokenizer.encode("\n")
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    call = segments(
        tokenizer,
        *k3_tag("call", ' tool="f"'),
        *k3_tag("argument", ' key="a" type="integer"'),
        ("1", False),
        *k3_tag("argument", close=True),
        *k3_tag("call", close=True),
    )

    def reference() -> AnswerParser:
        return KimiK3AnswerParser(vocab, thinking=True)

    def hosted() -> AnswerParser:
        return KimiK3AnswerParser(vocab, thinking=False, prompt_form="hosted")

    think_closed = segments(tokenizer, ("hm", False), *k3_tag("think", close=True))
    tools = segments(tokenizer, *k3_tag("tools"))
    response = segments(tokenizer, *k3_tag("response"))
    return [
        Workload("k3 after think, whitespace", reference, think_closed, blank),
        Workload("k3 after think, text", reference, [], words),
        Workload("k3 after think, markers", reference, think_closed + tools, call),
        Workload("k3 hosted, whitespace", hosted, [], blank),
        Workload("k3 hosted, text", hosted, response, words),
        Workload("k3 hosted, markers", hosted, tools, call),
    ]


def hermes_workloads(tokenizer: Tokenizer) -> list[Workload]:
    vocab = vocab_of(tokenizer)
    blank = tokenizer.encode(" ") + tokenizer.encode("\n")
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    call = tokenizer.encode('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n')

    def make() -> AnswerParser:
        return HermesAnswerParser(vocab, think_tags=True, start_in_reasoning=False, tool_calls=True)

    return [
        Workload("hermes, whitespace", make, [], blank),
        Workload("hermes after a call, whitespace", make, call, blank),
        Workload("hermes, text", make, [], words),
        Workload("hermes, markers", make, [], call),
    ]


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_MARKERS = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP)
TAG_TOKENS = {
    "<tool_call>": 14,
    "</tool_call>": 15,
    "<think>": 24,
    "</think>": 25,
    "<|python_tag|>": 40,
    **{marker: 41 + index for index, marker in enumerate(DS_MARKERS)},
}
"""Markers registered as added tokens above the Qwen demo's base (Qwen's own offsets for its tags),
as real Qwen3, Llama 3 and DeepSeek vocabularies have them: then they are matched on their ids."""
CONTROL_TOKENS = {"[TOOL_CALLS]": 41, "[ARGS]": 42, "[CALL_ID]": 43, "[THINK]": 44, "[/THINK]": 45}
"""Mistral's markers, control (special) tokens as in Mistral's vocabularies, above those."""


def tagged_tokenizer(directory: Path) -> Tokenizer:
    """The Qwen demo vocabulary with ``TAG_TOKENS`` added (written into ``directory``)."""
    source = resolve_model_dir(QWEN_MODEL)
    for path in source.iterdir():
        shutil.copy(path, directory / path.name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    base = min(int(key) for key in config["added_tokens_decoder"])
    for tag, offset in TAG_TOKENS.items():
        config["added_tokens_decoder"][str(base + offset)] = {"content": tag, "special": False}
    for tag, offset in CONTROL_TOKENS.items():
        config["added_tokens_decoder"][str(base + offset)] = {"content": tag, "special": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_model_dir(directory)


def tagged_workloads(tokenizer: Tokenizer) -> list[Workload]:
    """Hermes and Llama 3 JSON where their markers are tokens, as on real Qwen3 and Llama 3 vocabularies."""
    vocab = vocab_of(tokenizer)
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    hermes_call = tokenizer.encode_segments(
        [("<tool_call>", True), ('\n{"name": "f", "arguments": {"a": 1}}\n', False), ("</tool_call>", True)]
    )
    llama_call = tokenizer.encode_segments(
        [("<|python_tag|>", True), ('{"name": "f", "parameters": {"a": 1, "s": "x \\" y"}}', False)]
    )

    def hermes() -> AnswerParser:
        return parser_for(vocab, "qwen3", "hermes", ParseOptions(thinking=True))

    def llama() -> AnswerParser:
        return parser_for(vocab, None, "llama3_json", ParseOptions())

    think_closed = tokenizer.encode_segments([("hm", False), ("</think>", True)])
    return [
        Workload("hermes on tag tokens, text", hermes, think_closed, words),
        Workload("hermes on tag tokens, markers", hermes, think_closed, hermes_call),
        Workload("llama3_json on tag tokens, text", llama, [], words),
        Workload("llama3_json on tag tokens, markers", llama, [], llama_call),
        *family_workloads(tokenizer, "on tag tokens"),
        *mistral_workloads(tokenizer),
    ]


def family_workloads(tokenizer: Tokenizer, where: str) -> list[Workload]:
    """DeepSeek V3 / V3.1 (with DeepSeek's reasoning, thinking on) and Qwen3-Coder (with Qwen3's)."""
    vocab = vocab_of(tokenizer)
    blank = tokenizer.encode(" ") + tokenizer.encode("\n")
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    marked = [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, "<tool_call>", "</tool_call>"]

    def ids(*parts: str) -> list[int]:
        return tokenizer.encode_segments([(part, part in marked or part == "</think>") for part in parts])

    def composed(reasoning: str, tools: str) -> Callable[[], AnswerParser]:
        return lambda: parser_for(vocab, reasoning, tools, ParseOptions(thinking=True))

    v31_call = ids(DS_CALL_BEGIN, "f", DS_SEP, '{"a": 1, "s": "x \\" y"}', DS_CALL_END, "\n")
    v3_call = ids(DS_CALL_BEGIN, "function", DS_SEP, 'f\n```json\n{"a": [1, "}"]}\n```', DS_CALL_END)
    coder_call = ids(
        "<tool_call>",
        "\n<function=f>\n<parameter=a>\n1 < 2\n</parameter>\n</function>\n",
        "</tool_call>",
        "\n",
    )
    think_closed, section = ids("hm", "</think>"), ids("hm", "</think>", DS_CALLS_BEGIN)
    v31, v3, coder = (
        composed("deepseek_v3", "deepseek_v31"),
        composed("deepseek_v3", "deepseek_v3"),
        composed("qwen3", "qwen3_coder"),
    )
    return [
        Workload(f"deepseek_v31 {where}, whitespace", v31, section + v31_call, blank),
        Workload(f"deepseek_v31 {where}, text", v31, think_closed, words),
        Workload(f"deepseek_v31 {where}, markers", v31, section, v31_call),
        Workload(f"deepseek_v3 {where}, markers", v3, section, v3_call),
        Workload(f"qwen3_coder {where}, whitespace", coder, think_closed + coder_call, blank),
        Workload(f"qwen3_coder {where}, text", coder, think_closed, words),
        Workload(f"qwen3_coder {where}, markers", coder, think_closed, coder_call),
    ]


def mistral_workloads(tokenizer: Tokenizer) -> list[Workload]:
    """Mistral's reasoning and calls (``mistral`` + ``mistral``) on control tokens: the v11+ form
    ``[TOOL_CALLS]name[ARGS]{...}`` and the JSON array of earlier tokenizers."""
    vocab = vocab_of(tokenizer)
    blank = tokenizer.encode(" ") + tokenizer.encode("\n")
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    v11_call = segments(
        tokenizer, ("[TOOL_CALLS]", True), ("f", False), ("[ARGS]", True), ('{"a": 1, "s": "x \\" y"}', False)
    )
    array_call = segments(
        tokenizer, ("[TOOL_CALLS]", True), ('[{"name": "f", "arguments": {"a": 1, "s": "x \\" y"}}]', False)
    )

    def make() -> AnswerParser:
        return parser_for(vocab, "mistral", "mistral", ParseOptions())

    think = segments(tokenizer, ("[THINK]", True))
    think_closed = segments(tokenizer, ("[THINK]", True), ("hm", False), ("[/THINK]", True))
    return [
        Workload("mistral in reasoning, text", make, think, words),
        Workload("mistral after think, text", make, think_closed, words),
        Workload("mistral after a call, whitespace", make, v11_call, blank),
        Workload("mistral v11, markers", make, think_closed, v11_call),
        Workload("mistral JSON array, markers", make, think_closed, array_call),
    ]


def llama3_json_workloads(tokenizer: Tokenizer) -> list[Workload]:
    """Llama 3 JSON calls (on the Qwen demo vocabulary: the python tag is text there, the JSON the same)."""
    vocab = vocab_of(tokenizer)
    blank = tokenizer.encode(" ") + tokenizer.encode("\n")
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    call = tokenizer.encode('{"name": "f", "parameters": {"a": 1, "s": "x \\" y"}}; ')

    def make() -> AnswerParser:
        return parser_for(vocab, None, "llama3_json", ParseOptions())

    return [
        Workload("llama3_json, whitespace", make, [], blank),
        Workload("llama3_json, text", make, [], words),
        Workload("llama3_json, markers", make, [], call),
    ]


def pythonic_workloads(tokenizer: Tokenizer) -> list[Workload]:
    """Pythonic calls (on the Qwen demo vocabulary: Llama 4's python tags are text there, looked for in
    the text), and a hostile run of brackets: a list of lists is no call, nesting inside a call's
    arguments is refused past its bound, both become content."""
    vocab = vocab_of(tokenizer)
    blank = tokenizer.encode(" ") + tokenizer.encode("\n")
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    call = tokenizer.encode("f(a=1, s='x \\' ) y', n=[None, {'k': True}]), ")
    brackets = tokenizer.encode("[[[(({{")

    def pythonic() -> AnswerParser:
        return parser_for(vocab, None, "pythonic", ParseOptions())

    def llama4() -> AnswerParser:
        return parser_for(vocab, None, "llama4_pythonic", ParseOptions())

    return [
        Workload("pythonic, whitespace", pythonic, [], blank),
        Workload("pythonic, text", pythonic, [], words),
        Workload("pythonic, markers", pythonic, tokenizer.encode("["), call),
        Workload("pythonic in a call, brackets", pythonic, tokenizer.encode("[f(a="), brackets),
        Workload("llama4_pythonic, whitespace", llama4, [], blank),
        Workload("llama4_pythonic, text", llama4, [], words),
        Workload("llama4_pythonic, markers", llama4, tokenizer.encode("<|python_start|>["), call),
        Workload("llama4_pythonic, brackets", llama4, [], brackets),
    ]


def plain_workloads(tokenizer: Tokenizer) -> list[Workload]:
    vocab: Vocab = vocab_of(tokenizer)
    blank = tokenizer.encode(" ") + tokenizer.encode("\n")
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog. ")
    stray = tokenizer.special_tokens["<|im_start|>"]

    def make() -> AnswerParser:
        return PlainAnswerParser(vocab)

    return [
        Workload("plain, whitespace", make, [], blank),
        Workload("plain, text", make, [], words),
        Workload(
            "plain, markers",
            make,
            [],
            [word for pair in zip(words, itertools.repeat(stray)) for word in pair],
        ),
    ]


def hf_family_workloads(models: dict[str, Path]) -> list[Workload]:
    """GPT-OSS Harmony, Kimi-K2 and GLM-4.5 by their registered names, on their own vocabularies
    (every marker a special token)."""

    def declared(name: str, reasoning: str | None, tool_calls: str | None) -> Callable[[], AnswerParser]:
        vocab = vocab_of(tokenizers[name])
        return lambda: parser_for(vocab, reasoning, tool_calls, ParseOptions())

    def marked(name: str, *parts: str) -> list[int]:
        tokenizer = tokenizers[name]
        return tokenizer.encode_segments([(part, tokenizer.is_special_token(part)) for part in parts])

    tokenizers = {name: Tokenizer.from_model_dir(models[name]) for name in ("gpt_oss", "kimi_k2", "glm45")}
    blank = {name: t.encode(" ") + t.encode("\n") for name, t in tokenizers.items()}
    words = {
        name: t.encode("the quick brown fox jumps over the lazy dog. ") for name, t in tokenizers.items()
    }
    harmony, k2, glm = (
        declared("gpt_oss", "openai_gptoss", "openai"),
        declared("kimi_k2", None, "kimi_k2"),
        declared("glm45", "glm45", "glm45"),
    )
    harmony_call = marked(
        "gpt_oss", "<|channel|>", "commentary to=functions.f", "<|message|>", '{"a": 1}', "<|call|>"
    )
    harmony_messages = marked(
        "gpt_oss", "<|channel|>", "analysis", "<|message|>", "hm. ", "<|end|>", "<|start|>"
    )
    harmony_messages += (
        marked("gpt_oss", "assistant") + harmony_call + marked("gpt_oss", "<|start|>", "assistant")
    )
    k2_call = marked(
        "kimi_k2",
        "<|tool_call_begin|>",
        "functions.f:0",
        "<|tool_call_argument_begin|>",
        '{"a": 1}',
        "<|tool_call_end|>",
    )
    glm_call = marked(
        "glm45",
        "<tool_call>",
        "f\n",
        "<arg_key>",
        "a",
        "</arg_key>",
        "<arg_value>",
        "1",
        "</arg_value>",
        "</tool_call>",
    )
    return [
        Workload("harmony, whitespace", harmony, harmony_call, blank["gpt_oss"]),
        Workload(
            "harmony, text",
            harmony,
            marked("gpt_oss", "<|channel|>", "final", "<|message|>"),
            words["gpt_oss"],
        ),
        Workload("harmony, markers", harmony, [], harmony_messages),
        Workload("kimi_k2, whitespace", k2, [], blank["kimi_k2"]),
        Workload("kimi_k2, text", k2, [], words["kimi_k2"]),
        Workload("kimi_k2, markers", k2, marked("kimi_k2", "<|tool_calls_section_begin|>"), k2_call),
        Workload("glm45 after a call, whitespace", glm, glm_call, blank["glm45"]),
        Workload("glm45, text", glm, marked("glm45", "<think>", "hm", "</think>"), words["glm45"]),
        Workload("glm45, markers", glm, [], glm_call + tokenizers["glm45"].encode("\n")),
    ]


def ids_of(workload: Workload, size: int) -> list[int]:
    return workload.prefix + list(itertools.islice(itertools.cycle(workload.body), size))


def streamed(make: Callable[[], AnswerParser], ids: Sequence[int]) -> None:
    parser = make()
    for token_id in ids:
        parser.feed((token_id,))
    parser.finish("stop")


def whole(make: Callable[[], AnswerParser], ids: Sequence[int]) -> None:
    parse_answer(make(), ids, "stop")


MODES: dict[str, Callable[[Callable[[], AnswerParser], Sequence[int]], None]] = {
    "streamed": streamed,
    "whole": whole,
}


def per_token_us(workload: Workload, mode: str, size: int, budget: int) -> float:
    """Microseconds per token of ``size``-token outputs, over about ``budget`` tokens in all."""
    ids = ids_of(workload, size)
    run = MODES[mode]
    repeats = max(1, budget // size)
    run(workload.make, ids[: min(len(ids), 200)])  # warm up
    started = time.perf_counter()
    for _ in range(repeats):
        run(workload.make, ids)
    return (time.perf_counter() - started) / (repeats * size) * 1e6


def bench(suite: Suite, workloads: list[Workload], sizes: Sequence[int]) -> None:
    budget = max(sizes)
    for workload in workloads:
        for mode in MODES:
            costs = {size: per_token_us(workload, mode, size, budget) for size in sizes}
            ratio = costs[max(sizes)] / costs[min(sizes)]
            suite.details[f"{workload.name}, {mode}"] = {
                str(size): round(us, 3) for size, us in costs.items()
            }
            note = ", ".join(f"{us:.2f} us/token at {size:,}" for size, us in costs.items())
            suite.record(
                f"{workload.name}, {mode}: per-token cost {max(sizes):,} / {min(sizes):,}",
                ratio,
                "x",
                target=f"<= {TARGET_RATIO:g}x",
                met=ratio <= TARGET_RATIO,
                note=note,
            )


def streams_us(workload: Workload, streams: int, tokens: int) -> float:
    """Microseconds per token with ``streams`` parsers open at once, each fed one id in turn."""
    ids = ids_of(workload, tokens)
    parsers = [workload.make() for _ in range(streams)]
    started = time.perf_counter()
    for token_id in ids:
        for parser in parsers:
            parser.feed((token_id,))
    for parser in parsers:
        parser.finish("stop")
    return (time.perf_counter() - started) / (streams * len(ids)) * 1e6


def bench_streams(suite: Suite, workloads: list[Workload], baselines: list[Workload], streams: int) -> None:
    plain = {w.name.split(", ")[1]: w for w in baselines}
    for workload in workloads:
        kind = workload.name.split(", ")[-1]
        us = min(streams_us(workload, streams, STREAM_TOKENS) for _ in range(3))
        base = (
            min(streams_us(plain[kind], streams, STREAM_TOKENS) for _ in range(3)) if kind in plain else None
        )
        note = f"{base:.2f} us/token for plain {kind}, {us / base:.2f}x" if base else ""
        suite.record(
            f"{workload.name}, {streams} streams: per-token cost",
            us,
            "us",
            target=f"<= {TARGET_STREAM_US:g} us",
            met=us <= TARGET_STREAM_US,
            note=note,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="output sizes in tokens")
    parser.add_argument("--only", nargs="*", default=[], help="workloads whose name contains one of these")
    parser.add_argument("--streams", type=int, default=STREAMS, help="parsers open at once (0: skip)")
    args = parser.parse_args(argv)
    k3, qwen = Tokenizer.from_model_dir(K3_MODEL), Tokenizer.from_model_dir(QWEN_MODEL)
    with tempfile.TemporaryDirectory() as scratch:
        tagged = tagged_tokenizer(Path(scratch))
    workloads = (
        k3_workloads(k3)
        + hermes_workloads(qwen)
        + llama3_json_workloads(qwen)
        + family_workloads(qwen, "on text markers")
        + tagged_workloads(tagged)
        + hf_family_workloads(built_models())
        + pythonic_workloads(qwen)
        + plain_workloads(qwen)
    )
    if args.only:
        workloads = [w for w in workloads if any(part in w.name for part in args.only)]
    suite = Suite("parsing")
    bench(suite, workloads, sorted(args.sizes))
    if args.streams:
        bench_streams(suite, workloads, plain_workloads(qwen), args.streams)
    if sorted(args.sizes) == list(SIZES) and not args.only:
        print(f"wrote {suite.write()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
