"""Answers of a model without a reasoning or tool-call format: every decoded token is content."""

from __future__ import annotations

from dynamo_prep.parsing._answer import AnswerDelta, DeltaList
from dynamo_prep.parsing._stream import IdStreamParser
from dynamo_prep.parsing._tokens import Vocab, vocab_of
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["PlainAnswerParser", "plain_parser_for"]


class PlainAnswerParser(IdStreamParser[None]):
    """Content only; special ids never become text (stop ids silently, others counted)."""

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab, {})

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        out = DeltaList()
        out.content(self._utf8.flush(cut=finish_reason == "length"))
        return out.done()

    def _on_text(self, token_ids: list[int], out: DeltaList) -> None:
        out.content(self._utf8.push(self._vocab.bytes_of(token_ids)))


def plain_parser_for(tokenizer: Tokenizer) -> PlainAnswerParser:
    """A fresh plain parser of ``tokenizer``'s ids (text without a template: ``/v1/completions``)."""
    return PlainAnswerParser(vocab_of(tokenizer))
