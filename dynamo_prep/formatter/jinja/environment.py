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

Bounded (``bounds``): the environment routes loops, calls, filters, ``*``/``**``/``+``/``%``, string
concatenation (``~``), container literals and output through a per-render ``Budget``, so a hostile
template is a ``TemplateLimitError`` (a 400) or a ``ChatTemplateError`` at compile time, never a
hang. Normal templates render byte for byte as before: the hooks only check, never change values.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.tests
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_prep.card import ModelCardError
from dynamo_prep.formatter.jinja.bounds import (
    MAX_TEMPLATE_CHARS,
    RENDER_LIMITS,
    TICKS_PER_CLOCK_READ,
    Budget,
    RenderSliceSpent,
    TemplateLimitError,
    TemplateLimits,
    bounded,
    compiling,
    current,
    log_limit,
)
from dynamo_prep.formatter.jinja.checks import STR_METHOD_CHECKS, bounded_filter, bounded_json
from dynamo_prep.prompt import PromptRenderError

__all__ = ["ChatTemplateError", "compile_template", "render_template", "template_context", "to_plain"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REASONING_KEYS = frozenset(_REASONING_FIELDS)
_SHORT = 256
_DICT_ATTRIBUTES = frozenset(dir(dict))
_LOOP_ATTRIBUTES = frozenset(
    {name for name in dir(jinja2.runtime.LoopContext) if not name.startswith("_")} | {"depth0"}
)
_HELD = "_dp_held"
_INLINED_READS = 1000  # the generated code's name for the object of an inlined attribute read


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
    return bounded_json(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_STRFTIME_WIDTH = re.compile(r"%[-_0^#]*(\d+)")


def _strftime_now(format: str) -> str:
    if isinstance(format, str):  # glibc pads ``%<width>Y``: a width is an allocation
        current().check("a date string", len(format) + sum(map(int, _STRFTIME_WIDTH.findall(format))))
    return datetime.now().strftime(format)


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator with the budget hooks: loops tick, built strings and literals are admitted.

    ``a + b`` is emitted as ``environment.admit(a + b)``: the check ``call_binop`` would make, without
    its dispatch (``+`` stays intercepted, so Jinja still never folds it).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: dict[int, jinja2.nodes.Node] = {}
        self._inlined = 0

    def visit(self, node: jinja2.nodes.Node, *args: Any, **kwargs: Any) -> Any:
        """A ``for``'s iterable is emitted as ``environment.bounded_iter(<iterable>)``, a direct call
        (Jinja allows no custom nodes, and a ``Call`` node would go through the sandbox's ``call``)."""
        if self._loop_iterables.get(id(node)) is node:
            self.write("environment.bounded_iter(")
            super().visit(node, *args, **kwargs)
            self.write(")")
            return None
        return super().visit(node, *args, **kwargs)

    def visit_Template(self, node: jinja2.nodes.Template, frame: jinja2.compiler.Frame | None = None) -> None:  # noqa: N802
        self._loop_iterables = {id(loop.iter): loop.iter for loop in node.find_all(jinja2.nodes.For)}
        super().visit_Template(node, frame)

    @jinja2.compiler.optimizeconst
    def visit_Getattr(self, node: jinja2.nodes.Getattr, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        """``obj.name`` on a plain dict holding ``name``, and a loop's public attributes, are read inline;
        anything else (other types, a missing key, a name ``dict`` has as an attribute) goes through
        ``environment.getattr``, whose answer in the inlined cases is the same."""
        if node.attr in _DICT_ATTRIBUTES or not self._inline():
            self.write("environment.getattr(")
            self.visit(node.node, frame)
            self.write(f", {node.attr!r})")
            return
        loop = (
            f"{_HELD}.{node.attr} if type({_HELD}) is LoopContext else "
            if node.attr in _LOOP_ATTRIBUTES
            else ""
        )
        self._dict_read(node.node, repr(node.attr), frame, f"{loop}environment.getattr")

    @jinja2.compiler.optimizeconst
    def visit_Getitem(self, node: jinja2.nodes.Getitem, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        """``obj['name']`` on a plain dict holding ``name`` is read inline; anything else goes through
        ``environment.getitem``, whose answer in that case is the same item."""
        key = node.arg
        if isinstance(key, jinja2.nodes.Const) and type(key.value) is str and self._inline():
            self._dict_read(node.node, repr(key.value), frame, "environment.getitem")
        else:
            super().visit_Getitem(node, frame)

    def _inline(self) -> bool:
        """Whether one more read may be inlined: an inlined read compiles to several times the Python
        of a call, so a template's first ``_INLINED_READS`` are (real templates have under 100)."""
        self._inlined += 1
        return self._inlined <= _INLINED_READS

    def _dict_read(
        self, obj: jinja2.nodes.Node, key: str, frame: jinja2.compiler.Frame, fallback: str
    ) -> None:
        """``obj[key]`` if ``obj`` is a plain dict holding ``key``, else ``fallback(obj, key)``; ``obj`` is
        evaluated once (held in a local)."""
        self.write(f"({_HELD}[{key}] if type({_HELD} := ")
        self.visit(obj, frame)
        self.write(f") is dict and {key} in {_HELD} else {fallback}({_HELD}, {key}))")

    def visit_Add(self, node: jinja2.nodes.BinExpr, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        self.write("environment.admit(")
        self.visit(node.left, frame)
        self.write(" + ")
        self.visit(node.right, frame)
        self.write(")")

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        self._admitted(super().visit_Concat, node, frame)

    def visit_List(self, node: jinja2.nodes.List, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        self._admitted(super().visit_List, node, frame)

    def visit_Dict(self, node: jinja2.nodes.Dict, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        self._admitted(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: jinja2.nodes.Tuple, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        if node.ctx != "load":  # an assignment target
            super().visit_Tuple(node, frame)
        else:
            self._admitted(super().visit_Tuple, node, frame)

    def _admitted(
        self,
        visit: Callable[[Any, jinja2.compiler.Frame], None],
        node: jinja2.nodes.Node,
        frame: jinja2.compiler.Frame,
    ) -> None:
        self.write("environment.admit(")
        visit(node, frame)
        self.write(")")


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, bounded, with fast paths that return exactly what the generic lookups return.

    ``message.role`` on a plain dict goes attribute-first in Jinja: ``getattr`` raises, then the
    item is read. A plain dict has no attributes beyond ``dir(dict)``, so for any other name the
    item lookup is the answer; loop variables (``loop.first``, ``loop.previtem``) are public
    properties the sandbox always allows. Rendering a chat template is mostly such lookups.

    Intercepted operators are never constant-folded (Jinja's rule for sandboxes), so
    ``{{ 7 ** 10000000 }}`` cannot run at compile time; at render time they are checked first.
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            return self.admit(left + right)
        budget = current()
        if operator == "**":
            budget.power(left, right)
        elif operator == "*":
            budget.product(left, right)
        else:
            budget.printf(left, right)
        return budget.admit(super().call_binop(context, operator, left, right))

    def admit(self, value: Any) -> Any:
        """A string or container the template built, checked against the render's budget. Short
        strings (the common case: tags and roles joined with ``+`` and ``~``) pass unchecked: only
        as many of them can be held as the template has names and containers, which are bounded."""
        if type(value) is str and len(value) < _SHORT:
            return value
        return current().admit(value)

    def bounded_iter(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """What a ``for`` iterates: a short list or tuple as it is, its iterations ticked at once (the
        clock is read before it, so no more iterations run between two reads than per-item ticking
        allows), anything else item by item."""
        budget = current()
        kind = type(iterable)
        if (kind is list or kind is tuple) and len(iterable) <= TICKS_PER_CLOCK_READ:  # type: ignore[arg-type]
            budget.tick_many(len(iterable))  # type: ignore[arg-type]
            return iterable
        return _ticking(iterable, budget)

    def concat(self, parts: Iterable[str]) -> str:
        """The output (and every block's): joined within ``max_chars`` (loops tick, chunks need not).
        A macro's buffer is a list already built: measured at once."""
        budget = current()
        limit = budget.limits.max_chars
        if type(parts) is list:
            size = sum(map(len, parts))
            if size > limit:
                budget.check("an output", size)
            budget.charge(size)
            return "".join(parts)
        chunks: list[str] = []
        append = chunks.append
        size = 0
        for part in parts:
            size += len(part)
            if size > limit:
                budget.check("an output", size)
            append(part)
        budget.charge(size)
        return "".join(chunks)

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
        """Template macros are always safe to call: skip the sandbox's format/safety probes for them
        (their output is bounded by ``concat``). Other calls are checked first where a string method
        could build something huge, and their results admitted."""
        budget = current()
        budget.tick()
        if type(__obj) is jinja2.runtime.Macro:
            if _passes_through(__obj, args, kwargs):
                try:
                    return __obj._func(*args)
                except StopIteration:  # what Context.call makes of it
                    return __self.undefined(
                        "value was undefined because a callable raised a StopIteration exception"
                    )
            return __context.call(__obj, *args, **kwargs)
        # str.format arrives wrapped by the sandbox (``__wrapped__`` is the bound method)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            check = STR_METHOD_CHECKS.get(getattr(__obj, "__name__", ""))
            if check is not None:
                args = check(budget, owner, args, kwargs)
        return budget.admit(super().call(__context, __obj, *args, **kwargs))


def _ticking(iterable: Iterable[Any], budget: Budget) -> Iterator[Any]:
    for item in iterable:
        budget.tick()
        yield item


_FRAME_KWARGS = frozenset({"_loop_vars", "_block_vars"})  # added by generated code, dropped by Context.call


def _passes_through(macro: jinja2.runtime.Macro, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Macro.__call__`` would call the macro's function with ``args`` unchanged: exactly its
    positional arguments, no caller, varargs or kwargs to collect, no autoescaping."""
    return (
        len(args) == macro._argument_count
        and not (macro.caller or macro.catch_kwargs or macro.catch_varargs or macro._default_autoescape)
        and kwargs.keys() <= _FRAME_KWARGS
        and not (args and isinstance(args[0], jinja2.nodes.EvalContext))
    )


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
    env.filters = {name: bounded_filter(name, function) for name, function in env.filters.items()}
    env.globals["lipsum"] = bounded_filter("lipsum", jinja2.utils.generate_lorem_ipsum)
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
    """The compiled template; any failure is a ``ChatTemplateError`` naming ``source`` (and the line of
    a syntax error). Bounded: ``MAX_TEMPLATE_CHARS`` of source, ``COMPILE_LIMITS`` on constant folding."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(
            f"{source}: chat template of {len(template):,} characters (the limit is {MAX_TEMPLATE_CHARS:,})"
        )
    try:
        with compiling() as budget:
            compiled = _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{source}: chat template syntax error at line {exc.lineno}: {exc.message}"
        ) from exc
    except Exception as exc:  # deep nesting, a literal Python cannot hold: the model fails to build
        raise ChatTemplateError(
            f"{source}: chat template cannot be compiled: {type(exc).__name__}: {exc}"
        ) from exc
    if budget.expired:
        _compile.cache_clear()  # do not keep a template that only compiled because folding gave up
        raise ChatTemplateError(
            f"{source}: compiling the chat template took over {budget.limits.seconds:g} s"
        )
    return compiled


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
        if type(message) is dict and _is_plain(message) and None not in message.values():
            plain = message  # the common case: already what the template may see
        elif isinstance(message, Mapping):
            plain = to_plain({key: value for key, value in message.items() if value is not None})
        else:
            raise PromptRenderError(f"Chat messages should be dicts, but got {message!r}.")
        if not _REASONING_KEYS.isdisjoint(plain):
            plain = _alias_reasoning(plain)
        prepared.append(plain)
    return prepared


_PLAIN_LEAVES = frozenset({str, int, float, bool, type(None)})


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is made of dicts with str keys, lists and plain leaves only: ``to_plain``
    would rebuild it equal, and the template, which cannot change a value, may see it as it is."""
    kind = type(value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or (type(item) not in _PLAIN_LEAVES and not _is_plain(item)):
                return False
        return True
    if kind is list:
        for item in value:  # noqa: SIM110 (a loop: all() over a generator is slower)
            if type(item) not in _PLAIN_LEAVES and not _is_plain(item):
                return False
        return True
    return kind in _PLAIN_LEAVES


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
    return [item if _is_plain(item) else to_plain(item) for item in items]


_GLOBALS: weakref.WeakKeyDictionary[jinja2.Template, dict[str, Any]] = weakref.WeakKeyDictionary()


def _new_context(template: jinja2.Template, context: dict[str, Any]) -> jinja2.runtime.Context:
    """``Template.new_context(context)`` as ``Template.render`` builds it, with the template's globals
    read into a dict once (its ``ChainMap`` would be walked in Python twice per render). Nothing
    changes an environment's globals after it compiles a template."""
    globals_ = _GLOBALS.get(template)
    if globals_ is None:
        globals_ = _GLOBALS[template] = dict(template.globals)
    environment = template.environment
    return environment.context_class(
        environment, dict(globals_, **context), template.name, template.blocks, globals=globals_
    )


def render_template(
    template: jinja2.Template, context: dict[str, Any], limits: TemplateLimits = RENDER_LIMITS
) -> str:
    """Render within ``limits`` (or the budget of the render this one is part of), turning every
    template failure into a PromptRenderError (a 400, never a raw exception)."""
    with bounded(limits):
        try:
            return template.environment.concat(template.root_render_func(_new_context(template, context)))
        except _TemplateRaised as exc:
            raise PromptRenderError(str(exc)) from exc
        except TemplateLimitError as exc:
            log_limit(exc)
            raise
        except RenderSliceSpent:
            raise
        except Exception as exc:
            raise PromptRenderError(f"chat template error: {type(exc).__name__}: {exc}") from exc
