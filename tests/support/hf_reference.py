"""What transformers says for a Hugging Face model directory: chat ids, encode, decode, image runs.

A chat request in OpenAI format is turned into what templates see the way vLLM does it
(vllm/renderers/chat_utils.py and hf.py): the template is resolved as vLLM resolves it (the
processor's when no tools are given, else the tokenizer's, a ``tool_use`` entry of a named list
when tools are given), its content format is detected from its Jinja AST ("openai": every content
becomes a list of parts, ``image_url`` parts become ``{"type": "image"}``; "string": text parts are
joined with newlines), assistant tool-call ``arguments`` given as a JSON string are parsed to an
object, tools are normalised to ``{"type", "function": {"name", "description", "parameters"}}``
and request fields override ``chat_template_kwargs``. transformers then renders and tokenizes
(``apply_chat_template(tokenize=True)``, no special tokens added). Everything is cached per
directory; nothing here needs torch or the network.
"""

from __future__ import annotations

import functools
import json
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import jinja2.nodes
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, ProcessorMixin
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.utils.chat_template_utils import _compile_jinja_template

ContentFormat = Literal["string", "openai"]
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")
_IMAGE_PARTS = ("image_url", "input_image")


class ReferenceError(ValueError):
    """The request is one this reference (or vLLM) does not render; the message says why."""


def _key(model_dir: Path | str) -> str:
    return str(Path(model_dir).resolve())


@functools.cache
def _tokenizer(key: str) -> Any:
    return AutoTokenizer.from_pretrained(key, local_files_only=True)


@functools.cache
def _processor(key: str) -> Any | None:
    try:
        processor = AutoProcessor.from_pretrained(key, local_files_only=True)
    except ImportError:  # its processor class needs torch / torchvision
        return None
    return processor if isinstance(processor, ProcessorMixin) else None


def tokenizer(model_dir: Path | str) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir)``, once per directory."""
    return _tokenizer(_key(model_dir))


def processor(model_dir: Path | str) -> Any | None:
    """``AutoProcessor.from_pretrained(model_dir)`` when it is a processor that loads without torch."""
    return _processor(_key(model_dir))


def encode(model_dir: Path | str, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``."""
    return list(tokenizer(model_dir).encode(text, add_special_tokens=add_special_tokens))


def decode(model_dir: Path | str, ids: list[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=...)``."""
    return str(tokenizer(model_dir).decode(ids, skip_special_tokens=skip_special_tokens))


# ---------------------------------------------------------------------------------------------
# Chat template resolution and content format, as vLLM does them.


def chat_template(
    model_dir: Path | str, tools: list[dict[str, Any]] | None, override: str | None = None
) -> str:
    """The template vLLM renders with: a request's own, else the processor's (only without tools),
    else the tokenizer's (``get_chat_template``: a named list's ``tool_use`` entry with tools)."""
    tok = tokenizer(model_dir)
    if override is not None:
        return str(tok.get_chat_template(override, tools=tools))
    if tools is None:
        proc = _processor_for_template(model_dir)
        if proc is not None and getattr(proc, "chat_template", None):
            return str(proc.chat_template)
    try:
        return str(tok.get_chat_template(None, tools=tools))
    except ValueError as error:
        raise ReferenceError(f"{model_dir}: the tokenizer has no chat template ({error})") from error


def _processor_for_template(model_dir: Path | str) -> Any | None:
    """The processor whose chat template vLLM prefers; a processor that needs torch to load falls
    back to the directory's processor template file (vLLM, with torch, loads it from there)."""
    proc = processor(model_dir)
    if proc is not None:
        return proc
    directory = Path(model_dir)
    if (directory / "chat_template.jinja").is_file() and (directory / "preprocessor_config.json").is_file():
        return SimpleNamespace(chat_template=(directory / "chat_template.jinja").read_text(encoding="utf-8"))
    if (directory / "chat_template.json").is_file():
        data = json.loads((directory / "chat_template.json").read_text(encoding="utf-8"))
        return SimpleNamespace(chat_template=data.get("chat_template"))
    return None


@functools.cache
def content_format(template: str) -> ContentFormat:
    """vLLM's detection: "openai" when the template loops over a message's content (directly, or
    through a macro given ``message.content``), else "string"."""
    ast = _compile_jinja_template(template).environment.parse(template)
    return "openai" if next(_content_loops(ast), None) is not None else "string"


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _accesses(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name.key``), through filters, tests and slices."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_name(node, name)


