"""A GPU-free engine, like Dynamo's mocker, that enforces a real engine's image contract.

The mock exists to make a wrong image placeholder loud: it checks the token ids it receives
exactly the way SGLang or vLLM would (``flavor``) and rejects a mismatch with the engine's own
wording, instead of generating from a prompt the real engine would refuse or misread. It then
streams a deterministic reply that states what it received, so end-to-end tests can assert on
the content.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Literal, NamedTuple, NoReturn

import msgspec
import structlog

from dynamo_prep.card import ModelCardError, read_json
from dynamo_prep.engines import sglang, vllm
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.preprocessed import PreprocessedRequest, StopConditions
from dynamo_prep.tokenizer import Tokenizer

__all__ = [
    "FLAVORS",
    "EngineContractError",
    "Flavor",
    "MockEngine",
    "MockOutput",
    "count_occurrences",
    "last_user_text",
]

log = structlog.get_logger("dynamo_prep.engines")

Flavor = Literal["sglang", "vllm"]
FLAVORS: tuple[Flavor, ...] = ("sglang", "vllm")
MAX_ECHO_CHARS = 200
QWEN_IMAGE_PAD = "<|image_pad|>"
_KIMI_MARKERS = ("<|open|>", "<|sep|>", "<|close|>")
_CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
_CHATML_USER = "user\n"
_KIMI_USER_HEADER = re.compile(r'message\b[^\n]*\brole="user"')


class EngineContractError(ValueError):
    """A request breaks the engine's real prompt contract; the message is the engine's own."""


class MockOutput(msgspec.Struct, frozen=True):
    """One streamed step: one token id (none only for an empty reply); the last one has a finish reason."""

    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class _ImageContract(NamedTuple):
    """How the engine finds images in token ids.

    ``pattern``: the id sequence that must occur once per image (None: the model takes no images);
    ``strip``: the ids one image occupies in the prompt (removed before echoing the user text);
    ``spelling``: the placeholder as text, for messages.
    """

    pattern: tuple[int, ...] | None
    strip: tuple[int, ...] | None
    spelling: str | None


class MockEngine:
    """Checks a ``PreprocessedRequest`` against SGLang's or vLLM's contract and streams a reply."""

    def __init__(self, model_dir: str | Path, *, flavor: Flavor, token_delay_s: float = 0.0) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"unknown mock engine flavor {flavor!r} (known: {', '.join(FLAVORS)})")
        if token_delay_s < 0:
            raise ValueError(f"token_delay_s must be >= 0, got {token_delay_s}")
        self.model_dir = resolve_model_dir(model_dir)
        self.flavor: Flavor = flavor
        self.token_delay_s = token_delay_s
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.name = self.tokenizer.name
        self._sglang_engine = sglang.sglang_engine_standin(self.model_dir) if flavor == "sglang" else None
        self._contract = self._sglang_contract() if flavor == "sglang" else self._vllm_contract()

    @property
    def declared_image_token(self) -> str | None:
        """What a worker running this engine declares in its card (vLLM: nothing)."""
        if self._sglang_engine is not None:
            return sglang.declared_image_token(self._sglang_engine)
        vllm.declared_image_token(None)  # always None: vLLM expands the checkpoint default itself
        return None

    def check_contract(self, request: PreprocessedRequest) -> None:
        """Raise ``EngineContractError`` when the prompt's image placeholders do not match its images."""
        expected = len(request.images)
        if self._contract.pattern is None:
            if expected:
                self._violation(
                    expected=0,
                    found=expected,
                    message=f"{self.name} takes no images under {self.flavor} (no multimodal processor); "
                    f"the request has {expected} image(s)",
                )
            return
        found = count_occurrences(request.token_ids, self._contract.pattern)
        if found == expected:
            return
        if self.flavor == "sglang":
            message = f"Expected {expected} image placeholder token(s), found {found}"
        else:
            message = (
                f"Expected {expected} occurrence(s) of the image placeholder {self._contract.spelling!r} "
                f"(token ids {list(self._contract.pattern)}), one per image, found {found}"
            )
        self._violation(expected=expected, found=found, message=message)

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[MockOutput]:
        """Stream the reply one token per output; raises ``EngineContractError`` before any output.

        Cancellation is honoured at every token (``asyncio.sleep`` even with no delay).
        """
        self.check_contract(request)
        prompt_tokens = len(request.token_ids)
        reply = self.reply_text(request)
        token_ids, finish_reason = self._limit(self.tokenizer.encode(reply), request.stop_conditions)
        log.debug(
            "mock_generate_started",
            flavor=self.flavor,
            images=len(request.images),
            prompt_tokens=prompt_tokens,
            completion_tokens=len(token_ids),
        )
        if not token_ids:
            yield MockOutput([], finish_reason, prompt_tokens, 0)
            return
        try:
            for index, token_id in enumerate(token_ids, start=1):
                await asyncio.sleep(self.token_delay_s)
                last = index == len(token_ids)
                yield MockOutput([token_id], finish_reason if last else None, prompt_tokens, index)
        except asyncio.CancelledError:
            log.debug("mock_generate_cancelled", flavor=self.flavor, prompt_tokens=prompt_tokens)
            raise

    def reply_text(self, request: PreprocessedRequest) -> str:
        """The full deterministic reply: what arrived, and the last user text echoed back."""
        said = last_user_text(self.tokenizer, request.token_ids, strip=self._contract.strip)
        return (
            f"[mock {self.flavor}] {len(request.images)} image(s), "
            f"{len(request.token_ids)} prompt tokens. You said: {said}"
        )

    def _limit(self, token_ids: list[int], stop: StopConditions) -> tuple[list[int], str]:
        """Cut at a stop id or stop string (never emitted), then at ``max_tokens`` ("length")."""
        token_ids = _cut_at_stop_ids(token_ids, {*stop.stop_token_ids, *stop.stop_token_ids_hidden})
        token_ids = self._cut_at_stop_strings(token_ids, stop.stop)
        if len(token_ids) > stop.max_tokens:
            return token_ids[: max(stop.max_tokens, 0)], "length"
        return token_ids, "stop"

    def _cut_at_stop_strings(self, token_ids: list[int], stops: Sequence[str]) -> list[int]:
        """The tokens whose text ends before the first stop string, as a real engine's stop check
        over the decoded text so far would leave them (a token straddling the stop is dropped)."""
        text = self.tokenizer.decode(token_ids)
        hits = [text.find(stop) for stop in stops if stop and stop in text]
        if not hits:
            return token_ids
        budget = len(text[: min(hits)].encode("utf-8"))
        kept = 0
        for token_id in token_ids:
            budget -= len(self.tokenizer.encoding.decode_single_token_bytes(token_id))
            if budget < 0:
                break
            kept += 1
        return token_ids[:kept]

    def _violation(self, *, expected: int, found: int, message: str) -> NoReturn:
        log.warning(
            "mock_contract_violation", flavor=self.flavor, model=self.name, expected=expected, found=found
        )
        raise EngineContractError(message)

    def _sglang_contract(self) -> _ImageContract:
        """SGLang counts its processor's ``image_token_id``: one id per image."""
        manager = self._sglang_engine.tokenizer_manager if self._sglang_engine else None
        processor = manager.mm_processor if manager else None
        if processor is None or processor.mm_tokens.image_token_id is None:
            return _ImageContract(None, None, None)
        token_id = processor.mm_tokens.image_token_id
        spelling = processor.mm_tokens.image_token
        strip = (
            tuple(self.tokenizer.encode(spelling, allow_special=True))
            if isinstance(spelling, str)
            else (token_id,)
        )
        return _ImageContract((token_id,), strip, self.tokenizer.id_to_token(token_id))

    def _vllm_contract(self) -> _ImageContract:
        """vLLM finds the checkpoint placeholder's own id sequence (K3), or Qwen's ``<|image_pad|>``."""
        placeholder = vllm.checkpoint_image_placeholder(self.model_dir)
        if placeholder is not None:
            ids = tuple(self.tokenizer.encode(placeholder, allow_special=False))
            return _ImageContract(ids, ids, placeholder)
        model_type = read_json(self.model_dir / "config.json").get("model_type")
        if model_type not in sglang.QWEN_VL_MODEL_TYPES:
            return _ImageContract(None, None, None)
        pad_id = self.tokenizer.token_to_id(QWEN_IMAGE_PAD)
        if pad_id is None:
            raise ModelCardError(f"{self.model_dir}: the tokenizer has no {QWEN_IMAGE_PAD} token")
        strip = self.tokenizer.encode(sglang.QwenVLImageProcessorStandIn.IMAGE_TOKEN, allow_special=True)
        return _ImageContract((pad_id,), tuple(strip), QWEN_IMAGE_PAD)


