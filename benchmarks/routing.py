"""KV routing: decision time and event ingestion on one core (micro), round robin against kv (e2e).

``python -m benchmarks.routing [--parts micro,e2e] [--instances 8] [--blocks 50000] [--decisions 3000]
[--users 72] [--concurrency 12] [--kv-blocks 2048] [--prefill-ms-per-1k 150] [--log-dir DIR]``

Part ``micro`` (in this process, no sockets):

* A realistic fleet: ``--instances`` mock engines (``PagedPrefixCache``, block size 16, int and
  bytes engine hashes alternating) each serve conversations until they hold ``--blocks`` blocks:
  prompts of 2-8k tokens opening with one of 16 shared preambles (512-2048 tokens: system prompts,
  tool declarations) and follow-up turns (the previous prompt, the answer, a new question).
  Their events are cut the way vLLM publishes them (a prefill chunk of at most 2048 tokens per
  ``BlockStored``, a few events per batch).
* Ingestion: every batch applied to a fresh ``KvIndex``, as typed events and as encoded payloads
  (``decode_batch`` + ``apply``, half map-shaped and half array-shaped), the best of ``--rounds``
  runs. Target >= 200k blocks/s.
* Decision: ``KvRouter.decide`` (hash the prompt + match + choose) over the full index, for a mix
  of follow-ups (mostly cached), new conversations on a shared preamble, and unseen prompts,
  2-8k tokens each. Target p99 <= 100 us. Each prompt's time is the best of ``--rounds`` rounds
  (the machine is shared; the first round's figures are in the details too), and the split into
  hash / match / choose as well.

Part ``e2e``: real processes (``dynamo-prep frontend`` and 4 mock workers, 2 SGLang- and 2
vLLM-flavored, ``--kv-events --kv-blocks N --prefill-ms-per-1k M --token-delay D``), fresh for each
mode, ``--router-mode round-robin`` then ``kv``, the same seeded workload:

* ``--systems`` system prompts (1-2k tokens) x ``--users`` conversations of 3-8 turns; a turn sends
  the system prompt, the previous turns with the answers actually streamed, and a new question
  (20-150 tokens, a quarter of them after 300-900 pasted tokens); a tenth of the turns attach an
  image (an http URL of its own, which the workers fetch from a server on loopback) that stays in
  the conversation. The mock answers from a
  ``--replies`` file (80-320 tokens after a short reasoning, in K3's output format, picked by a
  ``(ref N)`` tag in the question), so conversations grow as real ones do, not by a one-line echo.
* ``--concurrency`` clients stream (httpx, SSE), each taking turns in ``WINDOW`` conversations in
  rotation: the other conversations' turns are a conversation's think time.
* Per mode: TTFT (to the first chunk carrying content or reasoning) p50/p90/p99, the prefix hit
  rate (the workers' cached over prompt token counters), requests/s; for kv the frontend's own
  decision time (its histogram). Targets: kv TTFT p50 <= 0.5x round robin's, hit rate >= 2x. To
  read the ratios, also: what a perfect router would reach (each prompt's longest earlier prefix
  cached), the system prefixes' share (every worker holds them, whatever the router), and how often
  a follow-up went back to the instance of the conversation's previous turn. The TTFT
  distributions are drawn to ``results/routing_ttft.png`` (matplotlib, on its Agg canvas).

Every part records into the one ``routing`` suite, so ``results/routing.json`` holds the parts of
the last run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from benchmarks._images import LOOPBACK_MEDIA, image_server
from benchmarks._plane import (
    DEMO_MODEL,
    FileProcess,
    cpu_seconds,
    percentile,
    reap,
    scrape_metrics,
    summary,
    tcp_endpoint,
    wait_for,
)
from benchmarks._report import RESULTS_DIR, Record, Suite
from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.engines.mock.kv_cache import HashKind, PagedPrefixCache
from dynamo_prep.formatter import KimiK3Formatter
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.kv_events import BlockStored, KVEvent, KVEventBatch, decode_batch, encode_batch
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.routing.policy import KvRouter, choose, count_blocks
from dynamo_prep.tokenizer import Tokenizer

BLOCK_SIZE = 16
VOCAB = 150_000
PREAMBLES = 16
PREAMBLE_TOKENS = (512, 2048)
PROMPT_TOKENS = (2048, 8192)
ANSWER_TOKENS = (50, 400)
QUESTION_TOKENS = (30, 300)
PREFILL_CHUNK_BLOCKS = 2048 // BLOCK_SIZE  # vLLM's default max_num_batched_tokens, in blocks
EVENTS_PER_BATCH = 4
DECISION_TARGET_US = 100.0
INGEST_TARGET = 200_000.0


def tokens(rng: random.Random, count: int) -> list[int]:
    return rng.choices(range(VOCAB), k=count)


@dataclass
class Fleet:
    """The mock engines' published history, and the conversations each one served."""

    batches: dict[str, list[list[KVEvent]]] = field(default_factory=dict)
    conversations: dict[str, list[list[int]]] = field(default_factory=dict)
    preambles: list[list[int]] = field(default_factory=list)

    def blocks(self) -> int:
        return sum(
            len(event.block_hashes)
            for batches in self.batches.values()
            for batch in batches
            for event in batch
            if isinstance(event, BlockStored)
        )


def chunked(events: list[KVEvent]) -> Iterator[KVEvent]:
    """Events as vLLM publishes them: a long store split into prefill chunks, chained."""
    for event in events:
        if not isinstance(event, BlockStored) or len(event.block_hashes) <= PREFILL_CHUNK_BLOCKS:
            yield event
            continue
        parent = event.parent_block_hash
        for start in range(0, len(event.block_hashes), PREFILL_CHUNK_BLOCKS):
            hashes = event.block_hashes[start : start + PREFILL_CHUNK_BLOCKS]
            keys = event.extra_keys[start : start + PREFILL_CHUNK_BLOCKS] if event.extra_keys else None
            yield BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=event.token_ids[start * BLOCK_SIZE : (start + len(hashes)) * BLOCK_SIZE],
                block_size=BLOCK_SIZE,
                medium=event.medium,
                extra_keys=keys,
            )
            parent = hashes[-1]


