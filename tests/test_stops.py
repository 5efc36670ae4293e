"""StopMatcher: the streamed stop-string semantics of the Detokenizer, in linear time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_hostile import NaiveStops
from strategies_hostile import run_stops as run

from dynamo_prep.frontend.detokenize import Detokenizer
from dynamo_prep.frontend.stops import StopMatcher
from dynamo_prep.preprocessor import MAX_STOP_CHARS, MAX_STOP_STRINGS
from dynamo_prep.tokenizer import Tokenizer

_STOPS = st.lists(st.text(alphabet="abc", max_size=6), max_size=6)
_CHUNKS = st.lists(st.text(alphabet="abcd", max_size=9), max_size=8)


@settings(max_examples=1500, derandomize=True, deadline=None)
@given(_STOPS, _CHUNKS)
def test_matches_the_naive_oracle(stops: list[str], chunks: list[str]) -> None:
    assert run(StopMatcher(stops), chunks) == run(NaiveStops(stops), chunks)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.lists(st.text(alphabet="ab\n你é", min_size=1, max_size=4), min_size=1, max_size=4),
    st.lists(st.text(alphabet="ab\n你é ", max_size=12), max_size=6),
)
def test_matches_the_detokenizer_on_real_ids(
    k3_demo_tokenizer: Tokenizer, stops: list[str], chunks: list[str]
) -> None:
    """The production path today: the same chunks as ids through ``Detokenizer``."""
    tokenizer = k3_demo_tokenizer
    detokenizer = Detokenizer(tokenizer, stops)
    matcher = StopMatcher(stops)
    for chunk in chunks:
        released, stopped = matcher.push(chunk)
        assert released == detokenizer.push(tokenizer.encode(chunk))
        assert stopped == detokenizer.stopped
    assert matcher.finish() == detokenizer.finish()


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