def _message_names(root: jinja2.nodes.Template) -> list[str]:
    """Loop variables bound to the items of ``messages`` (or of a variable assigned from it)."""
    names, pending = ["messages"], deque(["messages"])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _accesses(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    loops = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, name) for name in names) and isinstance(loop.target, jinja2.nodes.Name):
            loops.append(loop.target.name)
    return loops


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    messages = _message_names(root)
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {arg.name for arg in macro.args}
        fed: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for index, arg in enumerate(call.args):
                if index < len(macro.args) and any(_accesses(arg, name, "content") for name in messages):
                    fed.add(macro.args[index].name)
            for keyword in call.kwargs:
                if keyword.key in params and any(
                    _accesses(keyword.value, name, "content") for name in messages
                ):
                    fed.add(keyword.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if fed:
                macro_params[id(loop)] = fed
    for loop in root.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, name, "content") for name in messages) or _loops_over_content(
            loop, macro_params.get(id(loop), set()), id(loop) in in_macros
        ):
            yield loop


def _loops_over_content(loop: jinja2.nodes.For, fed_params: set[str], in_macro: bool) -> bool:
    """A loop over a macro parameter fed ``message.content``, or over a top-level ``content``."""
    if not isinstance(loop.iter, jinja2.nodes.Name):
        return False
    return loop.iter.name in fed_params or (not in_macro and loop.iter.name == "content")


# ---------------------------------------------------------------------------------------------
# OpenAI messages and tools -> template inputs, as vLLM converts them.


