"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): a prompt or a chat to the model's
token ids, rendered with its canonical declaration, and ids back to text."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamo_prep.frontend.api.common import JSON, Api, SurfaceRoute, encoder, off_loop, parse_chat, read_body
from dynamo_prep.frontend.errors import OpenAIError
from dynamo_prep.protocol.decode import decoding
from dynamo_prep.protocol.openai import (
    DetokenizeResponse,
    RequestError,
    TokenizeResponse,
    TokenizeShell,
    decode_detokenize,
)
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["routes"]


def routes(api: Api) -> list[Route]:
    async def tokenize(request: Request) -> Response:
        return await _tokenize(api, request)

    async def detokenize(request: Request) -> Response:
        return await _detokenize(api, request)

    return [SurfaceRoute("/tokenize", tokenize, "POST"), SurfaceRoute("/detokenize", detokenize, "POST")]


async def _tokenize(api: Api, request: Request) -> Response:
    """vLLM's ``/tokenize``, rendered with the model's canonical declaration."""
    body = await read_body(request, api.settings)
    with decoding(RequestError.of):  # the messages are skipped here: a chat is decoded as one
        tokenize = msgspec.json.decode(body, type=TokenizeShell)
    model = api.live_model(tokenize.model)
    preprocessor, tokenizer = model.preprocessor, model.preprocessor.tokenizer
    if tokenize.chat:
        chat = await parse_chat(body)
        tokens = await off_loop(len(body), lambda: preprocessor.tokenize(chat).token_ids)
        if tokenize.add_special_tokens:
            tokens = tokenizer.with_special_tokens(tokens)
    elif tokenize.prompt is not None:
        text, specials = tokenize.prompt, tokenize.add_special_tokens is not False
        tokens = await off_loop(len(body), lambda: tokenizer.encode_prompt(text, add_special_tokens=specials))
    else:
        raise OpenAIError(400, "give either messages (a chat) or prompt (text)", param="messages")
    strs = [tokenizer.id_to_token(t) or "" for t in tokens] if tokenize.return_token_strs else None
    answer = TokenizeResponse(
        count=len(tokens), max_model_len=preprocessor.context_length, tokens=tokens, token_strs=strs
    )
    return Response(encoder.encode(answer), media_type=JSON)


async def _detokenize(api: Api, request: Request) -> Response:
    """vLLM's ``/detokenize``: ids of the model's vocabulary back to text (specials as their text)."""
    body = await read_body(request, api.settings)
    # a large body's ids are counted (refused past the limit), decoded and checked in a thread
    detokenize = await off_loop(len(body), lambda: decode_detokenize(body))
    preprocessor = api.live_model(detokenize.model).preprocessor
    ids, tokenizer = detokenize.tokens, preprocessor.tokenizer

    def decoded() -> str:
        _check_ids(ids, preprocessor.context_length, tokenizer)
        return tokenizer.decode(ids)

    text = await off_loop(len(body), decoded)
    return Response(encoder.encode(DetokenizeResponse(prompt=text)), media_type=JSON)


def _check_ids(ids: list[int], context_length: int, tokenizer: Tokenizer) -> None:
    """400s naming ``tokens``: more ids than the model's context holds, or one outside its vocabulary."""
    if len(ids) > context_length:
        raise OpenAIError(
            400, f"{len(ids)} tokens exceed the model's context length of {context_length}", param="tokens"
        )
    unknown = tokenizer.unknown_id_error(ids)
    if unknown is not None:
        raise OpenAIError(400, unknown, param="tokens")
