"""The answer layer: the parser's deltas with the request's options (stop strings, reasoning)."""

from __future__ import annotations

from dynamo_prep.frontend.answers import AnswerStream
from dynamo_prep.parsing import ContentDelta, KimiK3AnswerParser, PlainAnswerParser, fold_deltas
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.tokenizer import Tokenizer


def stream_all(answer: AnswerStream, ids: list[int], reason: str = "stop") -> list[object]:
    deltas: list[object] = []
    for token_id in ids:
        deltas.extend(answer.push([token_id]))
    deltas.extend(answer.finish(reason))
    return deltas


def test_text_never_splits_a_character_and_stop_strings_never_show(k3_demo_tokenizer: Tokenizer) -> None:
    text = "naïve 日本語 🙂 done. STOP here"
    ids = k3_demo_tokenizer.encode(text)
    whole = stream_all(AnswerStream(PlainAnswerParser(vocab_of(k3_demo_tokenizer))), ids)
    assert "".join(d.text for d in whole if isinstance(d, ContentDelta)) == text
    assert all("\ufffd" not in d.text for d in whole if isinstance(d, ContentDelta))
    stopping = AnswerStream(PlainAnswerParser(vocab_of(k3_demo_tokenizer)), stops=["STOP"])
    seen = stream_all(stopping, ids)
    assert "".join(d.text for d in seen if isinstance(d, ContentDelta)) == "naïve 日本語 🙂 done. "
    assert stopping.stopped
    assert stopping.push(k3_demo_tokenizer.encode("more")) == []  # nothing after the stop


def test_a_stop_string_held_across_chunks_is_released_when_it_does_not_complete(
    k3_demo_tokenizer: Tokenizer,
) -> None:
    answer = AnswerStream(PlainAnswerParser(vocab_of(k3_demo_tokenizer)), stops=["END!"])
    deltas = stream_all(answer, k3_demo_tokenizer.encode("the END? no, the END"))
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == "the END? no, the END"
    assert not answer.stopped


def k3_answer(tokenizer: Tokenizer) -> list[int]:
    """``hmm`` in the think channel the prompt opened, then ``hi STOP x`` in the response channel."""
    marker = tokenizer.special_tokens
    close, sep, open_ = marker["<|close|>"], marker["<|sep|>"], marker["<|open|>"]
    text = tokenizer.encode
    return [*text("hmm"), close, *text("think"), sep, open_, *text("response"), sep, *text("hi STOP x")]


def test_reasoning_is_dropped_when_the_request_says_so(k3_demo_tokenizer: Tokenizer) -> None:
    vocab = vocab_of(k3_demo_tokenizer)
    kept = fold_deltas(
        stream_all(AnswerStream(KimiK3AnswerParser(vocab, thinking=True)), k3_answer(k3_demo_tokenizer))
    )
    assert (kept.reasoning, kept.content) == ("hmm", "hi STOP x")
    answer = AnswerStream(KimiK3AnswerParser(vocab, thinking=True), include_reasoning=False, stops=["STOP"])
    dropped = fold_deltas(stream_all(answer, k3_answer(k3_demo_tokenizer)))
    assert (dropped.reasoning, dropped.content) == ("", "hi ")  # stop strings cut content, not reasoning
    assert answer.reasoning_tokens == len(k3_demo_tokenizer.encode("hmm"))
