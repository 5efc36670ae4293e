"""OpenAI chat-completion request types, decoded and validated once at the edge.

Messages stay plain dicts: chat templates read them as the client sent them, and each
formatter validates the shapes it understands with errors that name the message.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from dynamo_prep.limits import TEMPLATE_ARGS_LIMITS
from dynamo_prep.protocol.decode import decoding
from dynamo_prep.protocol.logprobs import ChatLogprobs


class RequestError(ValueError):
    """A request that does not decode: the message names the field (HTTP 400); ``param`` too, when set."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def of(cls, reason: str, detail: str) -> RequestError:
        """The client's message for a ``decoding`` failure."""
        says = "Request body is not valid JSON" if reason == "undecodable" else "Invalid request"
        return cls(f"{says}: {detail}")

    @classmethod
    def naming_field(cls, reason: str, detail: str) -> RequestError:
        """``of``, with ``param`` the top-level field msgspec's ``detail`` names (when it names one)."""
        error = cls.of(reason, detail)
        found = _AT_FIELD.search(detail) or _MISSING_FIELD.search(detail)
        error.param = found.group(1) if found else None
        return error


# Where msgspec's messages name a field: "... - at `$.tokens[3]`", "Object missing required field `model`".
_AT_FIELD = re.compile(r"at `\$\.(\w+)")
_MISSING_FIELD = re.compile(r"missing required field `(\w+)`")


# What the wire can carry: ints a MessagePack frame holds (int64), names and tags a log line can
# show. Ranges that mean something to an engine are checked by the preprocessor, with its messages.
Int = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Tag = Annotated[str, msgspec.Meta(max_length=256)]


# A request's template variables: chat_template_kwargs (vLLM's and SGLang's name) and
# chat_template_args (Dynamo's), which wins key by key.
TEMPLATE_ARGS_FIELDS = ("chat_template_kwargs", "chat_template_args")


class NvExt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Dynamo's request extension; ``annotations`` asks for ``formatted_prompt``/``token_ids``."""

    annotations: list[str] = []
    ignore_eos: bool | None = None


class ChatCompletionRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``POST /v1/chat/completions`` body (unknown fields are ignored, like OpenAI servers do)."""

    model: Name
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | str | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    min_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: bool = False
    n: Int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    user: Tag | None = None
    reasoning_effort: Tag | None = None
    chat_template_args: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    include_reasoning: bool = True
    nvext: NvExt | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) or else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_args(self) -> dict[str, Any]:
        """``chat_template_kwargs`` (vLLM/SGLang spelling) overlaid by ``chat_template_args``."""
        merged: dict[str, Any] = dict(self.chat_template_kwargs or {})
        merged.update(self.chat_template_args or {})
        return merged


def parse_chat_request(request: ChatCompletionRequest | dict[str, Any] | bytes) -> ChatCompletionRequest:
    """Decode a request from JSON bytes or a dict; a bad field raises ``RequestError``."""
    if isinstance(request, ChatCompletionRequest):
        return request
    with decoding(RequestError.naming_field):
        if isinstance(request, bytes | bytearray | memoryview):
            return msgspec.json.decode(request, type=ChatCompletionRequest)
        return msgspec.convert(request, ChatCompletionRequest)


# A large body is decoded in two steps, so that no single msgspec call (which holds the GIL) runs
# long: ``decode_chat_shell`` reads every field but keeps each message's values raw (one fast pass,
# ~1 ms per MB), then ``ChatShell.finish`` (meant for a thread) decodes them value by value and
# content part by content part. A body of 64,000 image parts is one 70 ms call otherwise.
RawMessage = dict[str, msgspec.Raw]


def _shell_field(info: msgspec.structs.FieldInfo) -> tuple[str, Any, Any]:
    kind = list[RawMessage] if info.name == "messages" else info.type
    if info.name in TEMPLATE_ARGS_FIELDS:
        kind = msgspec.Raw  # refused by its size before it is decoded (None when absent)
    if info.default_factory is not msgspec.NODEFAULT:
        return info.name, kind, msgspec.field(default_factory=info.default_factory)
    return info.name, kind, info.default


_ChatShell: Any = msgspec.defstruct(
    "ChatShell",
    [_shell_field(info) for info in msgspec.structs.fields(ChatCompletionRequest)],
    kw_only=True,
)


class ChatShell:
    """A chat request whose messages are still raw JSON; ``finish`` decodes them (off the loop)."""

    def __init__(self, shell: Any) -> None:
        self._shell = shell

    def finish(self) -> ChatCompletionRequest:
        fields = msgspec.structs.asdict(self._shell)
        with decoding(RequestError.naming_field):
            for name in TEMPLATE_ARGS_FIELDS:
                fields[name] = _template_args(name, fields[name])
            fields["messages"] = [_message(index, raw) for index, raw in enumerate(self._shell.messages)]
        return ChatCompletionRequest(**fields)


def decode_chat_shell(body: bytes) -> ChatShell:
    """Every field of a chat request checked (a bad one raises ``RequestError``), messages kept raw."""
    with decoding(RequestError.naming_field):
        return ChatShell(msgspec.json.decode(body, type=_ChatShell))


def _template_args(name: str, raw: msgspec.Raw | None) -> dict[str, Any] | None:
    """A template-variables field, refused past ``TEMPLATE_ARGS_LIMITS.max_bytes`` before decoding."""
    if raw is None:
        return None
    limit = TEMPLATE_ARGS_LIMITS.max_bytes
    if len(raw) > limit:
        raise RequestError(
            f"{name} is {len(raw):,} bytes of JSON, more than the limit of {limit:,}", param=name
        )
    try:
        decoded: dict[str, Any] | None = _template_args_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        found = _INNER_PATH.fullmatch(str(exc))
        detail, inner = (found.group(1), found.group(2)) if found else (str(exc), "")
        raise msgspec.ValidationError(f"{detail} - at `$.{name}{inner}`") from exc
    return decoded


_template_args_decoder = msgspec.json.Decoder(dict[str, Any] | None)


def _message(index: int, raw: RawMessage) -> dict[str, Any]:
    at = f"$.messages[{index}][...]"
    return {key: _parts(value, at) if key == "content" else _json(value, at) for key, value in raw.items()}


def _parts(value: msgspec.Raw, at: str) -> Any:
    """A content list part by part (each part one short call), any other content whole."""
    if bytes(memoryview(value)[:1]) != b"[":
        return _json(value, at)
    parts = msgspec.json.decode(value, type=list[msgspec.Raw])
    return [_json(part, f"{at}[{index}]") for index, part in enumerate(parts)]


def _json(value: msgspec.Raw, at: str) -> Any:
    """A value decoded whole; a failure says where, as the one-call decoder would."""
    try:
        return msgspec.json.decode(value)
    except msgspec.ValidationError as exc:
        found = _INNER_PATH.fullmatch(str(exc))
        detail, inner = (found.group(1), found.group(2)) if found else (str(exc), "")
        raise msgspec.ValidationError(f"{detail} - at `{at}{inner}`") from exc


_INNER_PATH = re.compile(r"(.*) - at `\$(.*)`", re.DOTALL)


# -- responses -------------------------------------------------------------------------------------
# Encoded with msgspec; ``UNSET`` fields are left out, ``None`` fields are sent as ``null`` (OpenAI
# clients expect ``"logprobs": null`` and ``"finish_reason": null`` to be present).


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``prompt_tokens_details`` is left out unless the engine said how much of the prompt its
    prefix cache served."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, kw_only=True):
    """The answer; ``reasoning_content`` (Dynamo's, SGLang's and DeepSeek's name) and ``tool_calls``
    are left out when there are none. ``content`` is null when the model only called tools."""

    content: str | None
    role: str = "assistant"
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    """One choice of the answer; ``logprobs`` may be already encoded (``msgspec.Raw``)."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | msgspec.Raw | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    """The non-streaming ``POST /v1/chat/completions`` answer."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChunkFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | msgspec.UnsetType = msgspec.UNSET
    arguments: str | msgspec.UnsetType = msgspec.UNSET


class ChunkToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed call: its first chunk carries ``id``, ``type`` and the name; later ones argument
    fragments, which concatenate to the call's ``arguments``."""

    index: int
    function: ChunkFunction
    id: str | msgspec.UnsetType = msgspec.UNSET
    type: str | msgspec.UnsetType = msgspec.UNSET


class ChunkDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ChunkToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE event of a streamed completion; the usage chunk has no choices."""

    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelEntry(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "dynamo_prep"
    object: str = "model"


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models``."""

    data: list[ModelEntry]
    object: str = "list"


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct, kw_only=True):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class TokenizeShell(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /tokenize``, a chat (``messages``) or a plain ``prompt``, read without its
    messages (kept raw: a chat is decoded as one, by ``decode_chat_shell`` when large); ``chat``
    says whether it is one. ``add_special_tokens`` defaults as vLLM's: on for a prompt (a BOS where
    the tokenizer adds one), off for a chat (its template writes them)."""

    model: Name
    messages: msgspec.Raw = msgspec.Raw()
    prompt: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @property
    def chat(self) -> bool:
        return len(self.messages) > 0 and bytes(self.messages) != b"null"


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


# Ids one /detokenize may carry: more than any served context (each model's own is checked after).
MAX_DETOKENIZE_TOKENS = 1 << 20


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /detokenize``: token ids of ``model``'s vocabulary, back to text."""

    model: Name
    tokens: Annotated[list[Int], msgspec.Meta(max_length=MAX_DETOKENIZE_TOKENS)]