def count_occurrences(token_ids: Sequence[int], pattern: Sequence[int]) -> int:
    """Non-overlapping occurrences of ``pattern`` in ``token_ids``, scanning left to right."""
    return len(_occurrences(token_ids, pattern))


def _occurrences(token_ids: Sequence[int], pattern: Sequence[int]) -> list[int]:
    """Start positions of the non-overlapping occurrences of ``pattern``."""
    if not pattern:
        return []
    width = len(pattern)
    target = list(pattern)
    starts: list[int] = []
    position = 0
    while position <= len(token_ids) - width:
        if list(token_ids[position : position + width]) == target:
            starts.append(position)
            position += width
        else:
            position += 1
    return starts


def _strip(token_ids: Sequence[int], pattern: Sequence[int] | None) -> list[int]:
    """``token_ids`` without the non-overlapping occurrences of ``pattern``."""
    if not pattern:
        return list(token_ids)
    kept: list[int] = []
    previous = 0
    for start in _occurrences(token_ids, pattern):
        kept.extend(token_ids[previous:start])
        previous = start + len(pattern)
    kept.extend(token_ids[previous:])
    return kept


def _cut_at_stop_ids(token_ids: list[int], stop_ids: set[int]) -> list[int]:
    for index, token_id in enumerate(token_ids):
        if token_id in stop_ids:
            return token_ids[:index]
    return token_ids


