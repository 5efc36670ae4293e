"""The event loop's share of hostile work (issue 13: ``/live`` within 50 ms during every attack;
``benchmarks/hostile.py`` measures it): a render that outruns its slice of the loop moves, whole,
to a thread. No timing is asserted: the slice is set to zero (every render with a loop in it
outruns it) or to a minute (none does)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.formatter.jinja import JinjaFormatter, RenderSliceSpent, TemplateLimitError, sliced
from dynamo_prep.formatter.jinja.bounds import RENDER_LIMITS, YIELD_AFTER_S, Budget
from dynamo_prep.frontend import offload
from dynamo_prep.frontend.offload import off_loop_if_slow
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessError
from dynamo_prep.tokenizer import Tokenizer

QWEN = DEMO_MODELS_DIR / "qwen-vl-demo"
# The slice is checked every 16 ticks: a render without loops or calls never reaches a check.
LOOPS = "{% for i in range(100) %}{% endfor %}"
CHAT = {"model": "qwen-vl-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def qwen(tmp_path: Path, first: str = LOOPS) -> OpenAIPreprocessor:
    """The qwen-vl-demo model whose template starts with ``first``."""
    model = tmp_path / "qwen-loops"
    shutil.copytree(QWEN, model)
    template = model / "chat_template.jinja"
    template.write_text(first + template.read_text(encoding="utf-8"))
    card = ModelDeploymentCard.from_model_dir(model)
    formatter = JinjaFormatter.from_model_dir(model)
    return OpenAIPreprocessor.new_with_parts(card, formatter, Tokenizer.from_model_dir(model))


def test_a_render_past_its_slice_is_neither_an_answer_nor_a_client_error(tmp_path: Path) -> None:
    preprocessor = qwen(tmp_path)
    expected = preprocessor.preprocess(CHAT).token_ids
    with sliced(0.0), pytest.raises(RenderSliceSpent):
        preprocessor.preprocess(CHAT)  # not a PreprocessError: the caller renders it elsewhere
    assert preprocessor.preprocess(CHAT).token_ids == expected  # the slice ended with its block


def test_a_template_limit_inside_a_slice_is_still_a_400(tmp_path: Path) -> None:
    with sliced(60.0), pytest.raises(PreprocessError) as caught:
        qwen(tmp_path, "{{ messages[0].content * 10**7 }}").preprocess(CHAT)
    assert isinstance(caught.value.__cause__, TemplateLimitError)


async def test_a_render_that_outruns_its_slice_runs_again_whole_in_a_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    preprocessor = qwen(tmp_path)
    threads: list[int] = []

    def work() -> list[int]:
        threads.append(threading.get_ident())
        return preprocessor.preprocess(CHAT).token_ids

    monkeypatch.setattr(offload, "LOOP_SLICE_S", 0.0)
    assert await off_loop_if_slow(work, in_thread=False) == preprocessor.preprocess(CHAT).token_ids
    assert len(threads) == 2 and threads[0] == threading.get_ident() != threads[1]

    threads.clear()
    monkeypatch.setattr(offload, "LOOP_SLICE_S", 60.0)
    await off_loop_if_slow(work, in_thread=False)
    assert threads == [threading.get_ident()]  # within its slice: once, on the loop


def test_a_long_render_in_a_thread_yields_and_one_on_the_main_thread_does_not() -> None:
    """Off the event loop's thread, a render running past ``YIELD_AFTER_S`` hands the GIL over at
    each clock read; on the main thread (the loop's) it never does."""
    assert Budget(RENDER_LIMITS).yield_after == float("inf")
    budgets: list[Budget] = []
    thread = threading.Thread(target=lambda: budgets.append(Budget(RENDER_LIMITS)))
    thread.start()
    thread.join()
    started = budgets[0].deadline - RENDER_LIMITS.seconds
    assert budgets[0].yield_after - started == pytest.approx(YIELD_AFTER_S)
