"""A request's chat template variables (``chat_template_kwargs``, ``chat_template_args``) as every
formatter takes them: bounded in size, and never setting a special-token variable.

Why and what else holds for them (their strings are traced like message text): docs/jinja-injection-safety.md,
"Template variables".
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NoReturn

import msgspec

from dynamo_prep.formatter.jinja.checkpoint import NAMED_SPECIAL_TOKENS
from dynamo_prep.limits import TEMPLATE_ARGS_LIMITS, TemplateArgsLimits
from dynamo_prep.prompt import PromptRenderError
from dynamo_prep.protocol.openai import TEMPLATE_ARGS_FIELDS, ChatCompletionRequest

__all__ = ["template_args_of"]


def template_args_of(
    request: ChatCompletionRequest,
    special_variables: Collection[str] = (),
    limits: TemplateArgsLimits = TEMPLATE_ARGS_LIMITS,
) -> dict[str, Any]:
    """``request.template_args()``, once each field is within ``limits`` and sets none of the named
    special tokens (``bos_token``, ...) nor any of ``special_variables`` (a 400 naming the field)."""
    for field in TEMPLATE_ARGS_FIELDS:
        value = getattr(request, field)
        if value:
            _check_size(field, value, limits)
            _check_names(field, value, special_variables)
    return request.template_args()


def _check_names(field: str, value: dict[str, Any], special_variables: Collection[str]) -> None:
    taken = sorted(key for key in value if key in NAMED_SPECIAL_TOKENS or key in special_variables)
    if taken:
        raise PromptRenderError(
            f"{field} cannot set {', '.join(taken)}: the model's special tokens come from its "
            "tokenizer, not from the request",
            param=field,
        )


def _check_size(field: str, value: Any, limits: TemplateArgsLimits) -> None:
    """Depth and item count in one walk that stops at the first excess, then the JSON's bytes."""
    items, pending = 0, [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > limits.max_depth:
            _refuse(field, f"is nested more than {limits.max_depth} levels deep")
        items += 2 * len(node) if isinstance(node, dict) else len(node)
        if items > limits.max_items:
            _refuse(field, f"holds more than {limits.max_items:,} keys and values")
        pending.extend((item, depth + 1) for item in (node.values() if isinstance(node, dict) else node))
    try:
        size = len(msgspec.json.encode(value))
    except (TypeError, ValueError, msgspec.EncodeError):
        _refuse(field, "is not JSON")
    if size > limits.max_bytes:
        _refuse(field, f"is {size:,} bytes of JSON, more than the limit of {limits.max_bytes:,}")


def _refuse(field: str, why: str) -> NoReturn:
    raise PromptRenderError(f"{field} {why}", param=field)