def last_user_text(
    tokenizer: Tokenizer, token_ids: Sequence[int], *, strip: Sequence[int] | None = None
) -> str:
    """The last user message's text, recovered from prompt ids (image ids ``strip``-ped), <= 200 chars.

    Parsed on ids, not on decoded text, so a user who types ``<|close|>`` or ``<|im_end|>`` as text
    (plain BPE) cannot move the boundaries.
    """
    specials = tokenizer.special_tokens
    if all(marker in specials for marker in _KIMI_MARKERS):
        body = _kimi_user_body(tokenizer, token_ids)
        if body is not None:
            return _clip(tokenizer.decode(_strip(body, strip)))
    elif all(marker in specials for marker in _CHATML_MARKERS):
        body = _chatml_user_body(tokenizer, token_ids)
        if body is not None:
            return _clip(tokenizer.decode(_strip(body, strip)).removeprefix(_CHATML_USER))
    text = tokenizer.decode(_strip(token_ids, strip), skip_special_tokens=True)
    return _clip(text[-MAX_ECHO_CHARS:])


def _kimi_user_body(tokenizer: Tokenizer, token_ids: Sequence[int]) -> Sequence[int] | None:
    """Ids between ``<|sep|>`` and ``<|close|>`` of the last ``<|open|>message role="user"``."""
    open_id, sep_id, close_id = (tokenizer.special_tokens[marker] for marker in _KIMI_MARKERS)
    opens = [index for index, token_id in enumerate(token_ids) if token_id == open_id]
    for start in reversed(opens):
        sep = _index(token_ids, sep_id, start + 1)
        if sep is None:
            continue
        if _KIMI_USER_HEADER.match(tokenizer.decode(token_ids[start + 1 : sep])):
            end = _index(token_ids, close_id, sep + 1)
            return token_ids[sep + 1 : len(token_ids) if end is None else end]
    return None


