"""OpenAI Responses API types (``POST /v1/responses``): the request, the response object, its output
items and the streamed events, in the shapes the openai SDK parses (``openai.types.responses``).

Input items, tools and formats stay plain dicts: ``frontend/responses.py`` reads them into a chat
request with errors that name the field. How the API maps onto the chat path: docs/frontend.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo_prep.protocol.decode import decoding
from dynamo_prep.protocol.openai import Int, Name, RequestError, Tag


class ResponsesRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``POST /v1/responses`` body. Unknown fields are ignored (as OpenAI servers do); the fields a
    stateless server cannot honour are decoded so that they can be refused by name."""

    model: Name
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: Tag | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: Int | None = None
    # refused when set: each needs state or a service this frontend does not keep
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    # vLLM's extensions, passed on to the chat request as they are
    top_k: Int | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Decode a request body; a bad field raises ``RequestError`` naming it."""
    with decoding(RequestError.naming_field):
        return msgspec.json.decode(body, type=ResponsesRequest)


# -- the response object ---------------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    """The model's reasoning channel, as ``reasoning_text`` content (vLLM's shape); no summary."""

    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = []


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as a string
    status: str


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The ``response`` object: the non-streamed answer, and the snapshot streamed events carry."""

    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    tool_choice: str | dict[str, Any]
    tools: list[Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    store: bool = False
    background: bool = False
    object: str = "response"


# -- streamed events: each one SSE event, ``event: <type>`` then ``data: <the event>`` ---------------


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int


class ResponseCreated(_Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(_Event, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(_Event, tag="response.failed"):
    response: ResponseObject


class ErrorEvent(_Event, tag="error"):
    message: str
    code: str | None = None
    param: str | None = None


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


StreamEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | ResponseFailed
    | ErrorEvent
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
)
