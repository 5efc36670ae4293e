"""A reasoning half and a tool half composed into one ``AnswerParser``, fed token ids."""

from __future__ import annotations

from dynamo_prep.parsing._answer import AnswerDelta, DeltaList
from dynamo_prep.parsing._halves import NoReasoning, NoTools, ParseOptions, ReasoningHalf, ToolHalf
from dynamo_prep.parsing._stream import IdStreamParser
from dynamo_prep.parsing._tokens import Vocab

__all__ = ["ComposedAnswerParser"]


class ComposedAnswerParser(IdStreamParser[str]):
    """One response: ids decoded to whole characters, the halves' marker tokens matched on their ids,
    the text and markers fed to the reasoning half, which hands the rest to the tool half.

    ``family`` names the parser in effect (the ``family`` label of the parse-error metric).
    """

    def __init__(
        self,
        vocab: Vocab,
        reasoning: type[ReasoningHalf] | None,
        tools: type[ToolHalf] | None,
        options: ParseOptions,
        *,
        family: str,
    ) -> None:
        if tools is not None and tools.NEEDS_TOOLS and not options.tools_declared:
            tools = None
        reasoning_type = reasoning or NoReasoning
        tools_type = tools or NoTools
        markers = (*reasoning_type.MARKERS, *tools_type.MARKERS)
        one_id = vocab.special_tokens
        super().__init__(vocab, {one_id[m]: m for m in markers if m in one_id})
        in_text = frozenset(m for m in markers if m not in one_id)
        self._tools = tools_type(options, in_text, self._recoveries)
        self._head = reasoning_type(options, in_text, self._recoveries, self._tools)
        self.family = family

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        out = DeltaList()
        cut = finish_reason == "length"
        if rest := self._utf8.flush(cut=cut):
            self._head.text(rest, out)
        self._recoveries.muted = cut  # what a max_tokens cut leaves unfinished is no malformed output
        self._head.end(cut, out)
        self._recoveries.muted = False
        return out.done()

    def _in_reasoning(self) -> bool:
        return self._head.in_reasoning

    def _on_text(self, token_ids: list[int], out: DeltaList) -> None:
        if text := self._utf8.push(self._vocab.bytes_of(token_ids)):
            (self._tools if self._head.passing else self._head).text(text, out)

    def _on_tag(self, tag: str, out: DeltaList) -> None:
        if text := self._utf8.flush():
            self._head.text(text, out)
        self._head.marker(tag, out)