def _chatml_user_body(tokenizer: Tokenizer, token_ids: Sequence[int]) -> Sequence[int] | None:
    """Ids after the last ``<|im_start|>`` whose role is ``user``, up to ``<|im_end|>`` (role included)."""
    start_id, end_id = (tokenizer.special_tokens[marker] for marker in _CHATML_MARKERS)
    starts = [index for index, token_id in enumerate(token_ids) if token_id == start_id]
    for start in reversed(starts):
        end = _index(token_ids, end_id, start + 1)
        body = token_ids[start + 1 : len(token_ids) if end is None else end]
        if tokenizer.decode(body).startswith(_CHATML_USER):
            return body
    return None


def _index(token_ids: Sequence[int], token_id: int, start: int) -> int | None:
    for index in range(start, len(token_ids)):
        if token_ids[index] == token_id:
            return index
    return None


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."


_MAX_CONTINUATION_TOKENS = 4096


class MockContinuation:
    """The mock engine, continuing a migrated request the way a real engine would.

    A migrated request's prompt is the original prompt followed by the tokens already streamed
    (Dynamo's migration). A real LLM simply continues that text; the mock's reply is a function
    of the prompt, so it recognises its own reply's beginning at the end of the prompt and streams
    the rest of it.
    """

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self._instant = MockEngine(engine.model_dir, flavor=engine.flavor, token_delay_s=0.0)
        self._first_id = self._instant.tokenizer.encode(f"[mock {engine.flavor}]")[0]

    def check_contract(self, request: PreprocessedRequest) -> None:
        self.engine.check_contract(request)

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[MockOutput]:
        streamed = self.already_streamed(request)
        if not streamed:
            async for step in self.engine.generate(request):
                yield step
            return
        original = _shortened(request, streamed)
        prompt_tokens = len(request.token_ids)
        last: MockOutput | None = None
        async for index, step in _aenumerate(self._instant.generate(original)):
            last = step
            if index < streamed:
                continue
            await asyncio.sleep(self.engine.token_delay_s)
            yield MockOutput(
                step.token_ids, step.finish_reason, prompt_tokens, step.completion_tokens - streamed
            )
        if last is not None and last.completion_tokens <= streamed:  # nothing was left to stream
            yield MockOutput([], last.finish_reason, prompt_tokens, 0)

    def already_streamed(self, request: PreprocessedRequest) -> int:
        """How many trailing prompt tokens are the start of the mock's reply to the rest (0: none)."""
        ids = request.token_ids
        low = max(1, len(ids) - _MAX_CONTINUATION_TOKENS)
        for start in range(low, len(ids)):
            if ids[start] != self._first_id:
                continue
            tail = ids[start:]
            reply = self._instant.tokenizer.encode(self._instant.reply_text(_shortened(request, len(tail))))
            if reply[: len(tail)] == tail:
                return len(tail)
        return 0


def _shortened(request: PreprocessedRequest, streamed: int) -> PreprocessedRequest:
    """The request before migration: without the streamed tail, with its original token budget."""
    stop = msgspec.structs.replace(
        request.stop_conditions, max_tokens=request.stop_conditions.max_tokens + streamed
    )
    return msgspec.structs.replace(request, token_ids=request.token_ids[:-streamed], stop_conditions=stop)


async def _aenumerate(steps: AsyncIterator[MockOutput]) -> AsyncIterator[tuple[int, MockOutput]]:
    index = 0
    async for step in steps:
        yield index, step
        index += 1
