"""Answers of a model without a reasoning or tool-call format: every decoded token is content."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynamo_prep.parsing._answer import AnswerDelta, DeltaList
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._tokens import Utf8, Vocab

__all__ = ["PlainAnswerParser"]


class PlainAnswerParser:
    """Content only; special ids never become text (stop ids silently, others counted)."""

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self._recoveries = Recoveries()
        self._utf8 = Utf8()

    @property
    def recoveries(self) -> Mapping[str, int]:
        return self._recoveries.view

    def feed(self, token_ids: Sequence[int]) -> list[AnswerDelta]:
        vocab = self._vocab
        text_ids = []
        for token_id in token_ids:
            if vocab.is_text(token_id):
                text_ids.append(token_id)
            elif (kind := vocab.stray_kind(token_id)) is not None:
                self._recoveries.add(kind)
        out = DeltaList()
        out.content(self._utf8.push(vocab.bytes_of(text_ids)))
        return out

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        out = DeltaList()
        out.content(self._utf8.flush(cut=finish_reason == "length"))
        return out