class _DetokenizeShell(msgspec.Struct, kw_only=True):
    model: Name
    tokens: msgspec.Raw


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    """The body decoded, its ids counted before they are decoded: msgspec checks a JSON array's
    ``max_length`` only once every item is built (2,000,000 ids: 55 ms of one call)."""
    with decoding(RequestError.naming_field):
        if len(body) <= 2 * MAX_DETOKENIZE_TOKENS:  # an id takes 2 bytes at least: within the limit
            return msgspec.json.decode(body, type=DetokenizeRequest)
        shell = msgspec.json.decode(body, type=_DetokenizeShell)
        raw = bytes(shell.tokens)  # one copy of the array's text; its items are not decoded
        if raw[:1] == b"[" and raw.count(b",") >= MAX_DETOKENIZE_TOKENS:
            raise msgspec.ValidationError(
                f"Expected `array` of length <= {MAX_DETOKENIZE_TOKENS} - at `$.tokens`"
            )
        try:
            ids = _decode_ids(raw)
        except msgspec.ValidationError as exc:  # said of the field, as a one-call decode would
            found = _INNER_PATH.fullmatch(str(exc))
            detail, inner = (found.group(1), found.group(2)) if found else (str(exc), "")
            raise msgspec.ValidationError(f"{detail} - at `$.tokens{inner}`") from exc
        return DetokenizeRequest(model=shell.model, tokens=ids)


_ids_decoder = msgspec.json.Decoder(list[Int])
_IDS_SLICE_BYTES = 1 << 18  # about 40,000 ids, 2 ms of one decode call


def _decode_ids(raw: bytes) -> list[int]:
    """A JSON array of ids decoded a slice at a time (cut at commas), so a thread decoding a large
    one lets the event loop have the GIL between slices; anything but ids fails to decode."""
    end = len(raw) - 1
    if end <= _IDS_SLICE_BYTES or raw[:1] != b"[":
        return _ids_decoder.decode(raw)
    ids: list[int] = []
    start = 1
    while start < end:
        cut = raw.find(b",", start + _IDS_SLICE_BYTES, end)
        stop = end if cut < 0 else cut
        try:
            ids += _ids_decoder.decode(b"[" + raw[start:stop] + b"]")
        except msgspec.ValidationError as exc:  # the index in the whole array
            found = _AT_INDEX.fullmatch(str(exc))
            if found is None:
                raise
            detail, index, inner = found.groups()
            raise msgspec.ValidationError(f"{detail} - at `$[{int(index) + len(ids)}]{inner}`") from exc
        start = stop + 1
    return ids


_AT_INDEX = re.compile(r"(.*) - at `\$\[(\d+)\](.*)`", re.DOTALL)


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str
