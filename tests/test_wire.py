"""Request-plane wire messages: every message round-trips, malformed frames fail to decode, and
the messages older than the request-kind seam (issue 29) encode to the same bytes as before it."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from dynamo_prep.protocol import wire
from dynamo_prep.protocol.calls import Echo, Echoed
from dynamo_prep.protocol.preprocessed import ImageRef, PreprocessedRequest, StopConditions
from dynamo_prep.protocol.wire import (
    Answer,
    Call,
    Cancel,
    ErrorReply,
    FetchFile,
    FileData,
    Generate,
    Output,
    Ping,
    Pong,
)

REQUEST = PreprocessedRequest(
    model="kimi-k3-demo",
    token_ids=[1, 2, 3, 8200],
    stop_conditions=StopConditions(max_tokens=16, stop=["\n\n"]),
    images=[ImageRef(url="https://example.com/cat.png")],
)

TO_WORKER: list[wire.ToWorker] = [
    FetchFile(request_id="f1", sha256="a" * 64),
    Generate(request_id="g1", request=REQUEST, deadline_ms=1_900_000_000_000),
    Cancel(request_id="g1"),
    Ping(request_id="p1"),
    Call(
        request_id="c1", method="echo", body=wire.encode_body(Echo(data=b"x")), deadline_ms=1_900_000_000_000
    ),
]
FROM_WORKER: list[wire.FromWorker] = [
    FileData(request_id="f1", sha256="a" * 64, data=b"\x00bytes"),
    Output(request_id="g1", token_ids=[42]),
    Output(request_id="g1", token_ids=[], finish_reason="stop", prompt_tokens=4, completion_tokens=1),
    Pong(request_id="p1"),
    ErrorReply(request_id="g1", code=400, message="Expected 1 image placeholder token(s), found 0"),
    Answer(request_id="c1", body=wire.encode_body(Echoed(data=b"x"))),
]
# The first 16 hex digits of the sha256 of each message above as main encoded it before ``call`` and
# ``answer`` were added (issue 29): the wire of the existing kinds is byte-identical.
BEFORE_THE_SEAM = {
    ("to", 0): "a17bd5175c9504db",
    ("to", 1): "e3a32c040c44809e",
    ("to", 2): "c0e3d2cc669d606a",
    ("to", 3): "20635a7c1a13cc16",
    ("from", 0): "1705d62dfa97c81c",
    ("from", 1): "a156fe7a137e9774",
    ("from", 2): "033619c0d90a327c",
    ("from", 3): "242d5ba48235ee6e",
    ("from", 4): "4552647c6e15f6f0",
}


@pytest.mark.parametrize("message", TO_WORKER, ids=lambda m: type(m).__name__)
def test_to_worker_round_trips(message: wire.ToWorker) -> None:
    assert wire.to_worker_decoder.decode(wire.encode(message)) == message


@pytest.mark.parametrize("message", FROM_WORKER, ids=lambda m: f"{type(m).__name__}")
def test_from_worker_round_trips(message: wire.FromWorker) -> None:
    assert wire.from_worker_decoder.decode(wire.encode(message)) == message


@pytest.mark.parametrize(("side", "index"), sorted(BEFORE_THE_SEAM), ids=str)
def test_the_existing_kinds_encode_as_before(side: str, index: int) -> None:
    message = (TO_WORKER if side == "to" else FROM_WORKER)[index]
    assert hashlib.sha256(wire.encode(message)).hexdigest()[:16] == BEFORE_THE_SEAM[(side, index)]


def test_a_call_and_its_answer_carry_their_kind_as_messagepack() -> None:
    call = msgspec.msgpack.decode(wire.encode(TO_WORKER[-1]))
    assert call == {
        "kind": "call",
        "request_id": "c1",
        "method": "echo",
        "body": {"data": b"x"},
        "deadline_ms": 1_900_000_000_000,
    }
    answer = msgspec.msgpack.decode(wire.encode(FROM_WORKER[-1]))
    assert answer == {"kind": "answer", "request_id": "c1", "body": {"data": b"x"}}
    assert wire.decode_body(wire.decode_to_worker(wire.encode(TO_WORKER[-1])).body, Echo) == Echo(data=b"x")  # type: ignore[union-attr]
    with pytest.raises(wire.WireDecodeError) as raised:
        wire.decode_body(msgspec.Raw(msgspec.msgpack.encode({"data": 7})), Echoed)
    assert raised.value.reason == "invalid"


def test_frames_are_tagged_maps_with_documented_keys() -> None:
    generate = msgspec.msgpack.decode(wire.encode(TO_WORKER[1]))
    assert generate["kind"] == "generate"
    assert set(generate) == {"kind", "request_id", "request", "deadline_ms"}
    output = msgspec.msgpack.decode(wire.encode(FROM_WORKER[2]))
    assert output == {
        "kind": "output",
        "request_id": "g1",
        "token_ids": [],
        "finish_reason": "stop",
        "prompt_tokens": 4,
        "completion_tokens": 1,
        "cached_tokens": 0,
        "logprobs": None,
    }
    assert {"stop", "length", "cancelled", "deadline"} == wire.FINISH_REASONS


def test_output_defaults_are_a_plain_step() -> None:
    decoded = wire.from_worker_decoder.decode(
        msgspec.msgpack.encode({"kind": "output", "request_id": "r", "token_ids": [7]})
    )
    assert decoded == Output(
        request_id="r", token_ids=[7], finish_reason=None, prompt_tokens=0, completion_tokens=0
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1 not msgpack",
        msgspec.msgpack.encode({"kind": "launch_missiles", "request_id": "x"}),
        msgspec.msgpack.encode({"kind": "generate", "request_id": "x", "deadline_ms": 1}),  # no request
        msgspec.msgpack.encode({"kind": "cancel", "request_id": ""}),  # empty id
        msgspec.msgpack.encode({"kind": "ping", "request_id": "x" * 129}),  # id too long
        msgspec.msgpack.encode({"kind": "generate", "request_id": "x", "request": {}, "deadline_ms": 1}),
        msgspec.msgpack.encode({"kind": "output", "request_id": "x", "token_ids": []}),  # wrong direction
        msgspec.msgpack.encode(
            {"kind": "call", "request_id": "x", "method": "", "body": 1, "deadline_ms": 1}
        ),
    ],
    ids=[
        "garbage",
        "unknown_kind",
        "missing_field",
        "empty_id",
        "long_id",
        "bad_request",
        "wrong_direction",
        "empty_method",
    ],
)
def test_to_worker_decode_errors(payload: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        wire.to_worker_decoder.decode(payload)


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode({"kind": "output", "request_id": "x", "token_ids": ["a"]}),
        msgspec.msgpack.encode({"kind": "error", "request_id": "x", "code": "500", "message": "m"}),
        msgspec.msgpack.encode({"kind": "ping", "request_id": "x"}),  # wrong direction
    ],
    ids=["bad_token_ids", "bad_code", "wrong_direction"],
)
def test_from_worker_decode_errors(payload: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        wire.from_worker_decoder.decode(payload)
