"""StopMatcher: streamed stop strings, the naive rule's answers in linear time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_hostile import NaiveStops
from strategies_hostile import run_stops as run

from dynamo_prep.frontend.answers import AnswerStream
from dynamo_prep.frontend.stops import StopMatcher
from dynamo_prep.parsing import ContentDelta, PlainAnswerParser
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.preprocessor import MAX_STOP_CHARS, MAX_STOP_STRINGS
from dynamo_prep.tokenizer import Tokenizer

_STOPS = st.lists(st.text(alphabet="abc", max_size=6), max_size=6)
_CHUNKS = st.lists(st.text(alphabet="abcd", max_size=9), max_size=8)


@settings(max_examples=1500, derandomize=True, deadline=None)
@given(_STOPS, _CHUNKS)
def test_matches_the_naive_oracle(stops: list[str], chunks: list[str]) -> None:
    assert run(StopMatcher(stops), chunks) == run(NaiveStops(stops), chunks)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(st.text(alphabet="ab\n你é", min_size=1, max_size=4), min_size=1, max_size=4),
    st.text(alphabet="ab\n你é 🙂", max_size=40),
)
def test_the_answer_stream_cuts_real_ids_as_the_oracle_does(
    k3_demo_tokenizer: Tokenizer, stops: list[str], text: str
) -> None:
    """The production path: a worker's ids through ``AnswerStream``, whose content goes through the
    matcher, chunk by chunk as the parser releases it (whole characters only)."""
    ids = k3_demo_tokenizer.encode(text)
    chunks = [d.text for d in stream(AnswerStream(PlainAnswerParser(vocab_of(k3_demo_tokenizer))), ids)]
    oracle = NaiveStops(stops)
    expected = "".join(oracle.push(chunk)[0] for chunk in chunks) + oracle.finish()
    answer = AnswerStream(PlainAnswerParser(vocab_of(k3_demo_tokenizer)), stops=stops)
    assert "".join(d.text for d in stream(answer, ids)) == expected
    assert answer.stopped == oracle.stopped


def stream(answer: AnswerStream, ids: list[int]) -> list[ContentDelta]:
    deltas = [delta for token_id in ids for delta in answer.push([token_id])]
    return [delta for delta in [*deltas, *answer.finish("stop")] if isinstance(delta, ContentDelta)]


def test_the_earliest_stop_string_wins_even_when_it_ends_later() -> None:
    matcher = StopMatcher(["bc", "abcd"])
    assert matcher.push("xab") == ("x", False)  # "ab" may still become "abcd"
    assert matcher.push("cd!") == ("", True)  # "abcd" starts before "bc": nothing more is released
    assert matcher.push("more") == ("", True)
    assert matcher.finish() == ""


def test_a_stop_found_in_one_push_cuts_there_without_waiting_for_a_longer_one() -> None:
    matcher = StopMatcher(["bc", "abcd"])
    assert matcher.push("xabc") == ("xa", True)  # "bc" is complete, "abcd" not yet (the naive answer)


def test_the_held_tail_is_released_once_it_cannot_start_a_stop() -> None:
    matcher = StopMatcher(["</s>", "\nUser:"])
    assert matcher.push("Hello <") == ("Hello ", False)
    assert matcher.push("/") == ("", False)
    assert matcher.push("x") == ("</x", False)
    assert matcher.push("done\nUs") == ("done", False)
    assert matcher.finish() == "\nUs"


def test_no_stop_strings_release_everything() -> None:
    for stops in ([], [""]):
        matcher = StopMatcher(stops)
        assert matcher.push("anything") == ("anything", False)
        assert matcher.finish() == ""


def test_the_largest_accepted_stop_list_matches_the_oracle() -> None:
    """The preprocessor's limits (64 x 256 characters), overlapping prefixes, a long stream."""
    stops = [("ab" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - i] + "!" * (i % 3) for i in range(MAX_STOP_STRINGS)]
    text = ("ab" * 300 + "a!") * 4
    chunks = [text[i : i + 7] for i in range(0, len(text), 7)]
    assert run(StopMatcher(stops), chunks) == run(NaiveStops(stops), chunks)
