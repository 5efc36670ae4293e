"""``JinjaFormatter``: OpenAI chat requests rendered through a model's Hugging Face chat template."""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from dynamo_prep.card import read_json
from dynamo_prep.formatter.jinja.bounds import RENDER_LIMITS, TemplateLimits, bounded
from dynamo_prep.formatter.jinja.checkpoint import (
    find_templates,
    image_token_of,
    registered_specials_from_config,
    special_tokens_from_config,
)
from dynamo_prep.formatter.jinja.environment import (
    compile_template,
    render_template,
    template_context,
    to_plain,
)
from dynamo_prep.formatter.jinja.injection import USER_INPUTS, SpecialTokens, injection_safe_segments
from dynamo_prep.formatter.jinja.messages import MessageRules, message_rules, vllm_messages
from dynamo_prep.formatter.template_args import template_args_of
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.prompt import PromptRenderError, RenderedPrompt, Segment
from dynamo_prep.protocol.openai import ChatCompletionRequest

__all__ = ["JinjaFormatter"]

_RESERVED_ARGS = ("messages", "tools")
# Formatters cutting at the same specials (the names of one checkpoint) share one SpecialTokens: its
# patterns and its segments, a few hundred objects the garbage collector walks, are paid once.
_SHARED_SPECIALS: weakref.WeakValueDictionary[tuple[tuple[str, ...], bool], SpecialTokens] = (
    weakref.WeakValueDictionary()
)
_SHARED_SPECIALS_LOCK = threading.Lock()  # models are built on several threads


