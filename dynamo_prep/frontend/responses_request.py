"""OpenAI's Responses API, the request: a Responses request becomes the chat request the chat path
serves (``to_chat``); what cannot be served is refused naming the field. The mapping, and what is
dropped or refused: docs/frontend.md "The Responses API".
"""

from __future__ import annotations

from typing import Any

from dynamo_prep.protocol.openai import ChatCompletionRequest, RequestError
from dynamo_prep.protocol.responses import ResponsesRequest, parse_responses_request

__all__ = ["read_request", "to_chat"]

ITEM_TYPES = ("message", "reasoning", "function_call", "function_call_output")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# An assistant turn's parts in the order a model writes them: an input item merges into the
# assistant message before it while it comes later in this order (vLLM's merging).
_TURN_ORDER = {"reasoning_content": 0, "content": 1, "tool_calls": 2}


def _refuse(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


def read_request(body: bytes) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """The body decoded, and the chat request that serves it (pure: runs in a thread for large bodies)."""
    asked = parse_responses_request(body)
    return asked, to_chat(asked)


def to_chat(asked: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves ``asked``; a field that cannot be served raises ``RequestError``
    naming it."""
    _check_stateless(asked)
    _check_options(asked)
    tools = _tools(asked.tools)
    return ChatCompletionRequest(
        model=asked.model,
        messages=_messages(asked),
        tools=tools,
        tool_choice=_tool_choice(asked.tool_choice),
        parallel_tool_calls=asked.parallel_tool_calls,
        response_format=_response_format(asked.text),
        max_completion_tokens=asked.max_output_tokens,
        temperature=asked.temperature,
        top_p=asked.top_p,
        top_k=asked.top_k,
        seed=asked.seed,
        stop=asked.stop,
        presence_penalty=asked.presence_penalty,
        frequency_penalty=asked.frequency_penalty,
        repetition_penalty=asked.repetition_penalty,
        ignore_eos=asked.ignore_eos,
        include_reasoning=asked.include_reasoning,
        chat_template_kwargs=asked.chat_template_kwargs,
        reasoning_effort=_effort(asked.reasoning),
        user=asked.user,
    )


def _check_stateless(asked: ResponsesRequest) -> None:
    """What needs stored responses or a service this frontend does not run is refused by name."""
    if asked.previous_response_id is not None:
        raise _refuse(
            "previous_response_id is not supported: this server stores no responses (store is always "
            "false); send the whole conversation in input",
            "previous_response_id",
        )
    if asked.conversation is not None:
        raise _refuse(
            "conversation is not supported: this server stores no conversations; send the whole "
            "conversation in input",
            "conversation",
        )
    if asked.background:
        raise _refuse(
            "background responses are not supported (they need a store); leave background out or false",
            "background",
        )
    if asked.prompt is not None:
        raise _refuse("prompt templates are not supported; send instructions and input instead", "prompt")


def _check_options(asked: ResponsesRequest) -> None:
    if asked.max_output_tokens is not None and asked.max_output_tokens < 1:
        raise _refuse(
            f"max_output_tokens must be at least 1, got {asked.max_output_tokens}", "max_output_tokens"
        )
    if asked.top_logprobs:
        raise _refuse("logprobs are not served on /v1/responses; leave top_logprobs out or 0", "top_logprobs")
    if "message.output_text.logprobs" in (asked.include or ()):
        raise _refuse(
            "logprobs are not served on /v1/responses; remove message.output_text.logprobs", "include"
        )
    if asked.truncation not in (None, "auto", "disabled"):
        raise _refuse(f"truncation must be 'auto' or 'disabled', got {asked.truncation!r}", "truncation")


def _messages(asked: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if asked.instructions:
        messages.append({"role": "system", "content": asked.instructions})
    if isinstance(asked.input, str):
        messages.append({"role": "user", "content": asked.input})
        return messages
    for index, item in enumerate(asked.input):
        _add_item(messages, item, f"input[{index}]")
    return messages


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise _refuse(f"{where}: an input item must be an object", "input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        _add_message(messages, item, where)
    elif kind == "reasoning":
        _merge_assistant(messages, "reasoning_content", _reasoning_text(item, where))
    elif kind == "function_call":
        _merge_assistant(messages, "tool_calls", _function_call(item, where))
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        messages.append(
            {"role": "tool", "tool_call_id": call_id, "content": _content(item.get("output"), where)}
        )
    elif kind == "item_reference":
        raise _refuse(f"{where}: item_reference needs stored items, which this server does not keep", "input")
    else:
        raise _refuse(f"{where}.type: {kind!r} is not supported; use one of {', '.join(ITEM_TYPES)}", "input")


def _add_message(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise _refuse(f"{where}.role: {_show(role)} is not supported; use one of {', '.join(ROLES)}", "input")
    content = _content(item.get("content"), where)
    if role == "assistant":
        _merge_assistant(messages, "content", _text_only(content, where))
    else:
        messages.append({"role": role, "content": content})


def _merge_assistant(messages: list[dict[str, Any]], key: str, value: Any) -> None:
    """Into the assistant message before, while ``key`` comes after everything it holds; else a new one."""
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant":
        held = [_TURN_ORDER[k] for k in _TURN_ORDER if k in last]
        if key == "tool_calls" and "tool_calls" in last:
            last["tool_calls"].append(value)
            return
        if all(order < _TURN_ORDER[key] for order in held):
            last[key] = [value] if key == "tool_calls" else value
            return
    messages.append({"role": "assistant", key: [value] if key == "tool_calls" else value})


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The reasoning item's ``reasoning_text`` content, else its summary (vLLM's rule)."""
    if item.get("encrypted_content"):
        raise _refuse(f"{where}: encrypted reasoning content is not supported", "input")
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            return "".join(_text_of(part, f"{where}.{key}[{i}]") for i, part in enumerate(parts))
    return ""


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise _refuse(f"{where}.arguments must be a string (a JSON object)", "input")
    name = _string(item, "name", where)
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A string stays one; parts become chat parts, joined into one string when all are text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where}.content must be a string or a list of content parts", "input")
    parts = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_image":
        assert isinstance(part, dict)
        url = part.get("image_url")
        if not isinstance(url, str):
            raise _refuse(
                f"{where}: an input_image needs image_url (an http(s) or data: URL); file_id is not served",
                "input",
            )
        image: dict[str, Any] = {"url": url}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    return {"type": "text", "text": _text_of(part, where)}


def _text_of(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = "refusal" if kind == "refusal" else "text"
    if kind not in (*TEXT_PARTS, "refusal", "reasoning_text", "summary_text") or not isinstance(
        part.get(key), str
    ):
        raise _refuse(
            f"{where}: a content part must be input_text, output_text or input_image with its text or "
            f"image_url, got type {_show(kind)}",
            "input",
        )
    text: str = part[key]
    return text


def _text_only(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, list):
        raise _refuse(f"{where}: an assistant message holds text only", "input")
    return content


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _refuse(f"{where}.{key} must be a non-empty string", "input")
    return value


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools, flat (``name``/``description``/``parameters``) or chat-shaped, as chat tools."""
    if tools is None:
        return None
    chat: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _refuse(
                f"{where}.type: {_show(kind)} is not supported; only function tools are served "
                "(built-in tools such as web_search, file_search or code_interpreter are not)",
                "tools",
            )
        assert isinstance(tool, dict)
        nested = tool.get("function")
        function = nested if isinstance(nested, dict) and "name" not in tool else _flat_function(tool)
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _refuse(f"{where}.name: a function tool needs a name", "tools")
        chat.append({"type": "function", "function": function})
    return chat


def _flat_function(tool: dict[str, Any]) -> dict[str, Any]:
    keys = ("name", "description", "parameters", "strict")
    return {key: tool[key] for key in keys if tool.get(key) is not None}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") == "function" and isinstance(name, str):
        return {"type": "function", "function": {"name": name}}
    if choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return choice
    raise _refuse(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}; '
        f"type {_show(choice.get('type'))} is not supported",
        "tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (json_schema's fields move under ``json_schema``)."""
    form = (text or {}).get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(form, dict)
        schema = {key: value for key, value in form.items() if key != "type"}
        return {"type": "json_schema", "json_schema": schema}
    raise _refuse(
        f"text.format.type: {_show(kind)} is not supported; use text, json_object or json_schema",
        "text.format",
    )


def _effort(reasoning: dict[str, Any] | None) -> str | None:
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _refuse(
            "reasoning.effort must be a string such as 'low', 'medium' or 'high'", "reasoning.effort"
        )
    return effort


def _show(value: Any) -> str:
    return repr(value)[:60]
