"""Hugging Face chat templates, rendered without transformers and byte for byte like it.

A Jinja-templated model must get the prompt its checkpoint was trained on, so this module
reproduces ``tokenizer.apply_chat_template(messages, tools=..., tokenize=False,
add_generation_prompt=..., **kwargs)`` of transformers 5.24.0 (``utils/chat_template_utils.py``,
``tokenization_utils_base.py``). Quirks matched, each checked against that version:

* ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and a ``{% generation %}``
  block tag that renders its body unchanged; jinja2 >= 3.1.6 is required, as transformers does.
* ``tojson`` is ``json.dumps(x, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)`` (no HTML escaping; the template may pass those arguments).
* Globals: ``raise_exception(msg)`` (a TemplateError with the template's message),
  ``strftime_now(fmt)`` (local time, ``datetime.now()``), ``dict`` (a callable that only builds
  dicts) and ``namespace`` (refuses ``_``-prefixed attribute names).
* Messages: an empty conversation is refused; each message must be a dict; top-level keys whose
  value is None are dropped (nested None values are kept); then every value is rebuilt from plain
  JSON types (str/int/float subclasses lose their type, unknown objects become ``"<TypeName>"``),
  and a message with a non-None ``reasoning_content``/``thinking``/``reasoning`` (first found)
  becomes ``{"thinking": r, **message, "reasoning_content": r}`` (key order included).
* Template variables: ``messages``, ``tools`` (None when absent; each tool must be a dict),
  ``documents`` (None unless given), ``add_generation_prompt``, the tokenizer's special tokens
  (only those that are set: an unset ``pad_token`` is undefined, not None), and then the caller's
  keyword arguments, which override special tokens of the same name.
* Special tokens (``from_model_dir``): ``bos/eos/unk/sep/pad/cls/mask_token`` from
  ``tokenizer_config.json``, plus any other ``*_token`` key holding a token and the named
  ``extra_special_tokens`` map (e.g. ``image_token``), strings or AddedToken dicts.
* Template lookup: ``chat_template.jinja`` wins over ``tokenizer_config.json``'s
  ``chat_template``; a named list uses ``"tool_use"`` when tools are given and present, else
  ``"default"``.

Not covered: ``continue_final_message``, ``sanitize_control_tokens``, callables as tools, the
``chat_templates/`` directory, and ``special_tokens_map.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_prep.card import ModelCardError, read_json
from dynamo_prep.formatter._prompt import PromptRenderError, RenderedPrompt
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.openai import ChatCompletionRequest

__all__ = ["ChatTemplateError", "JinjaFormatter"]

TRANSFORMERS_VERSION_MATCHED = "5.24.0"
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_RESERVED_ARGS = ("messages", "tools")


class ChatTemplateError(ModelCardError):
    """A chat template cannot be found or compiled; the message names its source."""


class _TemplateRaised(jinja2.TemplateError):
    """``raise_exception`` from a template: its message is meant for the user."""


class _GenerationExtension(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' assistant-mask tag, rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 (Jinja reads this instance-level set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
        block.set_lineno(lineno)
        return block

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """``dict`` for templates: builds dicts without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore names, so templates cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick: ``namespace(self=...)`` must still work.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
            "Please rename the attribute."
        )


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: no HTML escaping, non-ASCII kept, json.dumps options exposed."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _new_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers builds for every template (same options, filters, globals)."""
    if _version_tuple(jinja2.__version__) < (3, 1, 6):
        raise ChatTemplateError(
            f"chat templates need jinja2>=3.1.6 (sandbox fixes), found {jinja2.__version__}"
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationExtension, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    """Compile once per template text (formatters for the same model share the compiled code)."""
    return _new_environment().from_string(template)


def _compile_named(template: str, source: str) -> jinja2.Template:
    try:
        return _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{source}: chat template syntax error at line {exc.lineno}: {exc.message}"
        ) from exc


def _plain(value: Any) -> Any:
    """Rebuild a value from plain JSON types, as transformers does before a template sees it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """transformers' message preprocessing: drop None-valued keys, plain data, reasoning aliases."""
    if not messages:
        raise PromptRenderError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise PromptRenderError(f"Chat messages should be dicts, but got {message!r}.")
        plain = _plain({key: value for key, value in message.items() if value is not None})
        prepared.append(_alias_reasoning(plain))
    return prepared


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _prepare_tools(tools: Sequence[Any] | None) -> list[Any] | None:
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise PromptRenderError("Tools should be JSON schemas (objects).")
    return [_plain(tool) for tool in tools]


def _prepare_documents(documents: Sequence[Any] | None) -> list[Any] | None:
    if documents is None:
        return None
    for document in documents:
        if not isinstance(document, Mapping):
            raise PromptRenderError("Documents should be a list of dicts with 'title' and 'text' keys!")
    return [_plain(document) for document in documents]


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render, turning every template failure into a PromptRenderError (a 400, never a raw exception)."""
    try:
        return template.render(**context)
    except _TemplateRaised as exc:
        raise PromptRenderError(str(exc)) from exc
    except jinja2.TemplateError as exc:
        raise PromptRenderError(f"chat template error: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise PromptRenderError(f"chat template error: {type(exc).__name__}: {exc}") from exc


def _token_text(value: object, *, strict: bool = False) -> str | None:
    """A token from tokenizer_config: a string, or an AddedToken dict (``{"content": ...}``).

    ``strict`` wants the ``"__type": "AddedToken"`` marker, as transformers does for tokens
    it only picks up because their key ends in ``_token``.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        return None
    if strict and value.get("__type") != "AddedToken":
        return None
    return str(value["content"])


