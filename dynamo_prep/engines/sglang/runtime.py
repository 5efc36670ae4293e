"""An SGLang ``Engine`` in the worker's process, built from the engine's own flags as SGLang's server
builds it. The thin part of the bridge: every decision is ``translate``'s. SGLang itself is
imported by ``SglangApi.load`` when a worker starts an engine; ``SglangRuntime`` drives whatever it
is given, so it is tested against fakes shaped like SGLang's classes (SGLang's engine needs a GPU;
``make test-engines`` checks the calls against SGLang's real signatures).

Signals, in the order the reference asks: SGLang installs its own SIGTERM and SIGQUIT handlers on
the loop of its first request (``auto_create_handle_loop``); the runtime triggers that at start-up,
then takes SIGQUIT (SGLang's "a child failed", which would kill this process tree at once) as
the engine's death, and the worker process installs its own SIGTERM handler after it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from dynamo_prep.engines.base import EngineContractError, EngineError, EngineFacts, EngineOutput
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.engines.sglang.declare import declared_image_token
from dynamo_prep.engines.sglang.translate import ChunkReader, engine_facts, generate_kwargs
from dynamo_prep.engines.steps import check_n
from dynamo_prep.protocol.preprocessed import PreprocessedRequest

__all__ = ["SglangApi", "SglangRuntime", "parse_server_args"]

log = structlog.get_logger("dynamo_prep.engines")


@dataclass(frozen=True, slots=True)
class SglangApi:
    """The parts of SGLang the bridge calls: its engine class and its argument parsing."""

    engine: Callable[..., Any]  # sglang.srt.entrypoints.engine.Engine
    server_args: Any  # sglang.srt.server_args.ServerArgs

    @classmethod
    def load(cls) -> SglangApi:
        from sglang.srt.entrypoints.engine import Engine  # noqa: PLC0415 - only a worker running SGLang
        from sglang.srt.server_args import ServerArgs  # noqa: PLC0415

        return cls(engine=Engine, server_args=ServerArgs)


def parse_server_args(api: SglangApi, argv: Sequence[str]) -> Any:
    """SGLang's own parser on the engine flags (``SystemExit`` for a wrong one), with streaming
    chunks as deltas (else each chunk is one growing, later-mutated list)."""
    parser = argparse.ArgumentParser(prog="dynamo-prep worker --engine sglang")
    api.server_args.add_cli_args(parser)
    namespace = parser.parse_args(list(argv))
    namespace.incremental_streaming_output = True
    return api.server_args.from_cli_args(namespace)


class SglangRuntime:
    """The engine, its declaration, its figures and its requests."""

    flavor: str = "sglang"

    def __init__(self, engine: Any, images: ImageFetcher) -> None:
        self._engine = engine
        self._images = images
        self._manager = engine.tokenizer_manager
        self._defaults: dict[str, Any] = _sampling_defaults(self._manager)
        self._ids = itertools.count()
        self._dead = asyncio.Event()
        self.declared_image_token: str | None = declared_image_token(engine)
        scheduler = engine._scheduler_init_result.scheduler_infos[0]
        self.facts: EngineFacts = engine_facts(engine.server_args, scheduler, self._manager.context_len)

    @classmethod
    def start(
        cls, argv: Sequence[str], images: ImageFetcher, model_dir: str | Path, api: SglangApi | None = None
    ) -> SglangRuntime:
        del model_dir  # SGLang's processor states its own image contract (the declaration)
        api = api or SglangApi.load()
        runtime = cls(api.engine(server_args=parse_server_args(api, argv)), images)
        runtime.take_signals()
        log.info("engine_started", flavor="sglang", defaults=runtime._defaults, **runtime.facts.logged())
        return runtime

    def take_signals(self) -> None:
        """Let SGLang install its handlers now (not at the first request), then take SIGQUIT: a
        failed child makes this worker withdraw and exit 1 instead of vanishing."""
        self._manager.auto_create_handle_loop()
        with contextlib.suppress(RuntimeError, ValueError):  # not the main thread: no signals
            asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, self._dead.set)

    def check(self, request: PreprocessedRequest) -> None:
        check_n(request)

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """The request's steps; leaving early closes SGLang's stream, which aborts it there (once)."""
        images = await self._images.fetch(request.images) if request.images else []
        reader = ChunkReader(request)
        rid = f"dp-{next(self._ids)}"  # never an id SGLang may still hold (a migrated request's)
        try:
            decoded, uuids = [image.image for image in images], [image.uuid for image in images]
            stream = await self._engine.async_generate(
                **generate_kwargs(request, self._defaults, decoded, rid, uuids=uuids)
            )
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    yield reader.step(chunk)
        except EngineError:
            raise
        except ValueError as exc:  # SGLang's request checks (lengths, its image processor)
            raise EngineContractError(str(exc)) from exc

    def unfinished_requests(self) -> int:
        return len(self._manager.rid_to_state)

    async def wait_dead(self) -> str:
        await self._dead.wait()
        return "engine_child_failed"

    async def shutdown(self) -> None:
        await self._images.aclose()
        await asyncio.to_thread(self._engine.shutdown)


def _sampling_defaults(manager: Any) -> dict[str, Any]:
    """The model's generation_config sampling defaults, as SGLang's own server reads them."""
    config = getattr(manager, "model_config", None)
    read = getattr(config, "get_default_sampling_params", None)
    defaults: dict[str, Any] = read() if callable(read) else {}
    return defaults
