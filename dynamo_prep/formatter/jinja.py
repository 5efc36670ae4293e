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

Injection safety (``render`` returns segments; ``strict_hf_tokenization=False``, the default)
-------------------------------------------------------------------------------------------
transformers tokenizes the rendered string whole with special tokens allowed, so a user who types
``<|im_end|>`` or ``<|vision_start|><|image_pad|><|vision_end|>`` in a message, a name, tool-call
arguments or a tool result gets real control ids: a forged turn, a forged image slot. Here the
text stays byte-identical to transformers' render and only the ids of such forged specials change:

* Segments. The rendered text is cut at the special-token strings the TEMPLATE emitted (control
  segments, one special each); everything between them (template text and user text together) is
  one text segment, encoded with special-looking text as plain BPE. Because tiktoken's own
  whole-string encoding also cuts at specials and encodes the runs between them, the ids equal
  transformers' ids exactly unless user text spells a special, and then only that span differs.
* Which strings are user strings: every string (values and keys) in the messages and the tools,
  except ``role`` and ``type`` values from the OpenAI vocabulary (so ``'<|' + role + '|>'``
  templates keep their specials; any other role is user text).
* Fast path. A user string can only take part in a special occurrence if it contains the first
  or last character of some special (case-insensitively), or is itself a piece of a special: a
  string that overlaps an occurrence either lies inside it or covers one of its ends. The second
  case needs a template that writes the ends of a special around user text (``'<|' + x + '|>'``),
  so it is only checked when the template source holds such partial specials. When no user
  string is suspicious (ordinary prose), every special in the render is the template's: one
  plain render, cut at the specials.
* Traced path. Otherwise the template is rendered a second time with each suspicious user string
  wrapped in two private-use sentinels (chosen per request, absent from the input). The wrapped
  value is a ``str`` subclass whose methods and operators act on the unwrapped text (``len``,
  ``strip``/``trim``, ``split``, slicing, ``startswith``, ``in``, ``==``, hashing, iteration), so
  the template takes the same decisions; ``tojson`` and concatenation carry the sentinels along.
  The sentinel-stripped render must equal the plain render byte for byte, and the sentinels must
  nest; then sentinel spans are user text and specials are matched only outside them.
* Fallback. When the traced render differs from the plain one (the template transformed a user
  string in a way the sentinels cannot follow, e.g. ``|wordwrap`` or a comparison on a
  concatenated copy), the request is refused with a ``PromptRenderError`` (HTTP 400) saying so:
  it never silently falls back to whole-string encoding. That needs both such a template and
  special-looking user text.
* Not detected: a template that slices an ordinary user string and rebuilds a special token from
  the slice and its own partial-special text (``'<|' + content[1:-1] + '|>'``); no known template
  does this.

``strict_hf_tokenization=True`` returns ``segments=None``: the preprocessor then encodes the text
whole with specials allowed, exactly as transformers does, forged specials included. Choose it
only when id-for-id parity on special-looking user text matters more than the turn structure.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.tests
import jinja2.utils
import msgspec
import structlog
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_prep.card import ModelCardError, read_json
from dynamo_prep.formatter._prompt import PromptRenderError, RenderedPrompt, Segment
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.openai import ChatCompletionRequest

__all__ = ["ChatTemplateError", "JinjaFormatter"]

log = structlog.get_logger("dynamo_prep.formatter.jinja")

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
# role/type values that are structure, not user text (any other value is treated as user text)
STRUCTURAL_VALUES: Mapping[str, frozenset[str]] = {
    "role": frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"}),
    "type": frozenset(
        {"text", "image", "image_url", "video", "video_url", "audio", "input_audio", "function"}
    ),
}
# (start, end) sentinel pairs tried in order; the first pair absent from the request is used
_SENTINEL_PAIRS = (("\ue000", "\ue001"), ("\U000f0000", "\U000f0001"), ("\U00100000", "\U00100001"))
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


def _compile_named(template: str, source: str) -> jinja2.Template:
    try:
        return _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{source}: chat template syntax error at line {exc.lineno}: {exc.message}"
        ) from exc


