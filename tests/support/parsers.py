"""What the answer parser tests share: one completion parsed whole, id by id and in random chunks
(``all_ways``), written with a family's markers as their ids (``marked_ids``), and cut by max_tokens
at every position (``every_cut_is_a_prefix``)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence

from dynamo_prep.parsing import (
    RECOVERY_KINDS,
    AnswerDelta,
    AnswerParser,
    ContentDelta,
    ParsedAnswer,
    ReasoningDelta,
    fold_deltas,
    parse_answer,
)
from dynamo_prep.tokenizer import Tokenizer


def counting_ids() -> Callable[[], str]:
    """Deterministic call ids (``call_0``, ``call_1``, ...), so two runs can be compared."""
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def chunks(ids: Sequence[int], rng: random.Random) -> Iterator[list[int]]:
    """``ids`` cut at random places, with an empty feed now and then."""
    at = 0
    while at < len(ids):
        size = rng.choice((0, 1, 1, 2, 3, 5, 8, 13))
        yield list(ids[at : at + size])
        at += size


def streamed(parser: AnswerParser, feeds: Sequence[Sequence[int]], finish: str) -> list[AnswerDelta]:
    deltas: list[AnswerDelta] = []
    for feed in feeds:
        deltas.extend(parser.feed(feed))
    deltas.extend(parser.finish(finish))
    return deltas


def all_ways(
    make: Callable[[], AnswerParser], ids: Sequence[int], finish: str = "stop", seeds: Sequence[int] = (0, 1)
) -> tuple[ParsedAnswer, dict[str, int]]:
    """The answer and recoveries of ``ids``, checked equal whole, id by id, and in random chunks."""
    parser = make()
    whole = parse_answer(parser, ids, finish)
    recoveries = dict(parser.recoveries)
    assert set(recoveries) <= set(RECOVERY_KINDS)
    ways = [[[token_id] for token_id in ids]] + [list(chunks(ids, random.Random(seed))) for seed in seeds]
    for feeds in ways:
        parser = make()
        deltas = streamed(parser, feeds, finish)
        assert fold_deltas(deltas) == whole
        assert dict(parser.recoveries) == recoveries
        assert all(d.text for d in deltas if isinstance(d, ReasoningDelta | ContentDelta))
    assert [call.index for call in whole.tool_calls] == list(range(len(whole.tool_calls)))
    return whole, recoveries


def marked_ids(
    tok: Tokenizer, markers: Iterable[str], text: str, *, special: Callable[[str], bool] | None = None
) -> list[int]:
    """``text`` as the model writes it: each of ``markers`` its id (where ``special`` says it is a
    token; by default each is), the rest text."""
    segments: list[tuple[str, bool]] = []
    rest = text
    while rest:
        at, marker = min(((rest.find(m), m) for m in markers if m in rest), default=(len(rest), ""))
        if at:
            segments.append((rest[:at], False))
        if marker:
            segments.append((marker, special is None or special(marker)))
        rest = rest[at + len(marker) :]
    return tok.encode_segments(segments)


def every_cut_is_a_prefix(make: Callable[[], AnswerParser], ids: Sequence[int]) -> ParsedAnswer:
    """The whole answer of ``ids``, checked against a max_tokens cut at every position: no error, no
    half call, nothing counted, each cut's answer (whole and streamed, ``all_ways``) a prefix of the
    whole; and streamed id by id, no released text is taken back."""
    full = parse_answer(make(), ids, "stop")
    for cut in range(len(ids) + 1):
        answer, recoveries = all_ways(make, ids[:cut], "length", seeds=(cut,))
        assert recoveries == {}
        assert full.reasoning.startswith(answer.reasoning)
        assert full.content.startswith(answer.content)
        assert answer.tool_calls == full.tool_calls[: len(answer.tool_calls)]
    parser = make()
    texts = {ContentDelta: "", ReasoningDelta: ""}
    for token_id in ids:
        for delta in parser.feed([token_id]):
            if isinstance(delta, ContentDelta | ReasoningDelta):
                texts[type(delta)] += delta.text
        assert full.content.startswith(texts[ContentDelta])
        assert full.reasoning.startswith(texts[ReasoningDelta])
    return full
