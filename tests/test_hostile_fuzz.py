"""The seeded slice of the hostile-input fuzz targets (``strategies_hostile.TARGETS``); the benchmark
run (``python -m benchmarks.fuzz --target tokenizer_split --target stop_strings --target chat_template``)
checks the same properties over >= 10,000 cases each."""

from __future__ import annotations

import pytest
from strategies_hostile import TARGETS
from test_fuzz import seeded_outcomes

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
    outcomes = seeded_outcomes(*TARGETS[target], EXAMPLES[target])
    assert set(outcomes) <= DOCUMENTED[target], dict(outcomes)
    assert outcomes["ok"] >= EXAMPLES[target] // 20, dict(outcomes)


def test_every_target_is_seeded() -> None:
    assert set(EXAMPLES) == set(TARGETS) == set(DOCUMENTED)