def build_fleet(instances: int, blocks: int, seed: int) -> Fleet:
    rng = random.Random(seed)
    fleet = Fleet(preambles=[tokens(rng, rng.randint(*PREAMBLE_TOKENS)) for _ in range(PREAMBLES)])
    for number in range(instances):
        name = f"instance-{number}"
        kind: HashKind = "int" if number % 2 else "bytes"
        cache = PagedPrefixCache(BLOCK_SIZE, blocks, hash_kind=kind, seed=name.encode())
        history: list[KVEvent] = []
        served: list[list[int]] = []
        step = 0
        while len(cache) < blocks:
            if served and rng.random() < 0.4:  # a follow-up turn of a conversation it served
                previous = served.pop(rng.randrange(len(served)))
                prompt = previous + tokens(rng, rng.randint(*QUESTION_TOKENS))
            else:
                preamble = rng.choice(fleet.preambles)
                prompt = preamble + tokens(rng, rng.randint(*PROMPT_TOKENS) - len(preamble))
            cache.admit(str(step), prompt)
            answer = tokens(rng, rng.randint(*ANSWER_TOKENS))
            cache.release(str(step), answer)
            served.append(prompt + answer)
            history.extend(chunked(cache.take_events()))
            step += 1
        fleet.batches[name] = [
            history[start : start + EVENTS_PER_BATCH] for start in range(0, len(history), EVENTS_PER_BATCH)
        ]
        fleet.conversations[name] = served
    return fleet


def ingest(fleet: Fleet, *, encoded: bool) -> tuple[float, KvIndex]:
    """Seconds to apply every instance's history to a fresh index (instances interleaved)."""
    index = KvIndex(BLOCK_SIZE)
    names = list(fleet.batches)
    rounds = max(len(batches) for batches in fleet.batches.values())
    if encoded:
        payloads = {
            name: [
                encode_batch(KVEventBatch(ts=float(n), events=batch), shape="map" if n % 2 else "array")
                for n, batch in enumerate(batches)
            ]
            for name, batches in fleet.batches.items()
        }
        started = time.perf_counter()
        for n in range(rounds):
            for name in names:
                if n < len(payloads[name]):
                    index.apply(name, decode_batch(payloads[name][n]).batch.events)
        return time.perf_counter() - started, index
    started = time.perf_counter()
    for n in range(rounds):
        for name in names:
            if n < len(fleet.batches[name]):
                index.apply(name, fleet.batches[name][n])
    return time.perf_counter() - started, index


def requests(fleet: Fleet, count: int, seed: int) -> list[array[int]]:
    """Follow-ups (40%), new conversations on a shared preamble (40%), unseen prompts (20%).

    Kept compact; each is turned into a fresh list of fresh ints right before its decision, as the
    tokenizer hands them over (hot in the CPU cache, not scattered over a heap of old prompts).
    """
    rng = random.Random(seed)
    served = [
        conversation for conversations in fleet.conversations.values() for conversation in conversations
    ]
    out: list[array[int]] = []
    while len(out) < count:
        kind = rng.random()
        if kind < 0.4:
            base = rng.choice(served)[: PROMPT_TOKENS[1] - QUESTION_TOKENS[1]]
            prompt = base + tokens(rng, rng.randint(*QUESTION_TOKENS))
        elif kind < 0.8:
            preamble = rng.choice(fleet.preambles)
            prompt = preamble + tokens(rng, rng.randint(*PROMPT_TOKENS) - len(preamble))
        else:
            prompt = tokens(rng, rng.randint(*PROMPT_TOKENS))
        if len(prompt) >= PROMPT_TOKENS[0]:
            out.append(array("l", prompt[: PROMPT_TOKENS[1]]))
    return out


@dataclass
class Timings:
    """Microseconds per prompt and stage: the best of the rounds (``best``) and the first round
    (``first``). The box is shared: the best of a few rounds is the code's cost without the
    neighbours' interference; the first round shows what that interference adds."""

    best: dict[str, list[float]]
    first: dict[str, list[float]]
    reasons: dict[str, int]


STAGES = ("decide", "hash", "match", "choose")


def timed_decisions(
    router: KvRouter, candidates: list[str], prompts: list[array[int]], rounds: int
) -> Timings:
    """``KvRouter.decide`` per prompt, then the same decision again stage by stage."""
    clock = time.perf_counter_ns
    index = router.index
    best = {stage: [float("inf")] * len(prompts) for stage in STAGES}
    first: dict[str, list[float]] = {stage: [] for stage in STAGES}
    reasons: dict[str, int] = {}
    for round_index in range(rounds):
        for number, stored in enumerate(prompts):
            prompt = stored.tolist()
            t0 = clock()
            decision = router.decide(candidates, prompt)
            t1 = clock()
            hashes = request_block_hashes(prompt, BLOCK_SIZE)
            t2 = clock()
            overlaps = index.match(hashes)
            t3 = clock()
            blocks = count_blocks(len(prompt), BLOCK_SIZE)
            choose(candidates, overlaps, blocks, router.load.active(), index.held())
            t4 = clock()
            for stage, elapsed in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                best[stage][number] = min(best[stage][number], elapsed / 1000)
                if not round_index:
                    first[stage].append(elapsed / 1000)
            if not round_index:
                reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
    return Timings(best, first, reasons)


def best_ingest(fleet: Fleet, *, encoded: bool, runs: int) -> tuple[float, KvIndex]:
    """The fastest of ``runs`` full ingestions (seconds), and the index it built."""
    results = [ingest(fleet, encoded=encoded) for _ in range(runs)]
    return min(seconds for seconds, _ in results), results[-1][1]


