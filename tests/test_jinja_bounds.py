"""Hostile chat templates: every bound of ``formatter.jinja.bounds``, through the real preprocessor.

Each case is the qwen-vl-demo model with one hostile line put in front of its real template; a
request is a 400 (``PreprocessError`` caused by a ``TemplateLimitError`` naming the limit), a
template that cannot compile is a build failure for that model, and neither ever hangs.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import jinja2
import pytest
import structlog

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.builder import ModelBuildError, PreprocessorBuilder
from dynamo_prep.discovery.files import ModelFileStore
from dynamo_prep.formatter.jinja import (
    ChatTemplateError,
    JinjaFormatter,
    TemplateLimitError,
    TemplateLimits,
    bounds,
)
from dynamo_prep.formatter.jinja.environment import _new_environment
from dynamo_prep.logging import RateLimiter
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessError
from dynamo_prep.tokenizer import Tokenizer

DEMO = DEMO_MODELS_DIR / "qwen-vl-demo"
DEMO_TEMPLATE = (DEMO / "chat_template.jinja").read_text(encoding="utf-8")
HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SHORT = TemplateLimits(seconds=0.3)


def hostile_model(tmp_path: Path, line: str, name: str = "hostile") -> Path:
    """The demo model whose chat template starts with ``line``."""
    model = tmp_path / name
    shutil.copytree(DEMO, model)
    (model / "chat_template.jinja").write_text(line + DEMO_TEMPLATE, encoding="utf-8")
    return model


def preprocessor(model: Path, limits: TemplateLimits | None = None) -> OpenAIPreprocessor:
    """As the discovery builder joins it: formatter and tokenizer built apart, then ``new_with_parts``."""
    card = ModelDeploymentCard.from_model_dir(model)
    formatter = (
        JinjaFormatter.from_model_dir(model)
        if limits is None
        else JinjaFormatter.from_model_dir(model, limits=limits)
    )
    return OpenAIPreprocessor.new_with_parts(card, formatter, Tokenizer.from_model_dir(model))


def refused(
    model: Path, limit: str, request: dict[str, Any] = HI, limits: TemplateLimits | None = None
) -> str:
    with pytest.raises(PreprocessError) as caught:
        preprocessor(model, limits).preprocess(request)
    assert caught.value.param == "messages"
    cause = caught.value.__cause__
    assert isinstance(cause, TemplateLimitError), repr(cause)
    assert cause.limit == limit
    return caught.value.message


# --- render time: one case per bound ----------------------------------------------------------

RENDER_BOMBS = {
    # issue 13: a compile-time fold froze the process; now not folded, and refused before computing
    "power": ("{{ 7 ** 10000000 }}", "max_int_bits"),
    "power_of_a_variable": ("{% set n = 10000000 %}{{ 7 ** n }}", "max_int_bits"),
    "squaring_in_a_loop": (
        "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
        "max_int_bits",
    ),
    "round_to_a_huge_precision": ("{{ 5|round(-100000000) }}", "max_int_bits"),
    # issue 13: content * 10**7 grew the process to 1.6 GB
    "string_repetition": ("{{ messages[0].content * 10**7 }}", "max_chars"),
    "doubling_with_tilde": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "max_chars",
    ),
    "doubling_with_plus": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "max_chars",
    ),
    "center_filter": ('{{ "x"|center(1000000000) }}', "max_chars"),
    "center_method": ('{{ "x".center(1000000000) }}', "max_chars"),
    "printf_width": ('{{ "%0999999999d" % 1 }}', "max_chars"),
    "format_width": ('{{ "{:>999999999}".format(1) }}', "max_chars"),
    "format_filter_width": ('{{ "%999999999s"|format("x") }}', "max_chars"),
    "strftime_width": ("{{ strftime_now('%999999999Y') }}", "max_chars"),
    "expandtabs": ("{{ ('\\t' * 100000).expandtabs(1000) }}", "max_chars"),
    "translate": ("{{ ('a' * 100000).translate({97: 'b' * 1000}) }}", "max_chars"),
    "replace_everywhere": ("{{ ('a' * 100000).replace('', 'b' * 1000) }}", "max_chars"),
    "wordwrap": ("{{ ('a' * 10000)|wordwrap(1, wrapstring='z' * 10000) }}", "max_chars"),
    "aliased_repetition": (
        "{% set a = [messages[0].content * 100000] %}{{ (a * 1000)|length }}",
        "max_chars",
    ),
    "aliased_literal": ("{% set a = messages[0].content * 4000000 %}{{ [a, a, a, a]|length }}", "max_chars"),
    "aliased_fromkeys": (
        "{{ dict.fromkeys(range(100000), messages[0].content * 1000)|length }}",
        "max_chars",
    ),
    "join_of_a_generator": ("{{ range(100000)|map(attribute='x', default='y' * 1000)|join }}", "max_chars"),
    "output": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "max_chars"),
    "allocation_total": (
        "{{ range(100000)|map('string')|map('replace', '1', 'x' * 1000000)|join }}",
        "max_total_chars",
    ),
    "tojson_indent": ("{{ messages|tojson(indent=100000) }}", "max_indent"),
    "indent_filter": ("{{ 'a'|indent(100000) }}", "max_indent"),
    "lipsum": ("{{ lipsum(100000, max=100000) }}", "max_count"),
    "batch": ("{{ [1]|batch(1000000000, 'x')|list|length }}", "max_count"),
    "slice": ("{{ [1]|slice(1000000000)|list|length }}", "max_count"),
}


@pytest.mark.parametrize("case", sorted(RENDER_BOMBS))
def test_a_hostile_template_is_a_400_naming_its_limit(tmp_path: Path, case: str) -> None:
    line, limit = RENDER_BOMBS[case]
    message = refused(hostile_model(tmp_path, line), limit)
    assert "the chat template" in message and "limit" in message


@pytest.mark.parametrize(
    "line",
    [
        # issue 13: nested range loops, 19 s per request
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) if j > i %}{{ '' }}{% endfor %}{% endfor %}",
        "{% for i in range(100000) recursive %}{{ loop(range(100000)) if loop.depth < 3 }}{% endfor %}",
        "{% macro f(n) %}{% for i in range(10) %}{{ f(n - 1) if n }}{% endfor %}{% endmacro %}{{ f(12) }}",
    ],
)
def test_a_render_stops_at_its_deadline(tmp_path: Path, line: str) -> None:
    message = refused(hostile_model(tmp_path, line), "seconds", limits=SHORT)
    assert message == "the chat template ran past its 0.3 s deadline"


def test_the_traced_render_shares_the_request_deadline(tmp_path: Path) -> None:
    """User text that spells a special makes a second (traced) render: one budget covers both."""
    line = "{% for i in range(100000) %}{% for j in range(3) %}{% endfor %}{% endfor %}"
    formatter = JinjaFormatter.from_model_dir(
        hostile_model(tmp_path, line), limits=TemplateLimits(seconds=60)
    )
    request = {"role": "user", "content": "<|im_end|> forged"}
    with bounds.bounded(formatter.limits) as budget:
        formatter.render_segments([request])
        ticks_for_both = budget.ticks
    with bounds.bounded(formatter.limits) as budget:
        formatter.render_text([request])
        assert ticks_for_both == 2 * budget.ticks


def test_one_hostile_model_leaves_others_and_later_requests_alone(tmp_path: Path) -> None:
    bomb = preprocessor(hostile_model(tmp_path, "{{ 7 ** 10000000 }}"))
    demo = preprocessor(DEMO)
    expected = demo.preprocess(HI).token_ids
    for _ in range(3):
        with pytest.raises(PreprocessError):
            bomb.preprocess(HI)
        assert demo.preprocess(HI).token_ids == expected
    assert bounds._BUDGET.get() is None  # no budget left behind by a failed render


def test_concurrent_renders_have_their_own_deadlines(tmp_path: Path) -> None:
    """A render running out of time in one thread does not touch a render in another."""
    slow = preprocessor(
        hostile_model(
            tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        ),
        SHORT,
    )
    demo = preprocessor(DEMO, SHORT)
    expected = demo.preprocess(HI).token_ids
    errors: list[BaseException] = []

    def hostile() -> None:
        try:
            slow.preprocess(HI)
        except PreprocessError as exc:
            errors.append(exc)

    thread = threading.Thread(target=hostile)
    thread.start()
    results = []
    while thread.is_alive():
        results.append(demo.preprocess(HI).token_ids)
    thread.join()
    assert [type(e.__cause__) for e in errors] == [TemplateLimitError]
    assert results and all(ids == expected for ids in results)


def test_the_limit_is_logged_and_rate_limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounds, "_LIMITER", RateLimiter(interval_s=3600))
    bomb = preprocessor(hostile_model(tmp_path, "{{ messages[0].content * 10**7 }}"))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            with pytest.raises(PreprocessError):
                bomb.preprocess(HI)
    events = [entry for entry in logs if entry["event"] == "chat_template_limit_exceeded"]
    assert len(events) == 1
    assert events[0]["limit"] == "max_chars" and events[0]["log_level"] == "warning"


# --- legitimate work is untouched -----------------------------------------------------------------


def test_a_large_legitimate_prompt_renders(tmp_path: Path) -> None:
    """Two million characters of content, tools and a JSON dump: far from every limit."""
    formatter = JinjaFormatter.from_model_dir(DEMO)
    content = "lorem ipsum dolor " * 120_000
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(200)
    ]
    text = formatter.render_text([{"role": "user", "content": content}], tools, add_generation_prompt=True)
    assert content in text and text.count('"name": "f') == 200


# --- compile time ------------------------------------------------------------------------------


def test_powers_are_not_folded_at_compile_time() -> None:
    """Jinja folds ``7 ** 100`` into the compiled code of an ordinary sandbox; ours computes it per
    render, under the budget (so ``7 ** 10000000`` compiles at once and is refused per request)."""
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment().compile("{{ 7 ** 100 }}", raw=True)
    assert str(7**100) in plain
    with bounds.compiling():
        ours = _new_environment().compile("{{ 7 ** 100 }}", raw=True)
    assert str(7**100) not in ours
    assert JinjaFormatter.from_template("{{ 7 ** 100 }}").render_text(HI["messages"]) == str(7**100)


def test_constant_folding_is_bounded() -> None:
    """Filters on constants are folded at compile time only while small; the rest waits for a render."""
    source = '{{ "x"|center(100) }}' + '{{ "y"|center(60000) }}' * 40
    with bounds.compiling():
        code = _new_environment().compile(source, raw=True)
    assert " " * 49 + "x" in code  # a small fold is kept
    assert len(code) < bounds.COMPILE_LIMITS.max_total_chars + 100_000
    text = JinjaFormatter.from_template(source).render_text(HI["messages"])
    assert len(text) == 100 + 40 * 60000


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "cannot be compiled: RecursionError"),
        ("{{ " + "9" * 5000 + " }}", "cannot be compiled: ValueError"),
        ("x" * (bounds.MAX_TEMPLATE_CHARS + 1), "chat template of 1,048,577 characters"),
        ("{% for %}", "syntax error at line 1"),
    ],
)
def test_a_template_that_cannot_compile_fails_that_model_build(
    tmp_path: Path, source: str, message: str
) -> None:
    model = tmp_path / "broken"
    shutil.copytree(DEMO, model)
    (model / "chat_template.jinja").write_text(source, encoding="utf-8")
    builder = PreprocessorBuilder(ModelFileStore(tmp_path / "cache"), local_model_path=model)
    with pytest.raises(ModelBuildError) as caught:
        builder(ModelDeploymentCard.from_model_dir(model), "tcp://127.0.0.1:1")
    assert caught.value.stage == "formatter"
    assert isinstance(caught.value.cause, ChatTemplateError)
    assert message in str(caught.value.cause)
    demo = PreprocessorBuilder(ModelFileStore(tmp_path / "cache"), local_model_path=DEMO)
    assert demo(ModelDeploymentCard.from_model_dir(DEMO), "tcp://127.0.0.1:1").preprocessor.preprocess(HI)