def _plain(value: Any) -> Any:
    """Rebuild a value from plain JSON types, as transformers does before a template sees it."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is dict:  # the common case, with leaves inlined (this runs on every request)
        return {
            key if type(key) is str else _plain(key): item if type(item) is str else _plain(item)
            for key, item in value.items()
        }
    if kind is list:
        return [item if type(item) is str else _plain(item) for item in value]
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


def registered_specials_from_config(tokenizer_config: Mapping[str, Any]) -> list[str]:
    """Every special-token string a tokenizer built from ``tokenizer_config.json`` registers."""
    strings = list(special_tokens_from_config(tokenizer_config).values())
    decoder = tokenizer_config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        strings.extend(text for entry in decoder.values() if (text := _token_text(entry)) is not None)
    additional = tokenizer_config.get("additional_special_tokens")
    if isinstance(additional, list):
        strings.extend(text for entry in additional if (text := _token_text(entry)) is not None)
    return strings


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


# ----------------------------------------------------------------------------- injection safety


class _Marked(str):
    """A user string wrapped in sentinels, behaving for the template like the unwrapped string.

    The str value (what ``str()``, concatenation, ``tojson`` and output see) carries the
    sentinels; every method and operator a template can reach works on the unwrapped text and
    wraps the strings it derives, so control flow and filters decide as on the plain render.
    """

    _inner: str
    _pair: tuple[str, str]

    def __new__(cls, inner: str, pair: tuple[str, str]) -> _Marked:
        marked = super().__new__(cls, pair[0] + inner + pair[1])
        marked._inner = inner
        marked._pair = pair
        return marked

    def _wrap(self, value: Any) -> Any:
        if type(value) is str:
            return _Marked(value, self._pair) if value else value
        if isinstance(value, list | tuple):
            return type(value)(self._wrap(item) for item in value)
        return value

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[str]:
        return (_Marked(char, self._pair) for char in self._inner)

    def __getitem__(self, key: Any) -> Any:
        return self._wrap(self._inner[key])

    def __hash__(self) -> int:
        return hash(self._inner)

    def __repr__(self) -> str:  # printing a list or dict of user strings keeps them traced
        return self._pair[0] + repr(self._inner) + self._pair[1]

    def __contains__(self, item: object) -> bool:
        return _unmarked(item) in self._inner


def _unmarked(value: Any) -> Any:
    return value._inner if isinstance(value, _Marked) else value


def _derived(name: str) -> Callable[..., Any]:
    method = getattr(str, name)

    def call(self: _Marked, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(method(self._inner, *map(_unmarked, args), **kwargs))

    call.__name__ = name
    return call


def _query(name: str) -> Callable[..., Any]:
    method = getattr(str, name)

    def call(self: _Marked, *args: Any, **kwargs: Any) -> Any:
        return method(self._inner, *map(_unmarked, args), **kwargs)

    call.__name__ = name
    return call


_DERIVED_METHODS = (
    *("capitalize", "casefold", "center", "expandtabs", "ljust", "lower", "lstrip", "removeprefix"),
    *("removesuffix", "replace", "rjust", "rstrip", "strip", "swapcase", "title", "translate", "upper"),
    *("zfill", "split", "rsplit", "splitlines", "partition", "rpartition"),
)
_QUERY_METHODS = (
    *("count", "endswith", "find", "index", "rfind", "rindex", "startswith", "encode", "isalnum"),
    *("isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric"),
    *("isprintable", "isspace", "istitle", "isupper", "__eq__", "__ne__", "__lt__", "__le__"),
    *("__gt__", "__ge__"),
)
for _name in _DERIVED_METHODS:
    setattr(_Marked, _name, _derived(_name))
for _name in _QUERY_METHODS:
    setattr(_Marked, _name, _query(_name))


class _SpecialTokens:
    """The special-token strings of a model: where they occur, and which user text could forge one."""

    def __init__(self, specials: Iterable[str], *, inner_pieces: bool = True) -> None:
        self.strings = tuple(sorted({s for s in specials if s}, key=lambda s: (-len(s), s)))
        self.inner_pieces = inner_pieces
        self._pattern = re.compile("|".join(map(re.escape, self.strings))) if self.strings else None
        edges = {char for s in self.strings for char in (s[0], s[-1])}
        edges |= {variant for char in edges for variant in (char.lower(), char.upper(), char.casefold())}
        self._edges = re.compile("[" + "".join(map(re.escape, sorted(edges))) + "]") if edges else None
        # characters JSON escapes (so a search of the JSON text would miss them)
        self._json_edges = any(char in '"\\' or ord(char) < 0x20 for char in edges)
        self._joined = "\x00".join(self.strings)
        self._longest = max(map(len, self.strings), default=0)

    def suspicious(self, text: str) -> bool:
        """Whether ``text`` could be part of a special occurrence (it holds an end or sits inside one)."""
        if self._edges is None or not text:
            return False
        if self._edges.search(text) is not None:
            return True
        return self.inner_pieces and len(text) < self._longest and text in self._joined

    def clean_json(self, value: Any) -> bool:
        """A quick all-clear for a whole request: its JSON holds no end character of any special.

        JSON text keeps every character but quotes, backslashes and control characters, so unless a
        special starts or ends with one of those, a clean JSON text means no string inside it is
        suspicious (punctuation JSON adds can only raise false alarms). Otherwise (or when the value is
        not JSON-encodable), the caller checks string by string.
        """
        if self._edges is None:
            return True
        if self.inner_pieces or self._json_edges:
            return False
        try:
            encoded = msgspec.json.encode(value)
        except (TypeError, ValueError, msgspec.EncodeError):
            return False
        return self._edges.search(encoded.decode("utf-8")) is None

    def fragments_in(self, source: str) -> bool:
        """Whether template source writes a special's first or last two characters outside a whole special.

        Only such a template (``'<|' + role + '|>'``) can build a special around user text that
        holds neither of its ends; for any other, pieces of specials in user text are harmless.
        """
        rest = self._pattern.sub("", source) if self._pattern is not None else source
        return any(s[:2] in rest or s[-2:] in rest for s in self.strings)

    def cut(self, text: str, segments: list[Segment]) -> None:
        """Append ``text`` as control segments (each special) and text segments (the runs between)."""
        start = 0
        if self._pattern is not None:
            for match in self._pattern.finditer(text):
                if match.start() > start:
                    segments.append(Segment(text[start : match.start()], False))
                segments.append(Segment(match.group(), True))
                start = match.end()
        if start < len(text):
            segments.append(Segment(text[start:], False))


def _user_strings(value: Any, key: Any = None) -> Iterator[str]:
    """Every string the client sent, keys included, except structural role/type values."""
    if isinstance(value, str):
        structural = STRUCTURAL_VALUES.get(key) if isinstance(key, str) else None
        if structural is None or value not in structural:
            yield value
    elif isinstance(value, Mapping):
        for item_key, item in value.items():
            yield from _user_strings(item_key)
            yield from _user_strings(item, item_key)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _user_strings(item)


def _mark(value: Any, specials: _SpecialTokens, pair: tuple[str, str], key: Any = None) -> Any:
    """A copy of ``value`` with every suspicious user string wrapped in the sentinel ``pair``."""
    if isinstance(value, str):
        structural = STRUCTURAL_VALUES.get(key) if isinstance(key, str) else None
        if (structural is None or value not in structural) and specials.suspicious(value):
            return _Marked(value, pair)
        return value
    if isinstance(value, dict):
        return {
            _mark(item_key, specials, pair): _mark(item, specials, pair, item_key)
            for item_key, item in value.items()
        }
    if isinstance(value, list):
        return [_mark(item, specials, pair) for item in value]
    if isinstance(value, tuple):
        return tuple(_mark(item, specials, pair) for item in value)
    return value


def _sentinels(texts: Iterable[str]) -> tuple[str, str] | None:
    """The first sentinel pair that appears in none of ``texts``."""
    corpus = "".join(texts)
    for pair in _SENTINEL_PAIRS:
        if pair[0] not in corpus and pair[1] not in corpus:
            return pair
    return None


def _traced_segments(
    marked: str, plain: str, pair: tuple[str, str], specials: _SpecialTokens
) -> list[Segment]:
    """Segments of a sentinel-marked render; specials are matched only outside user spans.

    Raises ``PromptRenderError`` when the sentinels do not nest or the stripped render is not
    byte-identical to ``plain`` (the template transformed user text in a way they cannot follow).
    """
    pieces: list[tuple[str, bool]] = []  # (text, is_user)
    depth = 0
    for index, part in enumerate(re.split(f"({re.escape(pair[0])}|{re.escape(pair[1])})", marked)):
        if index % 2:
            depth += 1 if part == pair[0] else -1
            if depth < 0:
                break
        elif part:
            pieces.append((part, depth > 0))
    if depth != 0 or "".join(text for text, _ in pieces) != plain:
        raise PromptRenderError(
            "this model's chat template transforms message text in a way that cannot be traced, and "
            "the request contains text that looks like the model's special tokens; remove that text "
            "(or serve the model with Hugging Face tokenization parity)"
        )
    segments: list[Segment] = []
    for text, is_user in pieces:
        if is_user:
            segments.append(Segment(text, False))
        else:
            specials.cut(text, segments)
    return _merge_text(segments)


def _merge_text(segments: list[Segment]) -> list[Segment]:
    """Adjacent text segments joined, so BPE sees the same runs as a whole-string encode."""
    merged: list[Segment] = []
    for segment in segments:
        if merged and not segment.allow_special and not merged[-1].allow_special:
            merged[-1] = Segment(merged[-1].text + segment.text, False)
        else:
            merged.append(segment)
    return merged


class JinjaFormatter:
    """Renders OpenAI chat requests through a model's Hugging Face chat template.

    ``render`` returns injection-safe segments (see the module docstring) unless
    ``strict_hf_tokenization``; ``registered_specials`` are the model's special-token strings
    (``from_model_dir`` reads them from ``tokenizer_config.json``), the template's special-token
    variables are always among them. ``template_sources`` (given by ``from_template``) lets user
    strings that are mere pieces of a special skip tracing when no template writes partial specials.
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
    ) -> None:
        self._template = template
        self._tool_use_template = tool_use_template
        self.special_tokens = dict(special_tokens)
        self.image_token = image_token
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.strict_hf_tokenization = strict_hf_tokenization
        self._template_sources = template_sources
        self._specials = self._special_tokens(registered_specials)
        self._template_vars = _plain(self.special_tokens)

    def _special_tokens(self, registered: Iterable[str]) -> _SpecialTokens:
        known = [*self.special_tokens.values(), *registered]
        if self.image_token:
            known.append(self.image_token)
        specials = _SpecialTokens(known)
        if self._template_sources is not None:
            specials.inner_pieces = any(specials.fragments_in(source) for source in self._template_sources)
        return specials

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
            registered_specials=registered_specials,
            strict_hf_tokenization=strict_hf_tokenization,
            template_sources=[template] if tool_use_template is None else [template, tool_use_template],
        )

    @classmethod
    def from_model_dir(
        cls,
        path: str | Path,
        *,
        exclude_tools_when_tool_choice_none: bool = True,
        strict_hf_tokenization: bool = False,
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
            registered_specials=registered_specials_from_config(tokenizer_config),
            strict_hf_tokenization=strict_hf_tokenization,
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
        return _render(template, context)

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
        text = _render(template, context)
        if self.strict_hf_tokenization:
            image_count = text.count(self.image_token) if self.image_token else 0
            return RenderedPrompt(text=text, segments=None, image_count=image_count)
        segments = self._segments(template, context, text)
        # only the template's image tokens count: a typed one is text, not an image slot
        image_count = sum(1 for s in segments if s.allow_special and s.text == self.image_token)
        return RenderedPrompt(text=text, segments=segments, image_count=image_count)

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
        if "messages" in chat_template_args:
            raise PromptRenderError("chat template arguments cannot set 'messages'")
        template = self._template
        if tools is not None and self._tool_use_template is not None:
            template = self._tool_use_template
        try:
            variables = (
                {**self._template_vars, **_plain(chat_template_args)}
                if chat_template_args
                else self._template_vars
            )
            context = {
                "messages": _prepare_messages(messages),
                "tools": _prepare_tools(tools),
                "documents": _prepare_documents(documents),
                "add_generation_prompt": add_generation_prompt,
                **variables,
            }
        except PromptRenderError:
            raise
        except RecursionError as exc:
            raise PromptRenderError("the request is nested too deeply to render") from exc
        except (TypeError, ValueError) as exc:
            raise PromptRenderError(f"the request cannot be rendered: {exc}") from exc
        return template, context

    def _segments(self, template: jinja2.Template, context: dict[str, Any], text: str) -> list[Segment]:
        """Fast path when no user string could touch a special; else trace user text with sentinels."""
        user_inputs = {key: context[key] for key in ("messages", "tools", "documents")}
        segments: list[Segment] = []
        if self._specials.clean_json(user_inputs):
            self._specials.cut(text, segments)
            return segments
        suspicious = [value for value in _user_strings(user_inputs) if self._specials.suspicious(value)]
        if not suspicious:
            self._specials.cut(text, segments)
            return segments
        pair = _sentinels([text, *_user_strings(user_inputs)])
        if pair is None:
            raise PromptRenderError("the request contains the private-use characters used to trace user text")
        marked = {key: _mark(value, self._specials, pair) for key, value in user_inputs.items()}
        traced = _render(template, {**context, **marked})
        try:
            return _traced_segments(traced, text, pair, self._specials)
        except PromptRenderError:
            log.warning("jinja_untraceable_user_text", suspicious=len(suspicious))
            raise


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
