"""A hostile worker in raw pyzmq: a ROUTER speaking the request-plane wire as a broken or malicious
worker would (tests/test_hostile_replies.py, benchmarks/hostile_replies.py).

It serves its card's files (so a frontend can build the model from it alone) and answers Pings;
what it does with a ``Generate`` is its ``behaviour``: a function called with the worker, the
requester's identity and the request, returning an iterator of frames to send (sent between reads,
so Pings and Cancels are still seen while it floods).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

from dynamo_prep.card import ModelDeploymentCard, encode_card
from dynamo_prep.discovery.files import FileServer
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol import wire

Frames = Iterator[bytes]
Behaviour = Callable[["FakeWorker", wire.Generate], Frames]
BATCH = 512  # frames sent between two reads


def silent(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Answers Pings, never a token."""
    del worker, request
    return iter(())


class FakeWorker:
    """A ROUTER on loopback driven by a thread; ``received`` lists every decoded message."""

    def __init__(self, model: str, behaviour: Behaviour = silent, *, answer_pings: bool = True) -> None:
        self.card = ModelDeploymentCard.from_model_dir(model)
        self.files = FileServer(self.card, Path(resolve_model_dir(model)))
        self.behaviour = behaviour
        self.answer_pings = answer_pings
        self.context: zmq.Context[Any] = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # a flood is not dropped here
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.received: list[wire.ToWorker] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-worker")
        self._thread.start()

    def card_fields(self, **changes: Any) -> dict[str, Any]:
        card: dict[str, Any] = msgspec.msgpack.decode(encode_card(self.card))
        return {**card, **changes}

    def of_kind(self, kind: type[Any]) -> list[Any]:
        return [message for message in list(self.received) if isinstance(message, kind)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.socket.close(linger=0)
        self.context.term()

    def _run(self) -> None:
        streams: list[tuple[bytes, Frames]] = []
        while not self._stop.is_set():
            if self.socket.poll(0 if streams else 20):
                self._read(streams)
            for identity, frames in list(streams):
                for _, frame in zip(range(BATCH), frames, strict=False):
                    self.socket.send_multipart([identity, frame])
                    self.sent += 1
            streams = [(identity, frames) for identity, frames in streams if _more(frames)]

    def _read(self, streams: list[tuple[bytes, Frames]]) -> None:
        while True:
            try:
                identity, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = wire.decode_to_worker(payload)
            self.received.append(message)
            if isinstance(message, wire.Ping) and self.answer_pings:
                self.socket.send_multipart([identity, wire.encode(wire.Pong(request_id=message.request_id))])
            elif isinstance(message, wire.FetchFile):
                self.socket.send_multipart([identity, wire.encode(self.files.handle(message))])
            elif isinstance(message, wire.Generate):
                streams.append((identity, _Peekable(self.behaviour(self, message))))


class _Peekable:
    """An iterator that can say whether it has more without losing an item."""

    def __init__(self, frames: Frames) -> None:
        self._frames = frames
        self._next: list[bytes] = []

    def __iter__(self) -> _Peekable:
        return self

    def __next__(self) -> bytes:
        if self._next:
            return self._next.pop()
        return next(self._frames)

    def more(self) -> bool:
        if not self._next:
            try:
                self._next.append(next(self._frames))
            except StopIteration:
                return False
        return True


def _more(frames: Frames) -> bool:
    return frames.more() if isinstance(frames, _Peekable) else True
