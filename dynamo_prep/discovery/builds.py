"""The discovery watcher's model builds: one preprocessor build per new model, on threads of their
own, bounded in flight, retried with backoff on later announces (docs/discovery.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.builder import BuiltModel, ModelBuilder
from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.discovery.eventlog import DiscoveryLog
from dynamo_prep.discovery.metrics import DiscoveryMetrics
from dynamo_prep.discovery.registry import DiscoveryRegistry, LegacyDowngrade, ModelFirstSeen

__all__ = ["BUILD_BACKOFF_S", "BUILD_THREADS", "MAX_BUILDS_IN_FLIGHT", "ModelBuilds"]

BUILD_BACKOFF_S = (1.0, 30.0)
# Builds run on their own threads (never the request path's executor): a flood of unbuildable
# model names queues here, and already served models are not slowed down by it.
BUILD_THREADS = 2
# Builds started and not finished at once; a model beyond it waits for a later announce of its own.
MAX_BUILDS_IN_FLIGHT = 16


class _Build(msgspec.Struct, gc=False):
    """One model's preprocessor build: in flight, failed (waiting for a retry) or done.

    Untracked by the GC, as the registry's records (one per model of a 10,000-name flood): the only
    cycle, through the task's coroutine while it runs, ends with the task (``task`` is cleared)."""

    mdcsum: str
    task: asyncio.Task[None] | None = None
    failures: int = 0
    retry_at: float = 0.0
    built: BuiltModel | None = None
    pending_legacy: list[LegacyDowngrade] | None = None


class ModelBuilds:
    """Schedules the builds of the models the registry sees; a finished build publishes its model
    in the catalog and calls ``on_published(name)``."""

    def __init__(
        self,
        builder: ModelBuilder,
        registry: DiscoveryRegistry,
        catalog: ModelCatalog,
        metrics: DiscoveryMetrics,
        log: DiscoveryLog,
        *,
        clock: Callable[[], float],
        on_published: Callable[[str], None],
    ) -> None:
        self._builder = builder
        self._registry = registry
        self._catalog = catalog
        self._metrics = metrics
        self._log = log
        self._clock = clock
        self._on_published = on_published
        self._builds: dict[str, _Build] = {}
        self._threads = ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="model-build")
        self._tasks: set[asyncio.Task[None]] = set()

    def first_seen(self, event: ModelFirstSeen) -> None:
        build = _Build(event.mdcsum)
        self._builds[event.model] = build
        self._start(event.model, build, event.card, event.instance.instance_id, event.instance.endpoint)

    def retry(self, instance_id: str, endpoint: str, now: float) -> None:
        """A later announce of a model whose build failed (after its backoff) or never started (too
        many in flight) starts it."""
        name = self._registry.model_of(instance_id)
        build = self._builds.get(name) if name is not None else None
        if name is None or build is None or build.built is not None or build.task is not None:
            return
        snapshot = self._registry.model(name)
        if now >= build.retry_at and snapshot is not None:
            self._start(name, build, snapshot.card, instance_id, endpoint)

    def forget(self, model: str) -> None:
        """The model is gone: an in-flight build sees this and drops its result."""
        self._builds.pop(model, None)

    def legacy(self, event: LegacyDowngrade) -> None:
        """Log now if the model is built (we know what renders); else when its build ends."""
        build = self._builds.get(event.model)
        if build is not None and build.built is None and build.failures == 0:
            if build.pending_legacy is None:
                build.pending_legacy = []
            build.pending_legacy.append(event)
            return
        self._log.legacy_downgrade(event, build.built if build is not None else None)

    def close(self) -> None:
        """Cancel the builds in flight and let their threads go."""
        for task in list(self._tasks):
            task.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _start(
        self, name: str, build: _Build, card: ModelDeploymentCard, instance_id: str, endpoint: str
    ) -> None:
        if len(self._tasks) >= MAX_BUILDS_IN_FLIGHT:
            return
        task = asyncio.get_running_loop().create_task(
            self._build(name, build, card, instance_id, endpoint), name=f"build:{name}"
        )
        build.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _build(
        self, name: str, build: _Build, card: ModelDeploymentCard, instance_id: str, endpoint: str
    ) -> None:
        started = time.perf_counter()
        try:
            loop = asyncio.get_running_loop()
            built = await loop.run_in_executor(self._threads, self._builder, card, endpoint)
        except Exception as exc:  # the contract is ModelBuildError; anything else is reported the same
            self._failed(name, build, instance_id, endpoint, exc)
            return
        finally:
            build.task = None
        snapshot = self._registry.model(name)
        if self._builds.get(name) is not build or snapshot is None:
            self._log.model_build_discarded(name, build.mdcsum)
            return
        build.built = built
        self._registry.confirm(name)
        self._metrics.note_unregistered(built.preprocessor.unregistered_image_token)
        live = LiveModel(
            name, card, build.mdcsum, built.preprocessor, snapshot.instances, model_dir=built.model_dir
        )
        self._catalog.publish(live)
        build_ms = (time.perf_counter() - started) * 1000
        self._log.model_added(
            name, build.mdcsum, instance_id, built, instances=len(snapshot.instances), build_ms=build_ms
        )
        self._flush_legacy(build)
        self._on_published(name)

    def _failed(self, name: str, build: _Build, instance_id: str, endpoint: str, exc: Exception) -> None:
        build.failures += 1
        low, high = BUILD_BACKOFF_S
        retry_in = min(high, low * 2 ** (build.failures - 1))
        build.retry_at = self._clock() + retry_in
        self._log.model_build_failed(
            name, build.mdcsum, instance_id, endpoint, exc, attempt=build.failures, retry_in_s=retry_in
        )
        self._flush_legacy(build)

    def _flush_legacy(self, build: _Build) -> None:
        pending, build.pending_legacy = build.pending_legacy or [], None
        for event in pending:
            self._log.legacy_downgrade(event, build.built)
