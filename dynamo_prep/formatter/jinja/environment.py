"""The environment and context of transformers' ``apply_chat_template`` (5.24.0), rebuilt without it.

A Jinja-templated model must get the prompt its checkpoint was trained on, so rendering matches
``tokenizer.apply_chat_template(messages, tools=..., tokenize=False, add_generation_prompt=...,
**kwargs)`` byte for byte (``utils/chat_template_utils.py``, ``tokenization_utils_base.py``):

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

Every failure a request can cause is a ``PromptRenderError`` (HTTP 400), never a raw exception.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.tests
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_prep.card import ModelCardError
from dynamo_prep.prompt import PromptRenderError

__all__ = ["ChatTemplateError", "compile_template", "render_template", "template_context", "to_plain"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_DICT_ATTRIBUTES = frozenset(dir(dict))


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


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with fast paths that return exactly what the generic lookups return.

    ``message.role`` on a plain dict goes attribute-first in Jinja: ``getattr`` raises, then the
    item is read. A plain dict has no attributes beyond ``dir(dict)``, so for any other name the
    item lookup is the answer; loop variables (``loop.first``, ``loop.previtem``) are public
    properties the sandbox always allows. Rendering a chat template is mostly such lookups.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if kind is jinja2.runtime.LoopContext and not attribute.startswith("_"):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """Template macros are always safe to call: skip the sandbox's format/safety probes for them."""
        if type(__obj) is jinja2.runtime.Macro:
            return __context.call(__obj, *args, **kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _test_mapping(value: Any) -> bool:
    """``is mapping`` without the ABC check for the common case (same answer)."""
    return type(value) is dict or jinja2.tests.test_mapping(value)


def _new_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers builds for every template (same options, filters, globals)."""
    if _version_tuple(jinja2.__version__) < (3, 1, 6):
        raise ChatTemplateError(
            f"chat templates need jinja2>=3.1.6 (sandbox fixes), found {jinja2.__version__}"
        )
    env = _ChatTemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationExtension, jinja2.ext.loopcontrols]
    )
    env.tests["mapping"] = _test_mapping
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


def compile_template(template: str, source: str) -> jinja2.Template:
    """The compiled template; a syntax error is a ``ChatTemplateError`` naming ``source`` and the line."""
    try:
        return _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{source}: chat template syntax error at line {exc.lineno}: {exc.message}"
        ) from exc


def to_plain(value: Any) -> Any:
    """Rebuild a value from plain JSON types, as transformers does before a template sees it."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is dict:  # the common case, with leaves inlined (this runs on every request)
        return {
            key if type(key) is str else to_plain(key): item if type(item) is str else to_plain(item)
            for key, item in value.items()
        }
    if kind is list:
        return [item if type(item) is str else to_plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {to_plain(key): to_plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(to_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: to_plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def template_context(
    messages: Sequence[Any],
    tools: Sequence[Any] | None,
    documents: Sequence[Any] | None,
    *,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """What transformers passes to the template: prepared inputs, then ``variables`` (the special
    tokens, already plain), then ``overrides`` (the caller's keyword arguments), later ones winning."""
    if "messages" in overrides:
        raise PromptRenderError("chat template arguments cannot set 'messages'")
    try:
        plain_overrides = to_plain(overrides) if overrides else {}
        return {
            "messages": _prepare_messages(messages),
            "tools": _prepare_objects(tools, _NOT_A_TOOL),
            "documents": _prepare_objects(documents, _NOT_A_DOCUMENT),
            "add_generation_prompt": add_generation_prompt,
            **variables,
            **plain_overrides,
        }
    except PromptRenderError:
        raise
    except RecursionError as exc:
        raise PromptRenderError("the request is nested too deeply to render") from exc
    except (TypeError, ValueError) as exc:
        raise PromptRenderError(f"the request cannot be rendered: {exc}") from exc


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
        plain = to_plain({key: value for key, value in message.items() if value is not None})
        prepared.append(_alias_reasoning(plain))
    return prepared


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


_NOT_A_TOOL = "Tools should be JSON schemas (objects)."
_NOT_A_DOCUMENT = "Documents should be a list of dicts with 'title' and 'text' keys!"


def _prepare_objects(items: Sequence[Any] | None, error: str) -> list[Any] | None:
    """Tools or documents: None stays None, every item must be a mapping (else ``error``), as plain data."""
    if items is None:
        return None
    for item in items:
        if not isinstance(item, Mapping):
            raise PromptRenderError(error)
    return [to_plain(item) for item in items]


def render_template(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render, turning every template failure into a PromptRenderError (a 400, never a raw exception)."""
    try:
        return template.render(**context)
    except _TemplateRaised as exc:
        raise PromptRenderError(str(exc)) from exc
    except Exception as exc:
        raise PromptRenderError(f"chat template error: {type(exc).__name__}: {exc}") from exc