def bench_micro(suite: Suite, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    fleet = build_fleet(args.instances, args.blocks, args.seed)
    blocks = fleet.blocks()
    print(
        f"fleet: {args.instances} x {args.blocks} blocks in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    typed_s, index = best_ingest(fleet, encoded=False, runs=args.rounds)
    wire_s, wire_index = best_ingest(fleet, encoded=True, runs=args.rounds)
    assert len(wire_index) == len(index) and wire_index.counters == index.counters
    assert index.counters.unknown_parent_blocks == 0 and index.counters.invalid_events == 0
    typed_rate, wire_rate = blocks / typed_s, blocks / wire_s
    stored_events = sum(
        isinstance(event, BlockStored)
        for batches in fleet.batches.values()
        for batch in batches
        for event in batch
    )
    suite.details["fleet"] = {
        "instances": args.instances,
        "blocks_per_instance": args.blocks,
        "stored_blocks": blocks,
        "stored_events": stored_events,
        "removed_blocks": index.counters.removed_blocks,
        "distinct_blocks_in_index": len(index),
        "held": {name: index.blocks_held(name) for name in index.instances()},
    }
    runs = f"best of {args.rounds} runs"
    suite.record(
        "Ingestion, decode_batch + apply",
        wire_rate,
        "blocks/s",
        target=f">= {INGEST_TARGET:.0f} blocks/s",
        met=wire_rate >= INGEST_TARGET,
        note=f"{blocks} blocks in {stored_events} BlockStored events, both shapes, int and bytes hashes; "
        + runs,
    )
    suite.record(
        "Ingestion, apply (typed events)",
        typed_rate,
        "blocks/s",
        target=f">= {INGEST_TARGET:.0f} blocks/s",
        met=typed_rate >= INGEST_TARGET,
        note=f"the index alone: own hashes, per-instance maps, holder masks; {runs}",
    )

    router = KvRouter(index, seed=args.seed)
    candidates = sorted(index.instances())
    rng = random.Random(args.seed)
    for name in candidates:  # some load, so the cost has both terms
        router.load.dispatch(f"busy-{name}", name, rng.randrange(0, 2000))
    timed_decisions(router, candidates, requests(fleet, 200, args.seed + 1), 1)  # warm-up
    prompts = requests(fleet, args.decisions, args.seed + 2)
    timings = timed_decisions(router, candidates, prompts, args.rounds)
    best = {stage: summary(values) for stage, values in timings.best.items()}
    long_prompts = [
        t for t, prompt in zip(timings.best["decide"], prompts, strict=True) if len(prompt) > 7 * 1024
    ]
    suite.details["decision_us_best_of_rounds"] = best
    suite.details["decision_us_first_round"] = {
        stage: summary(values) for stage, values in timings.first.items()
    }
    suite.details["decision_us_prompts_over_7k_tokens"] = summary(long_prompts)
    suite.details["decision_reasons"] = timings.reasons
    suite.details["prompt_tokens"] = summary([float(len(prompt)) for prompt in prompts])
    decide, first = best["decide"], summary(timings.first["decide"])
    suite.record(
        "Decision p99 (hash + match + choose)",
        decide["p99"],
        "us",
        target=f"<= {DECISION_TARGET_US:.0f} us",
        met=decide["p99"] <= DECISION_TARGET_US,
        note=f"{args.instances} instances x {args.blocks} blocks, {len(prompts)} prompts of 2-8k tokens, "
        f"best of {args.rounds} rounds per prompt (one round: p99 {first['p99']:.0f} us); "
        f"p99 of hash {best['hash']['p99']:.0f}, match {best['match']['p99']:.0f}, "
        f"choose {best['choose']['p99']:.0f} us",
    )
    suite.record("Decision p50", decide["p50"], "us", note=f"one round: p50 {first['p50']:.0f} us")


# ----------------------------------------------------------------------------- part e2e

MODES = ("round-robin", "kv")
WORKER_FLAVORS = ("sglang", "vllm", "sglang", "vllm")
SYSTEM_TOKENS = (1000, 2000)
CHAT_QUESTION_TOKENS = (20, 150)
PASTE_TOKENS = (300, 900)
PASTE_SHARE = 0.25
IMAGE_SHARE = 0.1
TURNS = (3, 8)
REPLIES = 24
REPLY_TOKENS = (80, 320)
REASONING_TOKENS = (10, 40)
WINDOW = 3  # conversations a client takes turns in at once
MAX_TOKENS = 512  # the longest answer is under 400 tokens; prompts stay under 8192 - 512
WARMUP_REQUESTS = 8
CHAT_TIMEOUT_S = 60.0
TTFT_RATIO_TARGET = 0.5
HIT_RATIO_TARGET = 2.0
CHART_FILE = RESULTS_DIR / "routing_ttft.png"
COLORS = {"round-robin": "tab:orange", "kv": "tab:blue"}


class Prose:
    """Seeded sentences of the demo vocabulary's words, measured in the demo tokenizer's tokens."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.words = _vocabulary_words(tokenizer)

    def sentence(self) -> str:
        words = self.rng.choices(self.words, k=self.rng.randint(5, 16))
        if self.rng.random() < 0.2:
            words.insert(self.rng.randrange(len(words)), str(self.rng.randint(2, 99_999)))
        return " ".join(words).capitalize() + self.rng.choice(".....?!:")

    def text(self, tokens: int) -> str:
        """Paragraphs of sentences, about ``tokens`` tokens (a little more: whole sentences)."""
        paragraphs: list[list[str]] = [[]]
        count = 0
        while count < tokens:
            sentence = self.sentence()
            count += len(self.tokenizer.encode(" " + sentence))
            if len(paragraphs[-1]) >= self.rng.randint(3, 7):
                paragraphs.append([])
            paragraphs[-1].append(sentence)
        return "\n\n".join(" ".join(paragraph) for paragraph in paragraphs)


def _vocabulary_words(tokenizer: Tokenizer) -> list[str]:
    """The base vocabulary's whole lowercase words (a leading space, three letters or more)."""
    words = []
    for token_id in range(tokenizer.n_vocab):
        with contextlib.suppress(KeyError, UnicodeDecodeError):
            piece = tokenizer.encoding.decode_single_token_bytes(token_id).decode()
            word = piece[1:]
            if (
                piece.startswith(" ")
                and len(word) >= 3
                and word.isascii()
                and word.isalpha()
                and word.islower()
            ):
                words.append(word)
    return words


@dataclass(frozen=True)
class Turn:
    text: str
    image: str | None  # the URL of an image attached to this turn


@dataclass(frozen=True)
class Conversation:
    system: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    """System prompts, scripted answers (token ids, chosen by ``(ref N)``), conversations, and the
    order in which each client takes their turns: ``lanes[client] = ((conversation, turn), ...)``."""

    systems: tuple[str, ...]
    replies: tuple[list[int], ...]
    conversations: tuple[Conversation, ...]
    lanes: tuple[tuple[tuple[int, int], ...], ...]

    def requests(self) -> int:
        return sum(len(conversation.turns) for conversation in self.conversations)


def build_workload(args: argparse.Namespace, tokenizer: Tokenizer, images: str) -> Workload:
    """The seeded conversations; their images are URLs under ``images`` (a server's base URL)."""
    rng = random.Random(args.seed)
    prose = Prose(tokenizer, rng)
    systems = tuple(
        f"You are the assistant of team {number}. Follow the rules and use the reference below.\n\n"
        + prose.text(rng.randint(*SYSTEM_TOKENS))
        for number in range(args.systems)
    )
    replies = tuple(
        reply_ids(
            tokenizer, prose.text(rng.randint(*REASONING_TOKENS)), prose.text(rng.randint(*REPLY_TOKENS))
        )
        for _ in range(REPLIES)
    )
    conversations = tuple(
        Conversation(
            system=rng.randrange(args.systems),
            turns=tuple(
                Turn(question(prose, rng.randrange(REPLIES)), _image(rng, images, number, turn))
                for turn in range(rng.randint(*TURNS))
            ),
        )
        for number in range(args.users)
    )
    lanes = schedule([len(conversation.turns) for conversation in conversations], args.concurrency, rng)
    return Workload(systems, replies, conversations, lanes)


def question(prose: Prose, reply: int) -> str:
    """A new question (sometimes after pasted material), tagged with the scripted answer it gets."""
    ask = prose.text(prose.rng.randint(*CHAT_QUESTION_TOKENS))
    if prose.rng.random() < PASTE_SHARE:
        ask = f"Here is what I have so far:\n\n{prose.text(prose.rng.randint(*PASTE_TOKENS))}\n\n{ask}"
    return f"{ask} (ref {reply})"


def _image(rng: random.Random, images: str, conversation: int, turn: int) -> str | None:
    return f"{images}/c{conversation}-t{turn}.png" if rng.random() < IMAGE_SHARE else None


def reply_ids(tokenizer: Tokenizer, reasoning: str, content: str) -> list[int]:
    """An answer in K3's output format: the assistant turn the formatter renders, minus the
    generation prompt the request already ends with (so it parses into reasoning and content)."""
    formatter = KimiK3Formatter()
    user = [{"role": "user", "content": "?"}]
    answer = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    prompt = tokenizer.encode_segments(formatter.render_segments(user, thinking_effort=None))
    whole = tokenizer.encode_segments(
        formatter.render_segments([*user, answer], add_generation_prompt=False, thinking_effort=None)
    )
    if whole[: len(prompt)] != prompt:
        raise RuntimeError("the K3 answer does not continue its generation prompt")
    return whole[len(prompt) :]


def schedule(turns: list[int], clients: int, rng: random.Random) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each client's conversations (dealt after a seeded shuffle), ``WINDOW`` at a time, one turn each
    in rotation; a finished conversation's place goes to the client's next one."""
    order = list(range(len(turns)))
    rng.shuffle(order)
    lanes = []
    for client in range(clients):
        waiting, active = deque(order[client::clients]), deque[int]()
        taken: dict[int, int] = {}
        steps: list[tuple[int, int]] = []
        while waiting or active:
            while waiting and len(active) < WINDOW:
                active.append(waiting.popleft())
            conversation = active.popleft()
            steps.append((conversation, taken.get(conversation, 0)))
            taken[conversation] = taken.get(conversation, 0) + 1
            if taken[conversation] < turns[conversation]:
                active.append(conversation)
        lanes.append(tuple(steps))
    return tuple(lanes)


def write_replies(workload: Workload, path: Path) -> None:
    """The mock workers' ``--replies`` file: answer N streams when ``(ref N)`` is in the question."""
    lines = (json.dumps({"when": f"(ref {n})", "token_ids": ids}) for n, ids in enumerate(workload.replies))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def user_message(turn: Turn) -> dict[str, Any]:
    if turn.image is None:
        return {"role": "user", "content": turn.text}
    parts = [{"type": "image_url", "image_url": {"url": turn.image}}, {"type": "text", "text": turn.text}]
    return {"role": "user", "content": parts}


# -- the client


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_chunks = msgspec.json.Decoder(_Chunk)


@dataclass
class Sample:
    """One request as the client saw it."""

    conversation: int
    turn: int
    image: bool  # an image is in the prompt (attached to this turn or an earlier one)
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    prompt_tokens: int = 0
    request_id: str = ""
    error: str = ""


async def stream_chat(http: httpx.AsyncClient, body: dict[str, Any], sample: Sample) -> str:
    """Stream one chat completion into ``sample``; returns the answer's content. Raises on failure."""
    started = time.perf_counter()
    content: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        sample.request_id = response.headers.get("x-request-id", "")
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                sample.total_ms = (time.perf_counter() - started) * 1000
                return "".join(content)
            chunk = _chunks.decode(line[6:])
            if chunk.error is not None:
                raise RuntimeError(f"stream error: {chunk.error}")
            for choice in chunk.choices:
                if not sample.ttft_ms and (choice.delta.content or choice.delta.reasoning_content):
                    sample.ttft_ms = (time.perf_counter() - started) * 1000
                if choice.delta.content:
                    content.append(choice.delta.content)
            if chunk.usage is not None:
                sample.prompt_tokens = chunk.usage.prompt_tokens
    raise RuntimeError("the stream ended without [DONE]")


def chat_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": DEMO_MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def converse(
    http: httpx.AsyncClient, workload: Workload, lane: Sequence[tuple[int, int]], samples: list[Sample]
) -> None:
    """One client: its turns in order, each conversation continued with the answer it got."""
    histories: dict[int, list[dict[str, Any]]] = {}
    for number, index in lane:
        conversation = workload.conversations[number]
        history = histories.setdefault(number, [])
        history.append(user_message(conversation.turns[index]))
        images = any(turn.image for turn in conversation.turns[: index + 1])
        sample = Sample(number, index, images)
        system = {"role": "system", "content": workload.systems[conversation.system]}
        try:
            answer = await stream_chat(http, chat_body([system, *history]), sample)
        except (httpx.HTTPError, RuntimeError, msgspec.DecodeError) as exc:  # counted, the run goes on
            sample.error = f"{type(exc).__name__}: {exc}"[:300]
            answer = "(no answer)"
        history.append({"role": "assistant", "content": answer})
        samples.append(sample)


async def drive(port: int, workload: Workload, concurrency: int) -> tuple[list[Sample], float]:
    """Every client's turns, concurrently: the samples and the wall time in seconds."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    samples: list[Sample] = []
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=CHAT_TIMEOUT_S
    ) as http:
        began = time.perf_counter()
        await asyncio.gather(*(converse(http, workload, lane, samples) for lane in workload.lanes))
        return samples, time.perf_counter() - began


async def warm_up(port: int, images: str) -> None:
    """A few short requests with an image, unrelated to the workload: connections opened, and the
    preprocessor of each declaration built (the kv router renders an image prompt for every one)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=CHAT_TIMEOUT_S) as http:
        for number in range(WARMUP_REQUESTS):
            text = {"type": "text", "text": f"Warm-up request {number}. (ref 0)"}
            image = {"type": "image_url", "image_url": {"url": f"{images}/warm-up.png"}}
            messages = [{"role": "user", "content": [image, text]}]
            await stream_chat(http, chat_body(messages), Sample(-1, number, False))


