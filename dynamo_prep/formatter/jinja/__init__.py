"""Hugging Face chat templates, rendered without transformers and byte for byte like it.

``environment``: the sandbox and template context of ``apply_chat_template``; ``bounds``: what a
template may cost (a deadline, value and output sizes), enforced inside the render; ``checkpoint``:
the template and special tokens a model directory declares; ``injection``: segments in which only
the template's special tokens are control segments; ``formatter``: ``JinjaFormatter``.

Not covered: ``continue_final_message``, ``sanitize_control_tokens`` and callables as tools.
"""

from dynamo_prep.formatter.jinja.bounds import (
    RENDER_LIMITS,
    RenderSliceSpent,
    TemplateLimitError,
    TemplateLimits,
    sliced,
)
from dynamo_prep.formatter.jinja.checkpoint import registered_specials_from_config, special_tokens_from_config
from dynamo_prep.formatter.jinja.environment import ChatTemplateError
from dynamo_prep.formatter.jinja.formatter import JinjaFormatter

__all__ = [
    "RENDER_LIMITS",
    "ChatTemplateError",
    "JinjaFormatter",
    "RenderSliceSpent",
    "TemplateLimitError",
    "TemplateLimits",
    "registered_specials_from_config",
    "sliced",
    "special_tokens_from_config",
]
