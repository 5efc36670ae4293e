"""Reasoning in ``<think>...</think>`` tags: Qwen3 (``qwen3``: the start tag optional, the prompt may
have opened the block) and DeepSeek-R1 (``deepseek_r1``: the prompt opens it, so the answer starts
in reasoning). Grammar and recoveries: docs/answers.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._halves import ParseOptions, ReasoningHalf, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "DeepSeekR1Reasoning",
    "ThinkTagReasoning",
    "prompt_ends_in_think",
    "thinking_requested",
]

THINK_OPEN: Final = "<think>"
THINK_CLOSE: Final = "</think>"


class ThinkTagReasoning(ReasoningHalf):
    """Reasoning from the start when the prompt opened the block (``options.thinking``), or after an
    opening tag at the very start of the answer (whitespace before it is dropped), up to the closing
    tag. An opening tag anywhere else is text (a tag token there is dropped, counted). Subclasses
    change the tags (``OPEN``/``CLOSE``) or always start in reasoning (``ALWAYS_THINKING``)."""

    OPEN: ClassVar[str] = THINK_OPEN
    CLOSE: ClassVar[str] = THINK_CLOSE
    MARKERS = (THINK_OPEN, THINK_CLOSE)
    ALWAYS_THINKING: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.MARKERS = (cls.OPEN, cls.CLOSE)

    def __init__(
        self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries, tools: ToolHalf
    ) -> None:
        super().__init__(options, text_markers, recoveries, tools)
        self.in_reasoning = options.thinking or self.ALWAYS_THINKING
        self._start = True  # nothing but whitespace yet: an opening tag may still begin the answer
        self._held = bytearray()  # that whitespace (UTF-8), dropped if the opening tag comes
        open_, close = self.OPEN, self.CLOSE
        self._wanted = {(True, True): (close, open_), (True, False): (close,), (False, True): (open_,)}

    def _looking_for(self) -> tuple[str, ...]:
        return self._wanted.get((self.in_reasoning, self._start), ())

    def _on_text(self, text: str, out: DeltaList) -> None:
        if self._start:
            if not text.strip():
                self._held += text.encode()
                return
            text = self._end_start() + text
        if self.in_reasoning:
            out.reasoning(text)
        else:
            self.passing = not self._pending
            self._pass_text(text, out)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        if marker == self.OPEN and self._start:
            self._held.clear()
            self._start = False
            self.in_reasoning = True
            return
        if self._start:
            self._on_held(self._end_start(), out)
        if marker == self.CLOSE and self.in_reasoning:
            self.in_reasoning = False
            self.passing = not self._pending
        elif marker in self.MARKERS:
            self._recoveries.add(kinds.UNKNOWN_TAG)
        elif self.in_reasoning:
            self._tool_marker_in_reasoning(marker, out)
        else:
            self._pass_marker(marker, out)

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        if cut:
            self._held.clear()
        elif self._start:
            self._on_held(self._end_start(), out)
        if self.in_reasoning and not cut:
            self._recoveries.add(kinds.MISSING_THINK_CLOSE)
        self.in_reasoning = False
        self._pass_end(cut, out)

    def _end_start(self) -> str:
        self._start = False
        held = self._held.decode()
        self._held.clear()
        return held

    def _on_held(self, held: str, out: DeltaList) -> None:
        if held:
            if self.in_reasoning:
                out.reasoning(held)
            else:
                self._pass_text(held, out)


class DeepSeekR1Reasoning(ThinkTagReasoning):
    """DeepSeek-R1: the template opens the block, so the answer starts in reasoning (as vLLM reads it)."""

    ALWAYS_THINKING = True


def prompt_ends_in_think(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a ``<think>`` block open (DeepSeek-R1 and Qwen3 thinking
    templates do): then the answer starts in reasoning. A closed empty block (thinking off) is not."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


THINKING_KWARGS: Final = ("thinking", "enable_thinking")


def thinking_requested(template_kwargs: Mapping[str, Any]) -> bool:
    """Whether a request's ``chat_template_kwargs`` ask for thinking (``thinking`` or
    ``enable_thinking`` truthy), as vLLM's ``deepseek_v3`` reasoning parser reads them."""
    return any(bool(template_kwargs.get(key)) for key in THINKING_KWARGS)
