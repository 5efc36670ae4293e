"""Kimi-K3 on vLLM: the checkpoint placeholder's stand-alone ids reach the engine as one contiguous
run per image, for every prompt shape (text glued to it on both sides, adjacent images, whitespace
and punctuation edges, long text), so no splice is needed in the worker; a prompt whose runs
differ from its images (a user typing the placeholder) is refused by the worker before vLLM."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.engines.base import EngineContractError
from dynamo_prep.engines.vllm.contract import check_placeholder_count, expanded_image_placeholder
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.kv_events import placeholder_starts
from dynamo_prep.tokenizer import Tokenizer

DEMO = "kimi-k3-demo"
PLACEHOLDER = expanded_image_placeholder(DEMO)
assert PLACEHOLDER == "<|kimi_image_placeholder|>"
PATTERN = tuple(Tokenizer.from_model_dir(DEMO).encode(PLACEHOLDER, allow_special=False))
PREPROCESSOR = OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir(DEMO), DEMO)  # declares nothing

# What may touch the placeholder: letters glued to it, its own characters, whitespace, punctuation.
EDGES = st.sampled_from(
    ["", "a", "<", "|", ">", "_", " ", "\n", "  ", "\t", ".", "!", "<|", "|>", "kimi", "é", "中"]
)
TEXT = st.builds(
    lambda left, middle, right, repeat: left + middle * repeat + right,
    EDGES,
    st.text(st.characters(blacklist_categories=["Cs"]), max_size=12),
    EDGES,
    st.sampled_from([1, 1, 1, 40]),
).filter(lambda text: bool(text) and "kimi_image_placeholder" not in text)
IMAGE: dict[str, Any] = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
PART = st.one_of(st.builds(lambda text: {"type": "text", "text": text}, TEXT), st.just(IMAGE))


def ids_and_images(messages: list[dict[str, Any]]) -> tuple[list[int], int]:
    request = PREPROCESSOR.preprocess({"model": DEMO, "messages": messages, "max_tokens": 4})
    return request.token_ids, len(request.images)


def test_the_placeholder_is_several_ids_so_merges_could_matter() -> None:
    assert len(PATTERN) > 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(PART, min_size=1, max_size=6), min_size=1, max_size=3))
def test_every_image_is_one_contiguous_run_of_the_stand_alone_ids(turns: list[list[dict[str, Any]]]) -> None:
    messages: list[dict[str, Any]] = []
    for index, parts in enumerate(turns):
        if index:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": parts})
    token_ids, images = ids_and_images(messages)
    assert len(placeholder_starts(token_ids, PATTERN)) == images
    check_placeholder_count(token_ids, PATTERN, PLACEHOLDER, images)  # what the vLLM worker checks


@pytest.mark.parametrize(
    "parts",
    [
        ["x", IMAGE, "y"],
        [IMAGE, IMAGE, IMAGE],
        ["<|", IMAGE, "|>"],
        ["kimi", IMAGE, "_image_placeholder|>"],
        [" ", IMAGE, "\n\n", IMAGE, "."],
        ["word " * 3000, IMAGE, "word " * 3000],
    ],
)
def test_named_shapes(parts: list[Any]) -> None:
    content = [{"type": "text", "text": part} if isinstance(part, str) else part for part in parts]
    token_ids, images = ids_and_images([{"role": "user", "content": content}])
    assert len(placeholder_starts(token_ids, PATTERN)) == images


def test_a_typed_placeholder_is_one_run_too_many_and_the_worker_refuses_it() -> None:
    content = [IMAGE, {"type": "text", "text": "what is this:"}, {"type": "text", "text": PLACEHOLDER}]
    token_ids, images = ids_and_images([{"role": "user", "content": content}])
    assert len(placeholder_starts(token_ids, PATTERN)) == images + 1
    with pytest.raises(EngineContractError, match="Expected 1 occurrence"):
        check_placeholder_count(token_ids, PATTERN, PLACEHOLDER, images)
