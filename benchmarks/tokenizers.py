"""Hugging Face checkpoints: encoding, streamed decoding and memory, against the ``tokenizers`` library.

Three figures (issue 26), each a ratio of medians measured in one run, the candidates alternating
round by round, on the directories of scripts/make_hf_models.py (real vocabularies):

* encode: the preprocessor's ids of a rendered ~2k-token chat (``encode_pieces`` over the
  formatter's segments; and a chat whose user text spells control tokens, the traced path) per the
  ``tokenizers`` library's own ``encode`` of the same text; target <= 1.2x;
* streamed decoding: 16 streams of 2,000 tokens fed one id at a time: our detokenization (each
  id's bytes, UTF-8 decoded incrementally; target <= 5 us a token), the whole plain answer parser
  around it (what the frontend runs per token), and, as the peer, vLLM's ``DecodeStream``;
* memory: one frontend process building five models' preprocessors, its RSS growth per model.

Usage: python -m benchmarks.tokenizers [--rounds N]
"""

from __future__ import annotations

import argparse
import codecs
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._report import Suite

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from support.hf_models import built_models  # noqa: E402
from tokenizers import Tokenizer as RustTokenizer  # noqa: E402
from tokenizers.decoders import DecodeStream  # noqa: E402

from dynamo_prep.card import ModelDeploymentCard  # noqa: E402
from dynamo_prep.parsing import plain_parser_for  # noqa: E402
from dynamo_prep.preprocessor import OpenAIPreprocessor  # noqa: E402
from dynamo_prep.protocol.openai import parse_chat_request  # noqa: E402

ENCODE_FAMILIES = ("llama3", "qwen2_5", "mistral_v3", "gemma3")
MEMORY_FAMILIES = ("llama3", "qwen2_5", "mistral_v3", "gemma3", "deepseek_v3")
STREAMS, STREAM_TOKENS = 16, 2_000
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{n}",
            "description": f"Tool number {n}: looks things up in a catalogue of items, with filters.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for n in range(6)
]
PROSE = (
    "The committee reviewed {n} proposals for the new transit line, weighing cost, ridership and the "
    "disruption of construction along the route. Émile noted that 日本語 signage matters too. "
)


def chat(nonce: int, *, forged: bool = False) -> dict[str, Any]:
    """A ~2k-token chat (system, tools, several turns); ``forged`` user text spells control tokens."""
    extra = " <|eot_id|> <|im_end|> [INST] <start_of_turn> </s>" if forged else ""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant. " * 8}]
    for turn in range(6):
        messages.append({"role": "user", "content": PROSE.format(n=nonce + turn) * 5 + extra})
        messages.append({"role": "assistant", "content": PROSE.format(n=turn) * 3})
    messages.append({"role": "user", "content": f"Summarize round {nonce}."})
    return {"model": "m", "messages": messages, "tools": TOOLS}


def median_us(run: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def encode_ratio(
    preprocessor: OpenAIPreprocessor, rust: RustTokenizer, forged: bool, rounds: int
) -> tuple[float, int]:
    """Ours (encode_pieces) per the tokenizers library's encode of the same text, fresh chats."""
    ours: list[float] = []
    theirs: list[float] = []
    tokens = 0
    for nonce in range(rounds):
        rendered = preprocessor.formatter.render(parse_chat_request(chat(nonce, forged=forged)))
        assert rendered.pieces is not None
        pieces, text = rendered.pieces, rendered.text

        def mine(pieces: Any = pieces) -> object:
            return preprocessor.tokenizer.encode_pieces(pieces)

        def peer(text: str = text) -> object:
            return rust.encode(text, add_special_tokens=False)

        if nonce % 2:  # the candidates alternate which goes first
            theirs.append(median_us(peer, 3))
            ours.append(median_us(mine, 3))
        else:
            ours.append(median_us(mine, 3))
            theirs.append(median_us(peer, 3))
        tokens = len(preprocessor.tokenizer.encode_pieces(pieces))
    return statistics.median(ours) / statistics.median(theirs), tokens


def stream_us(preprocessor: OpenAIPreprocessor, rust: RustTokenizer, prompt: list[int]) -> list[float]:
    """us per token for 16 interleaved streams fed one id at a time: our detokenization (the id's
    bytes, UTF-8 decoded incrementally), our whole plain answer parser, and vLLM's DecodeStream."""
    tokenizer = preprocessor.tokenizer
    ids = tokenizer.encode(PROSE.format(n=7) * 40, allow_special=True)[:STREAM_TOKENS]
    decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(STREAMS)]
    parsers = [plain_parser_for(tokenizer) for _ in range(STREAMS)]
    streams = [DecodeStream(ids=prompt, skip_special_tokens=True) for _ in range(STREAMS)]
    runs: list[Callable[[int], object]] = [
        lambda token_id: [decoder.decode(tokenizer.token_bytes(token_id)) for decoder in decoders],
        lambda token_id: [parser.feed([token_id]) for parser in parsers],
        lambda token_id: [stream.step(rust, token_id) for stream in streams],
    ]
    figures = []
    for run in runs:
        started = time.perf_counter()
        for token_id in ids:
            run(token_id)
        figures.append((time.perf_counter() - started) * 1e6 / (len(ids) * STREAMS))
    return figures


def preprocessor_for(directory: Path) -> OpenAIPreprocessor:
    return OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir(directory), directory)


MEMORY_PROBE = """
import gc, sys
from pathlib import Path
from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.preprocessor import OpenAIPreprocessor
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
kept, before = [], rss()
for path in sys.argv[1:]:
    kept.append(OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir(path), path))
    gc.collect()
    now = rss(); print("RSS", Path(path).name, round(now - before, 1)); before = now
"""


def memory_per_model(models: dict[str, Path]) -> dict[str, float]:
    """RSS growth of one process per model built (a fresh interpreter, models built in turn)."""
    paths = [str(models[name]) for name in MEMORY_FAMILIES]
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, *paths], capture_output=True, text=True, check=True
    )
    rows = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RSS ")]
    return {name: float(megabytes) for name, megabytes in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    models = built_models()
    suite = Suite("tokenizers")
    for family in ENCODE_FAMILIES:
        preprocessor = preprocessor_for(models[family])
        rust = RustTokenizer.from_file(str(models[family] / "tokenizer.json"))
        gc.collect()
        ratio, tokens = encode_ratio(preprocessor, rust, False, args.rounds)
        suite.record(
            f"{family}: encode a {tokens}-token chat / tokenizers' encode",
            ratio,
            "x",
            "<= 1.2x",
            ratio <= 1.2,
        )
        ratio, tokens = encode_ratio(preprocessor, rust, True, args.rounds)
        suite.record(f"{family}: the same, user text spelling control tokens (traced)", ratio, "x", "", None)
        prompt = preprocessor.tokenize(
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
        ).token_ids
        detokenize, parse, peer = stream_us(preprocessor, rust, prompt)
        suite.record(
            f"{family}: streamed detokenization, 16 streams",
            detokenize,
            "us/token",
            "<= 5 us",
            detokenize <= 5,
        )
        suite.record(f"{family}: the plain answer parser, 16 streams", parse, "us/token")
        suite.record(f"{family}: vLLM's DecodeStream, 16 streams", peer, "us/token")
    for name, megabytes in memory_per_model(models).items():
        suite.record(f"RSS growth building {name}'s preprocessor", megabytes, "MB")
    print(f"wrote {suite.write()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