def template_messages(messages: list[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """The conversation vLLM hands to ``apply_chat_template`` for a given content format."""
    conversation = [_message(message, fmt) for message in messages]
    for message in conversation:
        _parse_tool_arguments(message)
    return conversation


def _message(message: dict[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    parts: list[Any] = [] if content is None else [content] if isinstance(content, str) else list(content)
    converted = [_part(part) for part in parts]
    if fmt == "openai":
        result: dict[str, Any] = {"role": role, "content": converted}
    else:
        if any(part["type"] != "text" for part in converted):
            raise ReferenceError(
                "images with a string-format template: vLLM adds model-specific placeholders"
            )
        result = {"role": role, "content": "\n".join(part["text"] for part in converted)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = [json.loads(json.dumps(call)) for call in message["tool_calls"]]
        if message.get("reasoning") is not None:
            result["reasoning"] = result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(result["content"], list) and all(part["type"] == "text" for part in result["content"]):
            result["content"] = "\n".join(part["text"] for part in result["content"])
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    return result


def _part(part: Any) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        text = part.get(kind if kind == "thinking" else "text")
        if text is None:
            raise ReferenceError(f"a {kind} part without text (vLLM skips it; not modelled here)")
        return {"type": "text", "text": text}
    if kind in _IMAGE_PARTS:
        return {"type": "image"}
    raise ReferenceError(f"content part type {kind!r} is not one vLLM renders for chat")


def _parse_tool_arguments(message: dict[str, Any]) -> None:
    """Assistant tool calls: no calls -> no key; string arguments -> the object they encode ({}
    when empty, not JSON or not an object)."""
    if message["role"] != "assistant" or "tool_calls" not in message:
        return
    if not message["tool_calls"]:
        del message["tool_calls"]
        return
    for call in message["tool_calls"]:
        function = call["function"]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        function["arguments"] = arguments if isinstance(arguments, dict) else {}


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """vLLM's ``tool.model_dump()``: type, then function with name, description and parameters
    (None when absent) in that order; other fields dropped (``strict`` kept when set)."""
    if tools is None:
        return None
    normalised = []
    for tool in tools:
        function = tool["function"]
        dumped = {key: function.get(key) for key in ("name", "description", "parameters")}
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        normalised.append({"type": tool.get("type", "function"), "function": dumped})
    return normalised


def template_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` with the request's own fields on top (vLLM's merge: a field that is
    None or "auto" leaves the kwarg alone)."""
    kwargs = dict(request.get("chat_template_kwargs") or {})
    fields = {
        "add_generation_prompt": request.get("add_generation_prompt", True),
        "continue_final_message": request.get("continue_final_message", False),
        "documents": request.get("documents"),
        "reasoning_effort": request.get("reasoning_effort"),
    }
    if request.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
        fields["enable_thinking"] = request["reasoning_effort"] != "none"
    kwargs.update({key: value for key, value in fields.items() if value not in (None, "auto")})
    return kwargs


def render_inputs(
    model_dir: Path | str, request: dict[str, Any]
) -> tuple[str, list[dict[str, Any]], Any, dict]:
    """The template, conversation, tools and kwargs vLLM would render a chat request with."""
    tools = template_tools(request.get("tools"))
    template = chat_template(model_dir, tools, request.get("chat_template"))
    conversation = template_messages(request["messages"], content_format(template))
    return template, conversation, tools, template_kwargs(request)


def chat_text(model_dir: Path | str, request: dict[str, Any]) -> str:
    """The rendered prompt text."""
    template, conversation, tools, kwargs = render_inputs(model_dir, request)
    text = tokenizer(model_dir).apply_chat_template(
        conversation, tools=tools, chat_template=template, tokenize=False, **kwargs
    )
    return str(text)


def chat_ids(model_dir: Path | str, request: dict[str, Any]) -> list[int]:
    """``apply_chat_template(..., tokenize=True)``: the rendered prompt encoded without added
    special tokens (vLLM encodes the rendered text the same way)."""
    template, conversation, tools, kwargs = render_inputs(model_dir, request)
    ids = tokenizer(model_dir).apply_chat_template(
        conversation, tools=tools, chat_template=template, tokenize=True, return_dict=False, **kwargs
    )
    return [int(token) for token in ids]


# ---------------------------------------------------------------------------------------------
# Images: what a family's processor expands one image placeholder to.


def image_placeholder_ids(model_dir: Path | str, prompt_with_one_image: str, image: Any) -> list[int]:
    """The ids of ``prompt_with_one_image`` once its processor has expanded the image's placeholder
    for ``image`` (a PIL image), encoded without added special tokens, as the processor's
    ``__call__`` does. Processors that need torch to load (Qwen2-VL: its video processor; Pixtral
    and Mistral 3: the class) are replayed: their PIL image processor from the directory, then
    Qwen2VLProcessor's own ``replace_image_token``, or PixtralProcessor's rule restated."""
    proc = processor(model_dir)
    if proc is not None:
        out = proc(text=[prompt_with_one_image], images=[image], add_special_tokens=False)
        return [int(token) for token in out["input_ids"][0]]
    placeholder, replacement = _replayed_replacement(model_dir, image)
    if prompt_with_one_image.count(placeholder) != 1:
        raise ReferenceError(f"the prompt must hold {placeholder!r} exactly once")
    return encode(
        model_dir, prompt_with_one_image.replace(placeholder, replacement), add_special_tokens=False
    )


def _replayed_replacement(model_dir: Path | str, image: Any) -> tuple[str, str]:
    directory = Path(model_dir)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    image_processor = AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
    if config["model_type"] in ("qwen2_vl", "qwen2_5_vl"):
        inputs = image_processor([image])
        state = SimpleNamespace(image_processor=image_processor, image_token="<|image_pad|>")
        return "<|image_pad|>", Qwen2VLProcessor.replace_image_token(state, inputs, 0)
    if config["model_type"] in ("llava", "mistral3") and (directory / "processor_config.json").is_file():
        settings = json.loads((directory / "processor_config.json").read_text(encoding="utf-8"))
        if settings.get("processor_class") == "PixtralProcessor":
            return _pixtral_replacement(image_processor, settings, image)
    raise ReferenceError(f"{model_dir}: no processor that runs without torch")


def _pixtral_replacement(image_processor: Any, settings: dict[str, Any], image: Any) -> tuple[str, str]:
    """PixtralProcessor: rows of [IMG] per (patch * spatial merge) cell, [IMG_BREAK] after each
    row, the last one replaced by [IMG_END] (transformers' processing_pixtral.replace_image_token)."""
    patch = settings.get("patch_size", 16) * settings.get("spatial_merge_size", 1)
    height, width = image_processor([image], patch_size=patch)["image_sizes"][0]
    image_token = settings.get("image_token", "[IMG]")
    row = [image_token] * (width // patch) + [settings.get("image_break_token", "[IMG_BREAK]")]
    tokens = row * (height // patch)
    tokens[-1] = settings.get("image_end_token", "[IMG_END]")
    return image_token, "".join(tokens)
