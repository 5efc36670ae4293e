"""Messages handed to a chat template: ours (``formatter.jinja.messages``) against vLLM 0.32's own code.

vLLM's side is its renderer's sequence, called directly: ``_detect_content_format`` and
``_detect_developer_role_support`` on the template, ``parse_chat_messages`` (its per-message parser and
``_postprocess_messages`` when images are present: the tracker would load a multimodal model),
then ``_convert_developer_to_system`` and ``_consolidate_system_messages`` as
``safe_apply_chat_template`` calls them. The lists must be equal, key order included, and our
``JinjaFormatter.render`` must print what transformers' ``render_jinja_template`` (what vLLM's
``apply_chat_template`` runs) prints for vLLM's list.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from strategies_messages import DETECTION_CASES, message_lists, ordered
from transformers.utils.chat_template_utils import render_jinja_template
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest
from vllm.renderers import chat_utils as vllm_chat
from vllm.renderers import hf as vllm_hf

from dynamo_prep.formatter.jinja import JinjaFormatter
from dynamo_prep.formatter.jinja import messages as ours
from dynamo_prep.formatter.jinja.environment import compile_template
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.openai import ChatCompletionRequest

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
DEMO_TEMPLATE = resolve_model_dir("qwen-vl-demo") / "chat_template.jinja"
SOURCES = {
    path.name: path.read_text(encoding="utf-8")
    for path in [*sorted(TEMPLATES.glob("*.jinja")), DEMO_TEMPLATE]
}
DEVELOPER_PROBE = (
    "{# knows 'developer' #}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
)
# Templates per content format (one naming the developer role), for the message-list comparison.
COMPARED = {
    "string": ["deepseek_v3_style.jinja", "loop_controls.jinja"],
    "openai": ["chatml_basic.jinja", "chat_template.jinja", "developer_probe"],
}
SOURCES["developer_probe"] = DEVELOPER_PROBE
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
# Template arguments the project's templates read (llama31's date, so that no clock is read).
KWARGS = {"date_string": "26 Jul 2024"}
MODEL_CONFIG = SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)


class _Images:
    """The multimodal tracker and parser of ``parse_chat_messages``, for images only, without a model:
    an image part is taken as it comes (a model's limits and processor are not compared here)."""

    model_config = MODEL_CONFIG

    def create_parser(self, mm_processor_kwargs: Any = None) -> _Images:
        return self

    def parse_image(self, image_url: str | None, uuid: str | None = None) -> None:
        pass

    def mm_placeholder_storage(self) -> dict[str, list[str]]:
        return {}


def vllm_format(source: str) -> str:
    detected: str = vllm_hf._detect_content_format(source, default="string")
    return detected


def vllm_conversation(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """What vLLM's HF renderer hands ``apply_chat_template`` for ``messages`` and this template (after
    its chat request model's message normalization: ``reasoning_content`` renamed ``reasoning``)."""
    messages = copy.deepcopy(messages)  # vLLM parses tool-call arguments in place
    messages = VllmChatRequest._normalize_messages_before({"messages": messages})["messages"]
    content_format = vllm_format(source)
    if vllm_chat.has_non_text_content(messages):
        conversation: list[Any] = []
        for message in messages:
            conversation.extend(
                vllm_chat._parse_chat_message_content(
                    message, _Images(), content_format, interleave_strings=False
                )
            )
        vllm_chat._postprocess_messages(conversation)
    else:
        conversation = vllm_chat.parse_chat_messages(messages, MODEL_CONFIG, content_format)[0]
    if any(message["role"] == "developer" for message in conversation) and not (
        vllm_hf._detect_developer_role_support(source)
    ):
        conversation = vllm_hf._consolidate_system_messages(
            vllm_hf._convert_developer_to_system(conversation)
        )
    return conversation


def our_conversation(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    rules = ours.message_rules(compile_template(source, "<test>").environment, source)
    return ours.vllm_messages(messages, rules)


def test_part_keys_read_by_vllm_are_ours() -> None:
    assert ours._KNOWN_PART_KEYS == vllm_chat._KNOWN_CONTENT_PART_FIELDS


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_template_rules_are_vllms(name: str) -> None:
    source = SOURCES[name]
    rules = ours.message_rules(compile_template(source, name).environment, source)
    assert rules.content_format == vllm_format(source)
    assert rules.knows_developer == vllm_hf._detect_developer_role_support(source)


@pytest.mark.parametrize(("source", "expected"), DETECTION_CASES)
def test_detection_cases_are_vllms(source: str, expected: str) -> None:
    assert vllm_format(source) == expected
    assert our_conversation([{"role": "user", "content": "x"}], source) == vllm_conversation(
        [{"role": "user", "content": "x"}], source
    )


def _template_names(images: bool) -> st.SearchStrategy[str]:
    return st.sampled_from(COMPARED["openai"] if images else [*COMPARED["string"], *COMPARED["openai"]])


@settings(max_examples=300, derandomize=True, deadline=None)
@given(data=st.data(), images=st.booleans())
def test_message_lists_equal_vllms(data: st.DataObject, images: bool) -> None:
    source = SOURCES[data.draw(_template_names(images))]
    messages = data.draw(message_lists(images=images))
    snapshot = copy.deepcopy(messages)
    mine, theirs = our_conversation(messages, source), vllm_conversation(messages, source)
    assert ordered(_calls_sorted(mine)) == ordered(_calls_sorted(theirs))
    assert ordered(messages) == ordered(snapshot)


def _calls_sorted(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls and developer tools with sorted keys: their order is the request model's (pydantic
    rebuilds them; compared below), not the raw parser's."""
    return [
        {
            key: [_sorted(item) for item in value] if key in ("tool_calls", "tools") and value else value
            for key, value in m.items()
        }
        for m in conversation
    ]


def _sorted(value: Any) -> Any:
    return {key: _sorted(value[key]) for key in sorted(value)} if isinstance(value, dict) else value


@settings(max_examples=200, derandomize=True, deadline=None)
@given(data=st.data())
def test_message_lists_equal_vllms_after_its_request_model(data: st.DataObject) -> None:
    """vLLM's server validates the request first (pydantic): what it keeps is parsed the same way."""
    source = SOURCES[data.draw(_template_names(images=True))]
    messages = data.draw(message_lists(images=True))
    try:
        validated = VllmChatRequest.model_validate({"model": "m", "messages": copy.deepcopy(messages)})
        kept = [_listed(message) for message in validated.messages]
    except ValidationError:
        return  # vLLM refuses the shape (dynamo_prep is more lenient: tested above on the raw shape)
    assert ordered(our_conversation(messages, source)) == ordered(vllm_conversation(kept, source))


def _listed(message: Any) -> Any:
    """A validated message with its content parts as a list (pydantic hands some as a lazily validating
    iterator, which vLLM's parser walks once the same way)."""
    content = message.get("content")
    if content is None or isinstance(content, str | list):
        return message
    return {**message, "content": list(content)}


def _as_transformers_5_24(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The message preprocessing of transformers 5.24's ``apply_chat_template``, which dynamo_prep's
    environment follows: None-valued keys dropped, reasoning also as ``thinking``. vLLM 0.32 pins
    transformers < 5.20, whose ``apply_chat_template`` does neither (docs/formatters.md)."""
    prepared = []
    for message in conversation:
        kept = {key: value for key, value in message.items() if value is not None}
        names = ("reasoning_content", "thinking", "reasoning")
        reasoning = next((kept[name] for name in names if kept.get(name) is not None), None)
        prepared.append(
            kept if reasoning is None else {"thinking": reasoning, **kept, "reasoning_content": reasoning}
        )
    return prepared


def _outcome(render: Any) -> tuple[str, str]:
    try:
        return ("text", render())
    except Exception as exc:  # either side: a template error, a refused shape
        return ("error", type(exc).__name__)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(data=st.data())
def test_rendered_text_equals_transformers_on_vllms_list(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(set(SOURCES) - {"developer_probe"})))
    source = SOURCES[name]
    images = vllm_format(source) == "openai"
    messages = data.draw(message_lists(images=images))
    add_generation_prompt = data.draw(st.booleans())
    formatter = JinjaFormatter.from_template(source, special_tokens=SPECIAL_TOKENS)
    request = ChatCompletionRequest(
        model="m", messages=messages, add_generation_prompt=add_generation_prompt, chat_template_kwargs=KWARGS
    )
    theirs = _outcome(
        lambda: render_jinja_template(
            conversations=[_as_transformers_5_24(vllm_conversation(messages, source))],
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
            **SPECIAL_TOKENS,
            **KWARGS,
        )[0][0]
    )
    mine = _outcome(lambda: formatter.render(request).text)
    assert mine[0] == theirs[0], (mine, theirs)
    if mine[0] == "text":
        assert mine == theirs