class JinjaFormatter:
    """Renders OpenAI chat requests through a model's Hugging Face chat template.

    ``render`` returns injection-safe segments (``jinja.injection``) unless
    ``strict_hf_tokenization``; ``registered_specials`` are the model's special-token strings
    (``from_model_dir`` reads them from ``tokenizer_config.json``), the template's special-token
    variables are always among them. ``template_sources`` (given by ``from_template``) lets user
    strings that are mere pieces of a special skip tracing when no template writes partial specials.
    ``limits`` bound one request's renders together (the plain one and a traced one).
    """

    kind = "jinja"

    def __init__(
        self,
        template: jinja2.Template,
        special_tokens: Mapping[str, str],
        *,
        tool_use_template: jinja2.Template | None = None,
        image_token: str | None = None,
        exclude_tools_when_tool_choice_none: bool = True,
        registered_specials: Iterable[str] = (),
        strict_hf_tokenization: bool = False,
        template_sources: Sequence[str] | None = None,
        limits: TemplateLimits = RENDER_LIMITS,
        source: str = "<chat_template>",
    ) -> None:
        self._template = template
        self.source = source  # where the template was read (a file), for messages
        self.limits = limits
        self._tool_use_template = tool_use_template
        self.special_tokens = dict(special_tokens)
        self.rendered_token = image_token
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.strict_hf_tokenization = strict_hf_tokenization
        self._template_sources = template_sources
        self._specials = self._special_tokens(registered_specials)
        self._template_vars = to_plain(self.special_tokens)
        self._rules, self._tool_use_rules = _message_rules(template, tool_use_template, template_sources)

    def _special_tokens(self, registered: Iterable[str]) -> SpecialTokens:
        known = [*self.special_tokens.values(), *registered]
        if self.rendered_token:
            known.append(self.rendered_token)
        specials = SpecialTokens(known)
        if self._template_sources is not None:
            specials.inner_pieces = any(specials.fragments_in(source) for source in self._template_sources)
        with _SHARED_SPECIALS_LOCK:
            return _SHARED_SPECIALS.setdefault((specials.strings, specials.inner_pieces), specials)

    def with_tokenizer_specials(self, specials: Iterable[str]) -> JinjaFormatter:
        """This formatter cutting at every special the joined tokenizer registers.

        The tokenizer decides what is special: a template literal such as ``<|im_start|>`` must
        become its id even when the formatter was built from a bare template that did not list it.
        """
        merged = {*self._specials.strings, *specials}
        if len(merged) == len(self._specials.strings):
            return self
        bound = copy.copy(self)
        bound._specials = self._special_tokens(merged)
        return bound

    @property
    def registered_specials(self) -> tuple[str, ...]:
        """The special-token strings the render is cut at (longest first)."""
        return self._specials.strings

    @classmethod
    def from_template(
        cls,
        template: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        image_token: str | None = None,
        exclude_tools_when_tool_choice_none: bool = True,
        special_tokens: Mapping[str, str] | None = None,
        tool_use_template: str | None = None,
        source: str = "<chat_template>",
        registered_specials: Iterable[str] = (),
        strict_hf_tokenization: bool = False,
        limits: TemplateLimits = RENDER_LIMITS,
    ) -> JinjaFormatter:
        """A formatter for template text; only the tokens given become template variables.

        ``image_token`` counts images in the rendered prompt; it is not a template variable.
        """
        named = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "unk_token": unk_token,
            "pad_token": pad_token,
        }
        tokens = {k: v for k, v in named.items() if v is not None} | dict(special_tokens or {})
        tool_use = None if tool_use_template is None else compile_template(tool_use_template, source)
        return cls(
            compile_template(template, source),
            tokens,
            tool_use_template=tool_use,
            image_token=image_token,
            exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
            registered_specials=registered_specials,
            strict_hf_tokenization=strict_hf_tokenization,
            template_sources=(template,) if tool_use_template is None else (template, tool_use_template),
            limits=limits,
            source=source,
        )

    @classmethod
    def from_model_dir(
        cls,
        path: str | Path,
        *,
        config: Mapping[str, Any] | None = None,
        tokenizer_config: Mapping[str, Any] | None = None,
        exclude_tools_when_tool_choice_none: bool = True,
        strict_hf_tokenization: bool = False,
        limits: TemplateLimits = RENDER_LIMITS,
    ) -> JinjaFormatter:
        """A formatter from a model directory (or demo model name), as transformers would load it.

        ``config`` and ``tokenizer_config`` are the parsed ``config.json`` and
        ``tokenizer_config.json`` when the caller has already read them; otherwise they are read here
        (a missing ``config.json`` reads as empty).
        """
        model_dir = resolve_model_dir(path)
        if tokenizer_config is None:
            tokenizer_config = _tokenizer_config(model_dir)
        if config is None:
            config_path = model_dir / "config.json"
            config = read_json(config_path) if config_path.is_file() else {}
        templates = find_templates(model_dir, tokenizer_config)
        return cls.from_template(
            templates.default,
            special_tokens=special_tokens_from_config(tokenizer_config),
            image_token=image_token_of(model_dir, config, tokenizer_config),
            exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
            tool_use_template=templates.tool_use,
            source=templates.source,
            registered_specials=registered_specials_from_config(tokenizer_config),
            strict_hf_tokenization=strict_hf_tokenization,
            limits=limits,
        )

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **chat_template_args: Any,
    ) -> str:
        """The prompt text, exactly as ``apply_chat_template(..., tokenize=False)`` returns it."""
        template, context = self._context(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            documents=documents,
            **chat_template_args,
        )
        return render_template(template, context, self.limits)

    def render_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **chat_template_args: Any,
    ) -> RenderedPrompt:
        """``render_text`` plus injection-safe segments (None under strict HF tokenization)."""
        template, context = self._context(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            documents=documents,
            **chat_template_args,
        )
        with bounded(self.limits):  # the traced render, if any, shares this request's budget
            text = render_template(template, context, self.limits)
            if self.strict_hf_tokenization:
                image_count = text.count(self.rendered_token) if self.rendered_token else 0
                return RenderedPrompt(text=text, pieces=None, image_count=image_count)
            user_inputs = (*USER_INPUTS, *chat_template_args)  # the caller's variables are user text too
            segments = injection_safe_segments(template, context, text, self._specials, user_inputs)
        # only the template's image tokens count: a typed one is text, not an image slot
        image_count = segments.count(Segment(self.rendered_token, True)) if self.rendered_token else 0
        return RenderedPrompt(text=text, pieces=segments, image_count=image_count)

    def render(self, request: ChatCompletionRequest) -> RenderedPrompt:
        """Render a request: its messages as vLLM hands them to the template (``jinja.messages``), its
        tools unless tool_choice is none."""
        args = template_args_of(request, self.special_tokens)
        if reserved := [name for name in _RESERVED_ARGS if name in args]:
            raise PromptRenderError(
                f"chat_template_args cannot set {', '.join(reserved)}: they come from the request"
            )
        args.pop("add_generation_prompt", None)  # the request's own field wins, as vLLM merges them
        add_generation_prompt = request.add_generation_prompt
        if request.reasoning_effort is not None:  # vLLM's: the effort, and thinking unless asked otherwise
            args["reasoning_effort"] = request.reasoning_effort
            args.setdefault("enable_thinking", request.reasoning_effort != "none")
        tools = request.tools
        if request.tool_choice == "none" and self.exclude_tools_when_tool_choice_none:
            tools = None
        rules = self._tool_use_rules if tools is not None else self._rules
        messages = vllm_messages(request.messages, rules)
        return self.render_segments(messages, tools, add_generation_prompt=add_generation_prompt, **args)

    def _context(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        /,
        *,
        add_generation_prompt: bool,
        documents: Sequence[Mapping[str, Any]] | None,
        **chat_template_args: Any,
    ) -> tuple[jinja2.Template, dict[str, Any]]:
        template = self._template
        if tools is not None and self._tool_use_template is not None:
            template = self._tool_use_template
        context = template_context(
            messages,
            tools,
            documents,
            add_generation_prompt=add_generation_prompt,
            variables=self._template_vars,
            overrides=chat_template_args,
        )
        return template, context


def _message_rules(
    template: jinja2.Template, tool_use: jinja2.Template | None, sources: Sequence[str] | None
) -> tuple[MessageRules, MessageRules]:
    """vLLM's reading of the default template and of the tool-use one (the default's when absent)."""
    sources = sources or ()
    rules = message_rules(template.environment, sources[0] if sources else None)
    if tool_use is None:
        return rules, rules
    return rules, message_rules(tool_use.environment, sources[1] if len(sources) > 1 else None)


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` over ``special_tokens_map.json``, as transformers merges them; either
    may be missing (a ``tokenizer.json`` checkpoint needs neither)."""
    merged: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            merged.update(read_json(model_dir / name))
    return merged
