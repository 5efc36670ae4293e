"""Metaschema checks of a request's JSON Schemas, never on the event loop nor in a thread that
cannot be stopped: a few processes of their own (``schema_process.py``), with admission, a
deadline, and a process killed when its check is abandoned (docs/structured-outputs.md, "Bounds").

A check's answer is kept (by the sha256 of the schema's text) for the next request sending the same
schema, as agent frameworks do with every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence

import structlog

from dynamo_prep.frontend.errors import OpenAIError
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.schema_process import HEADER_BYTES, frame
from dynamo_prep.preprocessor import PreprocessError
from dynamo_prep.protocol.schema_bounds import SchemaLimits
from dynamo_prep.protocol.structured import SchemaUse

__all__ = ["CACHED_ANSWERS", "SchemaChecks"]

log = structlog.get_logger("dynamo_prep.frontend")

CACHED_ANSWERS = 1024
_VALID = ""


class SchemaChecks:
    """Runs metaschema checks in at most ``limits.check_processes`` processes; at most
    ``limits.check_queue`` more wait (then 503); each gets ``limits.check_timeout_s`` (then 400)."""

    def __init__(self, limits: SchemaLimits, metrics: FrontendMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self._idle: list[_Checker] = []
        self._slots = asyncio.Semaphore(limits.check_processes)
        self._waiting = 0
        self._answers: OrderedDict[bytes, str] = OrderedDict()
        self._reaping: set[asyncio.Task[None]] = set()
        self.in_flight = 0  # admitted checks, waiting or running

    async def check(self, uses: Sequence[SchemaUse]) -> None:
        """Raise the 400 of the first use whose schema is not valid under its metaschema."""
        for use in uses:
            problem = await self.problem(json.dumps(use.schema, ensure_ascii=False), use)
            if problem:
                error = use.refusal(problem)
                raise PreprocessError(str(error), param=error.param)

    async def problem(self, text: str, use: SchemaUse) -> str:
        """The metaschema problem of the schema ``text`` ("" when valid)."""
        key = hashlib.sha256(text.encode()).digest()
        known = self._answers.get(key)
        if known is not None:
            self._answers.move_to_end(key)
            self._count("cached")
            return known
        if self._waiting >= self.limits.check_queue:
            self._count("busy")
            raise OpenAIError(503, "too many JSON schemas are being checked right now; retry shortly")
        self._admit(+1)
        try:
            answer = await self._run(text, use)
        finally:
            self._admit(-1)
        self._answers[key] = answer
        if len(self._answers) > CACHED_ANSWERS:
            self._answers.popitem(last=False)
        self._count("invalid" if answer else "valid")
        return answer

    async def _run(self, text: str, use: SchemaUse) -> str:
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        checker: _Checker | None = None
        try:
            checker = self._idle.pop() if self._idle else await _Checker.start()
            async with asyncio.timeout(self.limits.check_timeout_s):
                answer = await checker.check(text.encode())
            self._idle.append(checker)
            return answer
        except TimeoutError:
            self._count("timeout")
            raise PreprocessError(
                f"Invalid {use.where}: the schema could not be checked within "
                f"{self.limits.check_timeout_s:g} s (--schema-limit check_timeout_s); simplify it",
                param=use.param,
            ) from None
        except asyncio.CancelledError:
            self._count("cancelled")
            raise
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._count("failed")
            log.error("schema_check_failed", error=repr(exc))
            raise OpenAIError(503, "the JSON schema could not be checked; retry shortly") from None
        finally:
            if checker is not None and checker not in self._idle:
                self._reap(checker)
            self._slots.release()

    def _reap(self, checker: _Checker) -> None:
        """Kill a checker whose check was abandoned, and wait for it in the background."""
        task = asyncio.ensure_future(checker.stop())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    def _admit(self, delta: int) -> None:
        self.in_flight += delta
        if self.metrics is not None:
            self.metrics.schema_checks_in_flight.inc(delta)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.schema_checks.labels(outcome=outcome).inc()

    async def close(self) -> None:
        """Stop every checker process."""
        idle, self._idle = self._idle, []
        await asyncio.gather(*(checker.stop() for checker in idle), *self._reaping, return_exceptions=True)


class _Checker:
    """One ``schema_process`` child and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls) -> _Checker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dynamo_prep.frontend.schema_process",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        checker = cls(process)
        try:
            await checker.answer()  # the ready frame
        except BaseException:
            await checker.stop()
            raise
        log.debug("schema_checker_started", pid=process.pid)
        return checker

    async def check(self, text: bytes) -> str:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(frame(text))
        await stdin.drain()
        return await self.answer()

    async def answer(self) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        size = int.from_bytes(await stdout.readexactly(HEADER_BYTES), "big")
        return (await stdout.readexactly(size)).decode() if size else _VALID

    async def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()
        log.debug("schema_checker_stopped", pid=self.process.pid)