# -- the processes


@dataclass
class Cluster:
    frontend: FileProcess
    workers: list[FileProcess]
    http_port: int
    metrics_ports: list[int]


@contextlib.contextmanager
def cluster(mode: str, args: argparse.Namespace, workdir: Path, replies: Path) -> Iterator[Cluster]:
    """A frontend routing by ``mode`` and the mock workers, every instance live (and, for kv, its
    events followed from seq 0); all stopped and reaped on the way out."""
    address = tcp_endpoint()
    procs: list[FileProcess] = []
    try:
        frontend = FileProcess(
            ["--log-level", "info", "frontend", "--discovery-bind", address,
             "--http-host", "127.0.0.1", "--http-port", "0", "--model-path", DEMO_MODEL,
             "--cache-dir", str(workdir / "cache"), "--router-mode", mode, *args.frontend_args],
            workdir / f"{mode}-frontend.log",
        )  # fmt: skip
        procs.append(frontend)
        port = frontend.wait_event("frontend_started")["http_port"]
        workers = []
        for number, flavor in enumerate(WORKER_FLAVORS):
            worker = FileProcess(
                ["--log-level", "debug" if args.log_dir else "info", "worker", "--model-path", DEMO_MODEL,
                 "--discovery", address,
                 "--flavor", flavor, "--kv-events", "--kv-blocks", str(args.kv_blocks),
                 "--prefill-ms-per-1k", str(args.prefill_ms_per_1k), "--token-delay", str(args.token_delay),
                 "--replies", str(replies), "--metrics-port", "0", *LOOPBACK_MEDIA],
                workdir / f"{mode}-worker{number}-{flavor}.log",
            )  # fmt: skip
            procs.append(worker)
            workers.append(worker)
        metrics_ports = [worker.wait_event("worker_metrics_started")["port"] for worker in workers]

        def live() -> bool:
            added = max((line.get("instances", 0) for line in frontend.find("instance_added")), default=0)
            followed = len(frontend.find("kv_replay_finished")) if mode == "kv" else len(workers)
            return added >= len(workers) and followed >= len(workers)

        wait_for(live, 60, interval=0.1, message=f"{len(workers)} instances live at the {mode} frontend")
        yield Cluster(frontend, workers, port, metrics_ports)
    finally:
        reap(procs)


