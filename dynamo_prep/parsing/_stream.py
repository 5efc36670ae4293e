"""The skeleton every answer parser shares: ids split into runs of text and structural tags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

from dynamo_prep.parsing._answer import AnswerDelta, DeltaList
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._tokens import Utf8, Vocab

Tag = TypeVar("Tag")


class IdStreamParser(Generic[Tag]):
    """Feeds each run of text ids to ``_on_text`` and each structural id (a key of ``tags``) to
    ``_on_tag``, in order; any other id (a special, or out of range) is dropped, and counted unless
    it is a stop id. Subclasses implement the two hooks and ``finish``."""

    family = "plain"

    def __init__(self, vocab: Vocab, tags: Mapping[int, Tag]) -> None:
        self._vocab = vocab
        self._tags = tags
        self._recoveries = Recoveries()
        self._utf8 = Utf8()
        self._reasoning_tokens = 0

    @property
    def recoveries(self) -> Mapping[str, int]:
        return self._recoveries.view

    @property
    def reasoning_tokens(self) -> int:
        """Text ids that arrived while the answer was in its reasoning part."""
        return self._reasoning_tokens

    def _in_reasoning(self) -> bool:
        """Whether text arriving now is reasoning (a subclass with a reasoning part says when)."""
        return False

    def feed(self, token_ids: Sequence[int]) -> list[AnswerDelta]:
        out = DeltaList()
        tags, is_text = self._tags, self._vocab.is_text
        run: list[int] = []
        for token_id in token_ids:
            tag = tags.get(token_id)
            if tag is None and is_text(token_id):
                run.append(token_id)
                continue
            if run:
                self._text_run(run, out)
                run = []
            if tag is not None:
                self._on_tag(tag, out)
            elif (kind := self._vocab.stray_kind(token_id)) is not None:
                self._recoveries.add(kind)
        if run:
            self._text_run(run, out)
        return out.done()

    def _text_run(self, run: list[int], out: DeltaList) -> None:
        if self._in_reasoning():
            self._reasoning_tokens += len(run)
        self._on_text(run, out)

    def _on_text(self, token_ids: list[int], out: DeltaList) -> None:
        raise NotImplementedError

    def _on_tag(self, tag: Tag, out: DeltaList) -> None:
        raise NotImplementedError
