"""The seeded slice of the hostile-input fuzz targets (``strategies_hostile.TARGETS``); the benchmark
run (``python -m benchmarks.fuzz --target tokenizer_split --target stop_strings --target chat_template``)
checks the same properties over >= 10,000 cases each."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from strategies_hostile import TARGETS
from test_fuzz import SEEDED

EXAMPLES = {"tokenizer_split": 150, "stop_strings": 300, "chat_template": 200}
DOCUMENTED = {
    "tokenizer_split": {"ok"},
    "stop_strings": {"ok", "rejected:PreprocessError"},
    "chat_template": {
        "ok",
        "rejected:PromptRenderError",
        "rejected:TemplateLimitError",
        "rejected:ChatTemplateError",
    },
}


@pytest.mark.parametrize("target", sorted(EXAMPLES))
def test_fuzz_target(target: str) -> None:
    """Only documented outcomes, the target's properties hold, and at least 5% of the cases are accepted."""
    strategy, check = TARGETS[target]
    outcomes: Counter[str] = Counter()

    @settings(SEEDED, max_examples=EXAMPLES[target])
    @given(strategy)
    def run(example: Any) -> None:
        outcomes[check(example)] += 1

    run()
    assert set(outcomes) <= DOCUMENTED[target], dict(outcomes)
    assert outcomes["ok"] >= EXAMPLES[target] // 20, dict(outcomes)


def test_every_target_is_seeded() -> None:
    assert set(EXAMPLES) == set(TARGETS) == set(DOCUMENTED)
