"""A vLLM ``AsyncLLM`` in the worker's process, built from the engine's own flags as ``vllm serve``
builds it. The thin part of the bridge: every decision is ``translate``'s. vLLM itself is imported
by ``VllmApi.load`` when a worker starts an engine; ``VllmRuntime`` drives whatever ``VllmApi`` it
is given, so it is tested against fakes shaped like vLLM's classes without vLLM installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from dynamo_prep.engines.base import (
    EngineAbortedError,
    EngineContractError,
    EngineDeadError,
    EngineError,
    EngineFacts,
    EngineOutput,
)
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.engines.steps import check_n
from dynamo_prep.engines.vllm.contract import check_placeholder_count, expanded_image_placeholder
from dynamo_prep.engines.vllm.translate import (
    OutputReader,
    engine_facts,
    prompt_fields,
    sampling_fields,
    structured_fields,
)
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["VllmApi", "VllmRuntime"]

log = structlog.get_logger("dynamo_prep.engines")

# How often the worker looks whether the engine core is still alive (vLLM says so in a property).
HEALTH_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class VllmApi:
    """The parts of vLLM the bridge calls: its request classes and the errors it tells apart."""

    sampling_params: Callable[..., Any]  # SamplingParams
    structured_outputs: Callable[..., Any]  # StructuredOutputsParams
    tokens_prompt: Callable[..., Any]  # TokensPrompt
    delta: Any  # RequestOutputKind.DELTA
    client_errors: tuple[type[BaseException], ...]  # a request vLLM refuses: a 400
    busy_errors: tuple[type[BaseException], ...]  # admission refused (queue full): a 503
    dead_errors: tuple[type[BaseException], ...]  # the engine core is gone

    @classmethod
    def load(cls) -> VllmApi:
        from vllm import SamplingParams  # noqa: PLC0415 - only a worker running vLLM imports it
        from vllm.exceptions import GracefulHTTPError, VLLMClientError  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: PLC0415
        from vllm.v1.engine.exceptions import EngineDeadError as DeadError  # noqa: PLC0415

        return cls(
            sampling_params=SamplingParams,
            structured_outputs=StructuredOutputsParams,
            tokens_prompt=TokensPrompt,
            delta=RequestOutputKind.DELTA,
            client_errors=(VLLMClientError, ValueError),  # ValueError: checks older than VLLMClientError
            busy_errors=(GracefulHTTPError,),
            dead_errors=(DeadError,),
        )


def build_engine(argv: Sequence[str]) -> Any:
    """``AsyncLLM`` from vLLM's own parser on the engine flags (``SystemExit`` for a wrong flag)."""
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415
    from vllm.usage.usage_lib import UsageContext  # noqa: PLC0415
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

    parser = FlexibleArgumentParser(prog="dynamo-prep worker --engine vllm")
    AsyncEngineArgs.add_cli_args(parser)
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(list(argv)))
    context = UsageContext.OPENAI_API_SERVER
    config = args.create_engine_config(usage_context=context)
    engine = AsyncLLM.from_vllm_config(vllm_config=config, usage_context=context)
    _cache_envs()
    return engine


def _cache_envs() -> None:
    """vLLM's environment variables read once from now on, as its engine core does after its start:
    its output path reads one per request output (``IterationStats``), a ``getenv`` each time."""
    from vllm import envs  # noqa: PLC0415

    enable = getattr(envs, "enable_envs_cache", None)
    if callable(enable):
        enable()


class VllmRuntime:
    """The engine, its figures and its requests; ``start`` builds it (blocking, tens of seconds)."""

    flavor: str = "vllm"
    declared_image_token: str | None = None  # vLLM expands the checkpoint's own placeholder

    def __init__(
        self, engine: Any, api: VllmApi, images: ImageFetcher, model_dir: str | Path | None = None
    ) -> None:
        self._engine = engine
        self._api = api
        self._images = images
        self._placeholder = _placeholder(model_dir)
        self._defaults: dict[str, Any] = engine.model_config.get_diff_sampling_param()
        self._ids = itertools.count()
        self._dead = asyncio.Event()
        self.facts: EngineFacts = engine_facts(engine.vllm_config)

    @classmethod
    def start(cls, argv: Sequence[str], images: ImageFetcher, model_dir: str | Path) -> VllmRuntime:
        runtime = cls(build_engine(argv), VllmApi.load(), images, model_dir)
        log.info("engine_started", flavor="vllm", defaults=runtime._defaults, **runtime.facts.logged())
        return runtime

    def check(self, request: PreprocessedRequest) -> None:
        check_n(request)
        if self._placeholder is not None:
            spelling, pattern = self._placeholder
            check_placeholder_count(request.token_ids, pattern, spelling, len(request.images))

    def _sampling(self, request: PreprocessedRequest) -> dict[str, Any]:
        fields = sampling_fields(request, self._defaults)
        structured = structured_fields(request)
        if structured is not None:
            fields["structured_outputs"] = self._api.structured_outputs(**structured)
        return fields

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """The request's steps; leaving early closes vLLM's stream, which aborts it there (once)."""
        api = self._api
        images = await self._images.fetch(request.images) if request.images else []
        reader = OutputReader(request)
        # Unique in this process: a migrated request that comes back never meets its earlier self.
        request_id = f"dp-{next(self._ids)}"
        try:
            params = api.sampling_params(**self._sampling(request), output_kind=api.delta)
            decoded, uuids = [image.image for image in images], [image.uuid for image in images]
            prompt = api.tokens_prompt(**prompt_fields(request, decoded, uuids))
            async with contextlib.aclosing(self._engine.generate(prompt, params, request_id)) as stream:
                async for output in stream:
                    yield reader.step(output)
        except EngineError:
            raise
        except api.dead_errors as exc:
            self._dead.set()
            raise EngineDeadError("the engine is gone") from exc
        except api.busy_errors as exc:
            raise EngineAbortedError(str(exc)) from exc
        except api.client_errors as exc:
            raise EngineContractError(str(exc)) from exc

    def unfinished_requests(self) -> int:
        count: int = self._engine.get_num_unfinished_requests()
        return count

    async def wait_dead(self) -> str:
        while not self._engine.errored and not self._dead.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dead.wait(), HEALTH_POLL_S)
        return "engine_core_dead"

    async def shutdown(self) -> None:
        await self._images.aclose()
        await asyncio.to_thread(self._engine.shutdown)


def _placeholder(model_dir: str | Path | None) -> tuple[str, tuple[int, ...]] | None:
    """The checkpoint placeholder vLLM expands (Kimi-K3) and its stand-alone ids, or None."""
    if model_dir is None:
        return None
    spelling = expanded_image_placeholder(model_dir)
    if spelling is None:
        return None
    return spelling, tuple(Tokenizer.from_model_dir(model_dir).encode(spelling, allow_special=False))