def special_tokens_from_config(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens transformers passes to templates, read from ``tokenizer_config.json``."""
    tokens: dict[str, str] = {}
    for key, value in tokenizer_config.items():
        if key in NAMED_SPECIAL_TOKENS or key.endswith("_token"):
            text = _token_text(value, strict=key not in NAMED_SPECIAL_TOKENS)
            if text is not None:
                tokens[key] = text
    extra = tokenizer_config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if (text := _token_text(value)) is not None:
                tokens[str(key)] = text
    return tokens


def _templates_from_config(value: object, source: str) -> dict[str, str]:
    """``chat_template`` as a string or HF's named list ``[{"name": ..., "template": ...}]``."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        templates = {k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str)}
        if len(templates) == len(value):
            return templates
    raise ChatTemplateError(
        f"{source}: chat_template must be a string or a list of {{name, template}} objects"
    )


def _find_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """Templates by name and their source; ``chat_template.jinja`` wins, as in transformers."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}, str(jinja_file)
    source = str(model_dir / "tokenizer_config.json")
    if tokenizer_config.get("chat_template") is None:
        raise ChatTemplateError(
            f"{model_dir}: no chat template "
            "(expected chat_template.jinja or a chat_template entry in tokenizer_config.json)"
        )
    return _templates_from_config(tokenizer_config["chat_template"], source), source


def _image_token(config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> str | None:
    """config.json ``image_token``, else ``image_token_id`` looked up in ``added_tokens_decoder``."""
    if isinstance(token := config.get("image_token"), str):
        return token
    token_id = config.get("image_token_id")
    decoder = tokenizer_config.get("added_tokens_decoder")
    if isinstance(token_id, int) and isinstance(decoder, dict):
        return _token_text(decoder.get(str(token_id)))
    return None


class JinjaFormatter:
    """Renders OpenAI chat requests through a model's Hugging Face chat template."""

    kind = "jinja"

    def __init__(
        self,
        template: jinja2.Template,
        special_tokens: Mapping[str, str],
        *,
        tool_use_template: jinja2.Template | None = None,
        image_token: str | None = None,
        exclude_tools_when_tool_choice_none: bool = True,
    ) -> None:
        self._template = template
        self._tool_use_template = tool_use_template
        self.special_tokens = dict(special_tokens)
        self.image_token = image_token
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none

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
        tool_use = None if tool_use_template is None else _compile_named(tool_use_template, source)
        return cls(
            _compile_named(template, source),
            tokens,
            tool_use_template=tool_use,
            image_token=image_token,
            exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
        )

    @classmethod
    def from_model_dir(
        cls, path: str | Path, *, exclude_tools_when_tool_choice_none: bool = True
    ) -> JinjaFormatter:
        """A formatter from a model directory (or demo model name), as transformers would load it."""
        model_dir = resolve_model_dir(path)
        tokenizer_config = read_json(model_dir / "tokenizer_config.json")
        config_path = model_dir / "config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        templates, source = _find_templates(model_dir, tokenizer_config)
        if "default" not in templates:
            names = ", ".join(sorted(templates))
            raise ChatTemplateError(f"{source}: named chat templates ({names}) have no 'default'")
        return cls.from_template(
            templates["default"],
            special_tokens=special_tokens_from_config(tokenizer_config),
            image_token=_image_token(config, tokenizer_config),
            exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
            tool_use_template=templates.get("tool_use"),
            source=source,
        )

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **chat_template_args: Any,
    ) -> str:
        """The prompt text, exactly as ``apply_chat_template(..., tokenize=False)`` returns it."""
        if "messages" in chat_template_args:
            raise PromptRenderError("chat template arguments cannot set 'messages'")
        template = self._template
        if tools is not None and self._tool_use_template is not None:
            template = self._tool_use_template
        context = {
            "messages": _prepare_messages(messages),
            "tools": _prepare_tools(tools),
            "documents": _prepare_documents(documents),
            "add_generation_prompt": add_generation_prompt,
            **_plain({**self.special_tokens, **chat_template_args}),
        }
        return _render(template, context)

    def render(self, request: ChatCompletionRequest) -> RenderedPrompt:
        """Render a request: image parts as HF processors expect, tools unless tool_choice is none."""
        args = request.template_args()
        if reserved := [name for name in _RESERVED_ARGS if name in args]:
            raise PromptRenderError(
                f"chat_template_args cannot set {', '.join(reserved)}: they come from the request"
            )
        add_generation_prompt = args.pop("add_generation_prompt", request.add_generation_prompt)
        tools = request.tools
        if request.tool_choice == "none" and self.exclude_tools_when_tool_choice_none:
            tools = None
        messages = [_hf_message(message) for message in request.messages]
        text = self.render_text(messages, tools, add_generation_prompt=add_generation_prompt, **args)
        image_count = text.count(self.image_token) if self.image_token else 0
        return RenderedPrompt(text=text, segments=None, image_count=image_count)


def _hf_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts the way HF processors expect them: ``image_url`` -> ``{"type": "image"}``."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": list(_hf_parts(content))}


def _hf_parts(parts: list[Any]) -> Iterator[Any]:
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "image_url":
            yield {"type": "image"}
        else:
            yield part
