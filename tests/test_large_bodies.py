"""A large chat body is decoded in two steps (raw messages first, then part by part off the loop):
the same request as the one-call decoder, refused where it refuses."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import chat_trees, to_json_bytes

from dynamo_prep.protocol.openai import RequestError, decode_chat_shell, parse_chat_request


def _outcome(decode: object, body: bytes) -> object:
    try:
        return repr(decode(body))  # type: ignore[operator]  # repr: a NaN equals itself
    except RequestError as exc:
        return ("refused", str(exc), exc.param)


def _two_steps(body: bytes) -> object:
    return decode_chat_shell(body).finish()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(tree=chat_trees)
def test_two_steps_decode_as_one_call(tree: object) -> None:
    """The same request, or the same refusal; with several bad fields each may name another one
    (the first step checks every field but the messages' values), but both refuse."""
    body = to_json_bytes(tree)
    one_call = _outcome(parse_chat_request, body)
    try:
        decode_chat_shell(body)
    except RequestError:
        assert isinstance(one_call, tuple), "only the two-step decoder refused"
        return
    assert _outcome(_two_steps, body) == one_call


@given(body=st.binary(max_size=64) | st.sampled_from([b"[", b"{", b'{"model": "m", "messages": [1]}']))
def test_garbage_is_refused_alike(body: bytes) -> None:
    assert _outcome(_two_steps, body) == _outcome(parse_chat_request, body)


@pytest.mark.parametrize("depth", [10, 5_000])
def test_nesting_inside_a_part_is_refused_alike(depth: int) -> None:
    part = "[" * depth + "]" * depth
    body = ('{"model": "m", "messages": [{"role": "user", "content": [' + part + "]}]}").encode()
    assert _outcome(_two_steps, body) == _outcome(parse_chat_request, body)


def test_a_content_list_is_decoded_a_part_at_a_time() -> None:
    """Every part is its own decode call: none of them is the size of the body."""
    parts = [{"type": "image_url", "image_url": {"url": f"http://x/{i}.png"}} for i in range(2_000)]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}).encode()
    largest = 0
    real = msgspec.json.decode

    def spy(data: object, **kwargs: object) -> object:
        nonlocal largest
        if not kwargs:  # a value decoded whole (not the list of raw parts)
            largest = max(largest, len(memoryview(data)))  # type: ignore[arg-type]
        return real(data, **kwargs)  # type: ignore[call-overload]

    shell = decode_chat_shell(body)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(msgspec.json, "decode", spy)
        chat = shell.finish()
    assert chat.messages[0]["content"] == parts
    assert 0 < largest < 100