# -- one mode, measured


@dataclass
class ModeRun:
    mode: str
    samples: list[Sample]
    wall_s: float
    workers: list[dict[str, Any]]  # per worker: flavor, prompt and cached tokens, blocks held
    frontend: dict[str, float]  # the frontend's KV metrics over the run (deltas)
    routed: dict[str, dict[str, Any]]  # request_id -> its request_finished line
    cpu_s: dict[str, float]  # CPU seconds of each process over the run (frontend, workers, client)

    def ok(self) -> list[Sample]:
        return [sample for sample in self.samples if not sample.error]

    def hit_rate(self) -> float:
        prompt = sum(worker["prompt_tokens"] for worker in self.workers)
        return sum(worker["cached_tokens"] for worker in self.workers) / max(prompt, 1)


WORKER_PROMPT = "dynamo_worker_prompt_tokens_total"
WORKER_CACHED = "dynamo_worker_kv_cached_tokens_total"
WORKER_BLOCKS = "dynamo_worker_kv_blocks"
DECISION_SECONDS = "dynamo_frontend_kv_decision_seconds"


def run_mode(
    mode: str, workload: Workload, args: argparse.Namespace, workdir: Path, replies: Path, *, images: str
) -> ModeRun:
    with cluster(mode, args, workdir, replies) as plane:
        asyncio.run(warm_up(plane.http_port, images))
        before = [scrape_metrics(port) for port in plane.metrics_ports]
        front_before = scrape_metrics(plane.http_port)
        pids = {"frontend": plane.frontend.pid, "client": os.getpid()}
        pids.update((f"worker{n}", worker.pid) for n, worker in enumerate(plane.workers))
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        samples, wall = asyncio.run(drive(plane.http_port, workload, args.concurrency))
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
        after = [scrape_metrics(port) for port in plane.metrics_ports]
        front_after = scrape_metrics(plane.http_port)
        routed = {line["request_id"]: line for line in plane.frontend.find("request_finished")}
    workers = [
        {
            "flavor": flavor,
            "prompt_tokens": end.get(WORKER_PROMPT, 0.0) - start.get(WORKER_PROMPT, 0.0),
            "cached_tokens": end.get(WORKER_CACHED, 0.0) - start.get(WORKER_CACHED, 0.0),
            "blocks_held": end.get(WORKER_BLOCKS, 0.0),
        }
        for flavor, start, end in zip(WORKER_FLAVORS, before, after, strict=True)
    ]
    frontend = {
        name: value - front_before.get(name, 0.0)
        for name, value in front_after.items()
        if name.startswith("dynamo_frontend_kv_decision")
    }
    return ModeRun(mode, samples, wall, workers, frontend, routed, cpu)


