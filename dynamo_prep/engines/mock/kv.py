"""The mock engine with a real prefix cache: what ``dynamo-prep worker --engine mock --kv-events`` runs.

Each request is admitted into a ``PagedPrefixCache`` (the whole prompt: a migrated request's
prompt, which ends with the tokens already streamed, is just a longer prompt), the cache's events
are published at once, the prefill time is charged only for the prompt tokens the cache did not
hold, and the reply streams. Prefills queue one after another, as on a GPU whose prefill throughput
is finite: a request waits for the prefills admitted before it, so load on an instance costs time.
When the request ends, however it ends (finished, cancelled, timed out, failed), it is released
with the tokens it generated, which caches the blocks its reply completed, and those events are
published too.

Images: each image is the span of one occurrence of the engine's image pattern in the prompt (the
same ids the contract check counts), in prompt order, and its identity is the request's
``ImageRef.uuid``: in a worker, the fetcher's (``worker.mock.with_images``: the URL's uuid, and for an
http(s) image the digest of its bytes), as vLLM gets it; the URL's uuid when a request comes
without one. So the events' ``extra_keys`` carry ``(uuid, offset)`` as vLLM's do, and two prompts
that differ only in an image share no block from that image on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence

from dynamo_prep.engines.mock.engine import MockContinuation, MockOutput, Prefill
from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.protocol.kv_events import ImageSpan, KVEvent
from dynamo_prep.protocol.kv_events import image_spans as spans_of
from dynamo_prep.protocol.preprocessed import PreprocessedRequest, image_uuid

__all__ = ["MockKvEngine", "image_spans"]

Publish = Callable[[Sequence[KVEvent]], object]
AdmitHook = Callable[[Prefill], None]


class MockKvEngine:
    """A ``MockContinuation`` behind a paged prefix cache whose events go to ``publish``.

    ``prefill_ms_per_1k``: the prefill time per 1000 prompt tokens the cache does not hold; a
    request's delay is its own prefill plus the queued prefills of earlier requests (``clock``).
    ``on_admit`` (optional) is told each admission's ``Prefill`` (for metrics). Everything runs on
    the worker's event loop: the cache and ``publish`` have one owner.
    """

    def __init__(
        self,
        engine: MockContinuation,
        cache: PagedPrefixCache,
        publish: Publish,
        *,
        prefill_ms_per_1k: float = 0.0,
        on_admit: AdmitHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not prefill_ms_per_1k >= 0:
            raise ValueError(f"prefill_ms_per_1k must be >= 0, got {prefill_ms_per_1k}")
        self.engine = engine
        self.cache = cache
        self.prefill_ms_per_1k = prefill_ms_per_1k
        self._publish = publish
        self._on_admit = on_admit
        self._admissions = itertools.count()
        self._clock = clock
        self._prefill_free_at = 0.0  # when the prefills queued so far are done (clock time)

    def check_contract(self, request: PreprocessedRequest) -> None:
        self.engine.check_contract(request)

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[MockOutput]:
        """Admit, publish, stream (after the prefill delay), then release and publish again.

        Raises ``EngineContractError`` before admitting a prompt that breaks the image contract.
        """
        self.check_contract(request)
        admission = f"admission-{next(self._admissions)}"
        prefill = self._admit(admission, request)
        generated: list[int] = []
        try:
            async for step in self.engine.generate(request, prefill=prefill):
                generated.extend(step.token_ids)
                yield step
        finally:
            self.cache.release(admission, generated)
            self._flush()

    def _admit(self, admission: str, request: PreprocessedRequest) -> Prefill:
        spans = image_spans(request, self.engine.engine.image_pattern)
        cached = self.cache.admit(admission, request.token_ids, spans)
        self._flush()
        uncached = len(request.token_ids) - cached
        prefill = Prefill(
            cached_tokens=cached, seconds=self._queue(uncached / 1000 * self.prefill_ms_per_1k / 1000)
        )
        if self._on_admit is not None:
            self._on_admit(prefill)
        return prefill

    def _queue(self, work_s: float) -> float:
        """The delay of a prefill of ``work_s`` behind the ones already queued."""
        if work_s <= 0:
            return 0.0
        now = self._clock()
        self._prefill_free_at = max(now, self._prefill_free_at) + work_s
        return self._prefill_free_at - now

    def _flush(self) -> None:
        events = self.cache.take_events()
        if events:
            self._publish(events)


def image_spans(request: PreprocessedRequest, pattern: Sequence[int] | None) -> list[ImageSpan]:
    """The request's images as prompt spans: the i-th occurrence of ``pattern`` is the i-th image.

    Occurrences beyond the request's images are not images (the contract check refuses such a
    prompt before it gets here); None or an empty pattern: the model takes no images.
    """
    if not pattern or not request.images:
        return []
    identifiers = [image.uuid or image_uuid(image.url) for image in request.images]
    return spans_of(request.token_ids, pattern, identifiers)