# -- the report


def decision_time(frontend: dict[str, float]) -> dict[str, Any]:
    """Mean and the p99's histogram bucket (an upper bound) of the frontend's decision time, in us."""
    count = frontend.get(f"{DECISION_SECONDS}_count", 0.0)
    if not count:
        return {"count": 0}
    buckets = sorted(
        (float(name.split("le=")[1].rstrip("}")), value)
        for name, value in frontend.items()
        if name.startswith(f"{DECISION_SECONDS}_bucket")
    )
    p99 = next((bound for bound, cumulative in buckets if cumulative >= 0.99 * count), float("inf"))
    reasons = {
        name.split("reason=")[1].rstrip("}"): int(value)
        for name, value in frontend.items()
        if name.startswith("dynamo_frontend_kv_decisions_total{")
    }
    return {
        "count": int(count),
        "mean_us": 1e6 * frontend.get(f"{DECISION_SECONDS}_sum", 0.0) / count,
        "p99_bucket_us": 1e6 * p99,
        "reasons": reasons,
    }


def shared_prefixes(workload: Workload, card: ModelDeploymentCard) -> list[int]:
    """Per system prompt, the prompt tokens every conversation on it shares (the K3 preamble and
    the system message), in whole blocks."""
    preprocessor = OpenAIPreprocessor.new(card, resolve_model_dir(DEMO_MODEL))
    block = card.kv_cache_block_size
    shared = []
    for system in workload.systems:
        one, two = (
            preprocessor.preprocess(
                {"model": DEMO_MODEL, "messages": [{"role": "system", "content": system}, user]}
            ).token_ids
            for user in ({"role": "user", "content": "a"}, {"role": "user", "content": "b"})
        )
        common = next((n for n, (x, y) in enumerate(zip(one, two, strict=False)) if x != y), len(one))
        shared.append(common // block * block)
    return shared


def best_cached(samples: list[Sample], workload: Workload, shared: list[int], block: int) -> list[int]:
    """Per sample, the prompt tokens a perfect router would find cached: the longest prefix seen
    before, i.e. the previous turn's whole prompt (a prefix of the next one), else the shared
    system prefix; in whole blocks."""
    previous = {(sample.conversation, sample.turn): sample.prompt_tokens for sample in samples}
    return [
        max(
            previous.get((sample.conversation, sample.turn - 1), 0) // block * block,
            shared[workload.conversations[sample.conversation].system],
        )
        for sample in samples
    ]


def live_blocks(samples: list[Sample], workload: Workload, shared: list[int], block: int) -> int:
    """The most blocks the conversations in progress need at once (each one's latest prompt beyond
    its system prefix, plus every system prefix), stepping the clients' schedules side by side."""
    tokens = {(sample.conversation, sample.turn): sample.prompt_tokens for sample in samples}
    latest: dict[int, int] = {}
    peak = 0
    for step in range(max(len(lane) for lane in workload.lanes)):
        for lane in workload.lanes:
            if step < len(lane):
                conversation, turn = lane[step]
                system = shared[workload.conversations[conversation].system]
                latest[conversation] = max(tokens.get((conversation, turn), 0) - system, 0) // block
        peak = max(peak, sum(latest.values()))
        for lane in workload.lanes:  # a conversation whose last turn just ran is over
            if step < len(lane) and lane[step][1] == len(workload.conversations[lane[step][0]].turns) - 1:
                latest.pop(lane[step][0], None)
    return peak + sum(shared) // block


def by_turn(samples: list[Sample]) -> dict[int, dict[str, float]]:
    turns: dict[int, list[float]] = {}
    for sample in samples:
        turns.setdefault(sample.turn + 1, []).append(sample.ttft_ms)
    return {turn: summary(values) for turn, values in sorted(turns.items())}


def routing_stats(run: ModeRun) -> dict[str, Any]:
    """Where the requests went (the frontend's ``request_finished`` lines): requests per instance,
    the share of follow-up turns sent to the instance that served the conversation's previous
    turn, and the decisions' overlap ratio (blocks cached on the chosen instance / prompt blocks;
    kv mode only) for prompts with and without an image."""
    ratios: dict[str, list[float]] = {"with_image": [], "without_image": []}
    instances: dict[str, int] = {}
    served: dict[tuple[int, int], str] = {}
    for sample in run.ok():
        line = run.routed.get(sample.request_id)
        if line is None:
            continue
        instance = str(line.get("instance_id"))
        instances[instance] = instances.get(instance, 0) + 1
        served[sample.conversation, sample.turn] = instance
        if line.get("prompt_blocks") and line.get("kv_overlap_blocks") is not None:
            key = "with_image" if sample.image else "without_image"
            ratios[key].append(line["kv_overlap_blocks"] / line["prompt_blocks"])
    follow_ups = [
        instance == served[conversation, turn - 1]
        for (conversation, turn), instance in served.items()
        if (conversation, turn - 1) in served
    ]
    return {
        "requests_per_instance": sorted(instances.values(), reverse=True),
        "follow_ups_on_previous_instance": sum(follow_ups) / max(len(follow_ups), 1),
        "overlap_ratio": {key: summary(values) for key, values in ratios.items()},
    }


def plot_ttft(runs: dict[str, ModeRun], path: Path, title: str) -> None:
    """CDFs (log time axis) and histograms of both modes' TTFT, side by side, drawn on an Agg canvas
    (no display, no pyplot state)."""
    values = {mode: sorted(sample.ttft_ms for sample in run.ok()) for mode, run in runs.items()}
    low = max(1.0, min(v[0] for v in values.values()))
    high = max(v[-1] for v in values.values())
    bins = [low * (high / low) ** (n / 40) for n in range(41)]
    figure = Figure(figsize=(12, 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    cdf, histogram = figure.subplots(1, 2)
    for mode, ordered in values.items():
        p50 = percentile(ordered, 50)
        label = f"{mode}: p50 {p50:.0f} ms, p99 {percentile(ordered, 99):.0f} ms"
        fractions = [(n + 1) / len(ordered) for n in range(len(ordered))]
        cdf.step(ordered, fractions, where="post", color=COLORS[mode], label=label)
        cdf.axvline(p50, color=COLORS[mode], linestyle=":", linewidth=1)
        histogram.hist(ordered, bins=bins, histtype="step", linewidth=1.8, color=COLORS[mode], label=mode)
    for axes in (cdf, histogram):
        axes.set_xscale("log")
        axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.set_xlabel("time to first token (ms, log scale)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(loc="upper left" if axes is cdf else "upper right")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("CDF")
    histogram.set_ylabel("requests")
    histogram.set_title("distribution")
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=100)


def mode_details(
    run: ModeRun, workload: Workload, shared: list[int], block: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One mode's figures for the JSON details (the records quote them)."""
    ok = run.ok()
    prompt_tokens = sum(sample.prompt_tokens for sample in ok)
    system_tokens = sum(shared[workload.conversations[sample.conversation].system] for sample in ok)
    best = best_cached(ok, workload, shared, block)
    details = {
        "ttft_ms": summary([sample.ttft_ms for sample in ok]),
        "total_ms": summary([sample.total_ms for sample in ok]),
        "ttft_ms_p50_by_turn": {turn: dist.get("p50", 0.0) for turn, dist in by_turn(ok).items()},
        "hit_rate": run.hit_rate(),
        "requests": len(run.samples),
        "failures": len(run.samples) - len(ok),
        "errors": sorted({sample.error for sample in run.samples if sample.error})[:5],
        "requests_per_s": len(ok) / run.wall_s,
        "wall_s": run.wall_s,
        "prompt_tokens": summary([float(sample.prompt_tokens) for sample in ok]),
        "shared_system_prefix_share": system_tokens / max(prompt_tokens, 1),
        "best_hit_rate": sum(best) / max(prompt_tokens, 1),
        "best_prefill_ms": summary(
            [
                (sample.prompt_tokens - cached) * args.prefill_ms_per_1k / 1000
                for sample, cached in zip(ok, best, strict=True)
            ]
        ),
        "live_set_blocks": live_blocks(ok, workload, shared, block),
        "workers": run.workers,
        "routing": routing_stats(run),
        "cpu_s": run.cpu_s,
        "cores_busy": sum(run.cpu_s.values()) / run.wall_s,
    }
    if run.mode == "kv":
        details["decision"] = decision_time(run.frontend)
    return details


def record_e2e(suite: Suite, details: dict[str, Any], args: argparse.Namespace) -> None:
    for mode in MODES:
        figures = details[mode]
        ttft = figures["ttft_ms"]
        suite.record(
            f"e2e {mode}: TTFT p50",
            ttft["p50"],
            "ms",
            note=f"p90 {ttft['p90']:.0f} ms, p99 {ttft['p99']:.0f} ms; {ttft['n']} requests, "
            f"{figures['failures']} failed; {figures['requests_per_s']:.1f} req/s",
        )
        suite.record(
            f"e2e {mode}: prefix hit rate",
            100 * figures["hit_rate"],
            "%",
            note="cached / prompt tokens (workers' counters); the system prefixes, on every worker, are "
            f"{100 * figures['shared_system_prefix_share']:.0f}% of prompt tokens; follow-ups sent to the "
            f"previous turn's instance: {100 * figures['routing']['follow_ups_on_previous_instance']:.0f}%",
        )
    base, kv = details["round-robin"], details["kv"]
    ttft_ratio = kv["ttft_ms"]["p50"] / base["ttft_ms"]["p50"]
    suite.record(
        "e2e TTFT p50, kv / round robin",
        ttft_ratio,
        "x",
        target=f"<= {TTFT_RATIO_TARGET}x",
        met=ttft_ratio <= TTFT_RATIO_TARGET,
        note=f"p99 {kv['ttft_ms']['p99'] / base['ttft_ms']['p99']:.2f}x; a perfect router still prefills "
        f"each turn's new tokens: p50 {kv['best_prefill_ms']['p50']:.0f} ms; "
        f"chart: [{CHART_FILE.name}]({CHART_FILE.name})",
    )
    hit_ratio = kv["hit_rate"] / max(base["hit_rate"], 1e-9)
    suite.record(
        "e2e prefix hit rate, kv / round robin",
        hit_ratio,
        "x",
        target=f">= {HIT_RATIO_TARGET:g}x",
        met=hit_ratio >= HIT_RATIO_TARGET,
        note=f"{100 * kv['hit_rate']:.0f}% vs {100 * base['hit_rate']:.0f}%; a perfect router (every "
        f"prompt's longest earlier prefix cached) reaches {100 * kv['best_hit_rate']:.0f}%: at most "
        f"{kv['best_hit_rate'] / max(base['hit_rate'], 1e-9):.2f}x",
    )
    decision = kv["decision"]
    if decision["count"]:
        suite.record(
            "e2e kv: decision time in the frontend, mean",
            decision["mean_us"],
            "us",
            note=f"p99 <= {decision['p99_bucket_us']:.0f} us (histogram bucket); {decision['count']} "
            f"decisions ({', '.join(f'{k} {v}' for k, v in sorted(decision['reasons'].items()))})",
        )
    suite.record(
        "e2e live set",
        kv["live_set_blocks"],
        "blocks",
        note=f"peak need of the conversations in progress; each worker holds {args.kv_blocks} blocks, "
        f"the four {len(WORKER_FLAVORS) * args.kv_blocks}",
    )


def report_e2e(
    suite: Suite,
    runs: dict[str, ModeRun],
    workload: Workload,
    args: argparse.Namespace,
    load: tuple[float, ...],
) -> None:
    card = ModelDeploymentCard.from_model_dir(DEMO_MODEL)
    shared = shared_prefixes(workload, card)
    details: dict[str, Any] = {
        mode: mode_details(run, workload, shared, card.kv_cache_block_size, args)
        for mode, run in runs.items()
    }
    details["setup"] = {
        "workers": list(WORKER_FLAVORS),
        "kv_blocks": args.kv_blocks,
        "prefill_ms_per_1k": args.prefill_ms_per_1k,
        "token_delay_s": args.token_delay,
        "systems": args.systems,
        "shared_system_prefix_tokens": shared,
        "conversations": len(workload.conversations),
        "requests": workload.requests(),
        "turns_with_image": sum(turn.image is not None for c in workload.conversations for turn in c.turns),
        "concurrency": args.concurrency,
        "window": WINDOW,
        "frontend_args": args.frontend_args,
        "reply_tokens": summary([float(len(ids)) for ids in workload.replies]),
        "load_average_at_start": load,
    }
    suite.details["e2e"] = details
    record_e2e(suite, details, args)
    title = (
        f"{len(WORKER_FLAVORS)} mock workers x {args.kv_blocks} KV blocks, prefill "
        f"{args.prefill_ms_per_1k:g} ms per 1k uncached tokens; {workload.requests()} chat turns, "
        f"{args.concurrency} clients"
    )
    plot_ttft(runs, CHART_FILE, title)


def bench_e2e(suite: Suite, args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.from_model_dir(resolve_model_dir(DEMO_MODEL))
    with image_server() as images:
        _run_e2e(suite, args, build_workload(args, tokenizer, images), images)


def _run_e2e(suite: Suite, args: argparse.Namespace, workload: Workload, images: str) -> None:
    print(
        f"e2e: {len(workload.conversations)} conversations, {workload.requests()} turns, "
        f"{args.concurrency} clients",
        file=sys.stderr,
    )
    runs: dict[str, ModeRun] = {}
    load = os.getloadavg()
    with contextlib.ExitStack() as stack:
        workdir = args.log_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-routing-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        replies = workdir / "replies.jsonl"
        write_replies(workload, replies)
        for mode in MODES:
            started = time.perf_counter()
            runs[mode] = run_mode(mode, workload, args, workdir, replies, images=images)
            if args.log_dir:
                samples = [dataclasses.asdict(sample) for sample in runs[mode].samples]
                (workdir / f"{mode}-samples.json").write_text(json.dumps(samples), encoding="utf-8")
            print(f"e2e {mode}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    report_e2e(suite, runs, workload, args, load)


PARTS: dict[str, Callable[[Suite, argparse.Namespace], None]] = {"micro": bench_micro, "e2e": bench_e2e}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--seed", type=int, default=11)
    micro = parser.add_argument_group("micro")
    micro.add_argument("--instances", type=int, default=8)
    micro.add_argument("--blocks", type=int, default=50_000, help="blocks each instance holds")
    micro.add_argument("--decisions", type=int, default=3000)
    micro.add_argument("--rounds", type=int, default=5, help="timing rounds (the best of them counts)")
    e2e = parser.add_argument_group("e2e")
    e2e.add_argument("--systems", type=int, default=8, help="system prompts")
    e2e.add_argument("--users", type=int, default=72, help="conversations")
    e2e.add_argument("--concurrency", type=int, default=12, help="clients streaming at once")
    e2e.add_argument("--kv-blocks", type=int, default=2048, help="each worker's KV capacity in blocks")
    e2e.add_argument("--prefill-ms-per-1k", type=float, default=150.0, help="per 1000 uncached prompt tokens")
    e2e.add_argument("--token-delay", type=float, default=0.002, help="seconds per generated token")
    e2e.add_argument(
        "--frontend-args",
        type=str.split,
        default=[],
        help="more frontend flags, as --frontend-args='--kv-overlap-score-weight 2' (default: none)",
    )
    e2e.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the processes' logs here, workers at debug level (mock_generate_started: cached_tokens), "
        "and each mode's requests as the client saw them (MODE-samples.json)",
    )
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    for part in parts:
        if part not in PARTS:
            parser.error(f"unknown part {part!r} (known: {', '.join(PARTS)})")
    suite = Suite("routing")
    for part in parts:
        PARTS[part](suite, args)
    carry_over(suite, skipped={part for part in PARTS if part not in parts})
    print(f"wrote {suite.write()}", file=sys.stderr)
    return 0


def _part(name: str) -> str:
    """Which part wrote a record or a details key: e2e's all start with ``e2e``."""
    return "e2e" if name.startswith("e2e") else "micro"


def carry_over(suite: Suite, skipped: set[str]) -> None:
    """Keep the last written figures of the parts not run this time (one part at a time is a rerun)."""
    path = RESULTS_DIR / "routing.json"
    if not skipped or not path.exists():
        return
    previous = json.loads(path.read_text(encoding="utf-8"))
    kept = [Record(**entry) for entry in previous["records"] if _part(entry["name"]) in skipped]
    suite.records[:0] = kept
    suite.records.sort(key=lambda record: list(PARTS).index(_part(record.name)))
    for key, value in previous.get("details", {}).items():
        if _part(key) in skipped:
            suite.details.setdefault(key, value)


if __name__ == "__main__":
    sys.exit(main())
