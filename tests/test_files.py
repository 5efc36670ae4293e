"""Model files by content: FileServer, fetch_file and the frontend's ModelFileStore."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq
from support.plane import write_model_dir

from dynamo_prep.card import ModelCardError, ModelDeploymentCard
from dynamo_prep.discovery.files import (
    DEFAULT_CACHE_MAX_BYTES,
    FileFetchError,
    FileServer,
    ModelFileError,
    ModelFileStore,
    default_cache_dir,
    fetch_file,
)
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.wire import ErrorReply, FetchFile, FileData

UNKNOWN = "0" * 64


class ThreadRouter:
    """A request-plane ROUTER in a thread answering FetchFile with a FileServer (or a forger)."""

    def __init__(self, server: FileServer, *, corrupt: bool = False) -> None:
        self.server = server
        self.corrupt = corrupt
        self.requests: list[FetchFile] = []
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(20, zmq.POLLIN):
                continue
            identity, payload = self._socket.recv_multipart()
            request = wire.to_worker_decoder.decode(payload)
            self.requests.append(request)
            reply = self.server.handle(request)
            if self.corrupt and isinstance(reply, FileData):
                reply = FileData(request_id=reply.request_id, sha256=reply.sha256, data=reply.data + b"!")
            self._socket.send_multipart([identity, wire.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._context.term()


@pytest.fixture
def model(tmp_path: Path) -> tuple[ModelDeploymentCard, Path]:
    directory = write_model_dir(tmp_path / "Kimi-K3-Test", chat_template="{{ messages }}")
    return ModelDeploymentCard.from_model_dir(directory), directory


@pytest.fixture
def router(model: tuple[ModelDeploymentCard, Path]) -> Iterator[ThreadRouter]:
    card, directory = model
    server = ThreadRouter(FileServer(card, directory))
    yield server
    server.close()


def test_file_server_serves_only_listed_files(model: tuple[ModelDeploymentCard, Path]) -> None:
    card, directory = model
    server = FileServer(card, directory)
    assert server.hashes == {ref.sha256 for ref in card.files.values()}
    ref = card.files["config.json"]
    reply = server.handle(FetchFile(request_id="r1", sha256=ref.sha256))
    assert isinstance(reply, FileData)
    assert reply.data == (directory / "config.json").read_bytes()
    refused = server.handle(FetchFile(request_id="r2", sha256=UNKNOWN))
    assert isinstance(refused, ErrorReply)
    assert (refused.request_id, refused.code) == ("r2", 404)


def test_file_server_refuses_a_file_changed_on_disk(model: tuple[ModelDeploymentCard, Path]) -> None:
    card, directory = model
    server = FileServer(card, directory)
    (directory / "config.json").write_text("{}")
    reply = server.handle(FetchFile(request_id="r", sha256=card.files["config.json"].sha256))
    assert isinstance(reply, ErrorReply)
    assert reply.code == 500


def test_fetch_file_over_the_wire(model: tuple[ModelDeploymentCard, Path], router: ThreadRouter) -> None:
    card, directory = model
    data = fetch_file(None, router.endpoint, card.files["tiktoken.model"].sha256, timeout_s=5)
    assert data == (directory / "tiktoken.model").read_bytes()
    with pytest.raises(FileFetchError, match="404"):
        fetch_file(None, router.endpoint, UNKNOWN, timeout_s=5)
    with pytest.raises(FileFetchError, match="not a sha256"):
        fetch_file(None, router.endpoint, "../../etc/passwd", timeout_s=5)


def test_fetch_file_rejects_a_checksum_mismatch(model: tuple[ModelDeploymentCard, Path]) -> None:
    card, directory = model
    forger = ThreadRouter(FileServer(card, directory), corrupt=True)
    try:
        with pytest.raises(FileFetchError, match="checksum"):
            fetch_file(None, forger.endpoint, card.files["config.json"].sha256, timeout_s=5)
    finally:
        forger.close()


def test_fetch_file_times_out() -> None:
    context: zmq.Context[Any] = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        with pytest.raises(FileFetchError, match="no reply"):
            fetch_file(context, silent.getsockopt_string(zmq.LAST_ENDPOINT), UNKNOWN, timeout_s=0.2)
    finally:
        silent.close(linger=0)
        context.term()


def test_store_uses_a_matching_local_dir(model: tuple[ModelDeploymentCard, Path], tmp_path: Path) -> None:
    card, directory = model
    store = ModelFileStore(tmp_path / "cache")
    assert store.model_dir_for(card, local_model_path=directory) == directory
    assert not (tmp_path / "cache").exists()


def test_store_fetches_caches_and_materializes(
    model: tuple[ModelDeploymentCard, Path], router: ThreadRouter, tmp_path: Path
) -> None:
    card, _ = model
    other_local = write_model_dir(tmp_path / "other", max_position_embeddings=8192)
    store = ModelFileStore(tmp_path / "cache")
    path = store.model_dir_for(card, local_model_path=other_local, endpoint=router.endpoint, timeout_s=5)
    assert path == tmp_path / "cache" / "models" / card.mdcsum()
    assert len(router.requests) == len(card.files)
    for ref in card.files.values():
        blob = store.blob_path(ref.sha256).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == ref.sha256
    loaded = ModelDeploymentCard.from_model_dir(path, served_name=card.display_name)
    assert loaded.mdcsum() == card.mdcsum()
    # Second call: the materialized directory is reused, nothing is fetched.
    assert store.model_dir_for(card, endpoint=router.endpoint) == path
    assert len(router.requests) == len(card.files)


@pytest.mark.parametrize(("edit", "refetched"), [("replace", 0), ("in_place", 1)])
def test_a_tampered_model_dir_is_rebuilt(
    model: tuple[ModelDeploymentCard, Path], router: ThreadRouter, tmp_path: Path, edit: str, refetched: int
) -> None:
    """A replaced file leaves its blob intact (rebuilt without fetching); the directory's file IS the
    blob (one copy), so an edit in place corrupts both and the checksum has it fetched again."""
    card, _ = model
    store = ModelFileStore(tmp_path / "cache")
    path = store.model_dir_for(card, endpoint=router.endpoint, timeout_s=5)
    if edit == "replace":
        (path / "config.json").unlink()
    (path / "config.json").write_text("tampered")
    assert store.model_dir_for(card, endpoint=router.endpoint, timeout_s=5) == path
    assert len(router.requests) == len(card.files) + refetched
    assert ModelDeploymentCard.from_model_dir(path, served_name=card.display_name).mdcsum() == card.mdcsum()


def test_store_refetches_a_corrupted_blob(
    model: tuple[ModelDeploymentCard, Path], router: ThreadRouter, tmp_path: Path
) -> None:
    card, _ = model
    store = ModelFileStore(tmp_path / "cache")
    path = store.model_dir_for(card, endpoint=router.endpoint, timeout_s=5)
    store.blob_path(card.files["config.json"].sha256).write_text("bitrot")
    (path / "config.json").unlink()
    store.model_dir_for(card, endpoint=router.endpoint, timeout_s=5)
    assert len(router.requests) == len(card.files) + 1


def test_store_refuses_unsafe_names_and_hashes(
    model: tuple[ModelDeploymentCard, Path], tmp_path: Path
) -> None:
    card, _ = model
    store = ModelFileStore(tmp_path / "cache")
    ref = card.files["config.json"]
    escaping = ModelDeploymentCard(**{**_fields(card), "files": {**card.files, "../../evil": ref}})
    with pytest.raises(ModelFileError, match="unknown model file name"):
        store.model_dir_for(card=escaping, endpoint="tcp://127.0.0.1:1")
    bad_hash = ModelDeploymentCard(
        **{**_fields(card), "files": {**card.files, "config.json": type(ref)(sha256="../x", size=1)}}
    )
    with pytest.raises(ModelFileError, match="invalid sha256"):
        store.model_dir_for(card=bad_hash, endpoint="tcp://127.0.0.1:1")
    assert not (tmp_path / "cache").exists()


def test_files_past_the_request_planes_limit_are_refused_on_both_sides(
    model: tuple[ModelDeploymentCard, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    card, directory = model
    ref = card.files["tiktoken.model"]
    huge = ModelDeploymentCard(
        **{
            **_fields(card),
            "files": {**card.files, "tiktoken.model": type(ref)(ref.sha256, wire.MAX_FILE_BYTES + 1)},
        }
    )
    with pytest.raises(ModelFileError, match="the limit is"):
        ModelFileStore(tmp_path / "cache").model_dir_for(card=huge, endpoint="tcp://127.0.0.1:1")
    # A worker never announces what it could not serve: its card is refused at build time.
    monkeypatch.setattr("dynamo_prep.card.MAX_FILE_BYTES", ref.size - 1)
    with pytest.raises(ModelCardError, match="limit of a model file"):
        ModelDeploymentCard.from_model_dir(directory)


def test_store_without_endpoint_says_so(model: tuple[ModelDeploymentCard, Path], tmp_path: Path) -> None:
    card, _ = model
    with pytest.raises(ModelFileError, match="no endpoint"):
        ModelFileStore(tmp_path / "cache").model_dir_for(card)


def test_default_cache_dir_honours_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DYN_PREP_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert ModelFileStore().root == tmp_path
    monkeypatch.delenv("DYN_PREP_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "dynamo_prep"


# --- one copy per file, and a bounded cache ---------------------------------------------------


def cache_bytes(root: Path) -> int:
    """What the cache holds on disk: every distinct file (inode) once, as ``du`` counts."""
    inodes = {}
    for path in root.rglob("*"):
        if path.is_file():
            stat = path.stat()
            inodes[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(inodes.values())


def test_a_model_dir_holds_its_blobs_not_copies(
    model: tuple[ModelDeploymentCard, Path], router: ThreadRouter, tmp_path: Path
) -> None:
    """Issue 13: a 300 MB file was stored twice (blob and model directory)."""
    card, _ = model
    store = ModelFileStore(tmp_path / "cache")
    path = store.model_dir_for(card, endpoint=router.endpoint, timeout_s=5)
    for name, ref in card.files.items():
        assert os.path.samefile(path / name, store.blob_path(ref.sha256)), name
    assert cache_bytes(tmp_path / "cache") == sum(ref.size for ref in card.files.values())


def test_a_model_dir_on_another_filesystem_gets_copies(
    model: tuple[ModelDeploymentCard, Path], router: ThreadRouter, tmp_path: Path
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem to put the model directories on")
    models = Path(tempfile.mkdtemp(dir=shm))
    try:
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "models").symlink_to(models)
        store = ModelFileStore(tmp_path / "cache")
        path = store.model_dir_for(card := model[0], endpoint=router.endpoint, timeout_s=5)
        for name, ref in card.files.items():
            assert not os.path.samefile(path / name, store.blob_path(ref.sha256))
            assert (path / name).read_bytes() == store.blob_path(ref.sha256).read_bytes()
        assert (
            ModelDeploymentCard.from_model_dir(path, served_name=card.display_name).mdcsum() == card.mdcsum()
        )
    finally:
        shutil.rmtree(models)


class Served:
    """A model directory of its own (a distinct chat template of ``size`` bytes), served by a worker."""

    def __init__(self, tmp_path: Path, name: str, size: int) -> None:
        template = name + "{{ messages }}" + "#" * size
        self.directory = write_model_dir(tmp_path / name, chat_template=template)
        self.card = ModelDeploymentCard.from_model_dir(self.directory)
        self.router = ThreadRouter(FileServer(self.card, self.directory))
        self.template = self.card.files["chat_template.jinja"].sha256

    def fetch(self, store: ModelFileStore) -> Path:
        return store.model_dir_for(self.card, endpoint=self.router.endpoint, timeout_s=5)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[list[Served]]:
    models = [Served(tmp_path, name, 200_000) for name in ("a", "b", "c")]
    yield models
    for served in models:
        served.router.close()


def test_the_cap_evicts_the_least_recently_used_model(served: list[Served], tmp_path: Path) -> None:
    a, b, c = served
    shared = sum(ref.size for name, ref in a.card.files.items() if name != "chat_template.jinja")
    one_model = shared + a.card.files["chat_template.jinja"].size
    store = ModelFileStore(tmp_path / "cache", max_bytes=shared + 2 * (one_model - shared) + 1000)
    for model in (a, b):
        model.fetch(store)
        store.release(model.card.mdcsum())
    a.fetch(store)  # a is used again: b is now the least recently used
    store.release(a.card.mdcsum())
    c_dir = c.fetch(store)
    assert not (store.models / b.card.mdcsum()).exists()
    assert not store.blob_path(b.template).exists()
    assert (store.models / a.card.mdcsum()).is_dir() and store.blob_path(a.template).is_file()
    for ref in c.card.files.values():  # c's files (the tokenizer shared with a and b among them) stay
        assert store.blob_path(ref.sha256).is_file()
    assert (
        ModelDeploymentCard.from_model_dir(c_dir, served_name=c.card.display_name).mdcsum() == c.card.mdcsum()
    )
    assert cache_bytes(store.root) <= store.max_bytes
    assert [r.sha256 for r in b.router.requests] == [b.template]  # b shared the rest with a
    b.fetch(store)  # an evicted model comes back: only what was evicted is fetched again
    assert [r.sha256 for r in b.router.requests] == [b.template, b.template]


def test_live_models_are_never_evicted(served: list[Served], tmp_path: Path) -> None:
    store = ModelFileStore(tmp_path / "cache", max_bytes=1)
    with structlog.testing.capture_logs() as logs:
        dirs = [model.fetch(store) for model in served]
    for model, directory in zip(served, dirs, strict=True):
        assert ModelDeploymentCard.from_model_dir(directory, served_name="x").files == model.card.files
    warnings = [entry for entry in logs if entry["event"] == "model_cache_over_limit"]
    assert warnings and warnings[-1]["live_models"] == 3 and warnings[-1]["max_bytes"] == 1
    store.release(served[0].card.mdcsum())
    freed = store.evict()
    assert freed >= served[0].card.files["chat_template.jinja"].size
    assert not (store.models / served[0].card.mdcsum()).exists()
    assert all((store.models / model.card.mdcsum()).is_dir() for model in served[1:])


def test_a_failed_fetch_leaves_nothing_live(model: tuple[ModelDeploymentCard, Path], tmp_path: Path) -> None:
    card, _ = model
    store = ModelFileStore(tmp_path / "cache", max_bytes=0)
    with pytest.raises(ModelFileError):
        store.model_dir_for(card)
    assert store._live == {}


def test_the_cap_defaults_to_4_gib_and_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_PREP_CACHE_MAX_BYTES", raising=False)
    assert ModelFileStore(Path("/nonexistent")).max_bytes == DEFAULT_CACHE_MAX_BYTES == 4 << 30
    monkeypatch.setenv("DYN_PREP_CACHE_MAX_BYTES", "1000")
    assert ModelFileStore(Path("/nonexistent")).max_bytes == 1000
    monkeypatch.setenv("DYN_PREP_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ModelFileError, match="DYN_PREP_CACHE_MAX_BYTES must be a number of bytes"):
        ModelFileStore(Path("/nonexistent"))


def _fields(card: ModelDeploymentCard) -> dict[str, Any]:
    return {name: getattr(card, name) for name in card.__struct_fields__}


def test_only_new_bytes_start_an_eviction_scan(served: list[Served], tmp_path: Path) -> None:
    """A model whose files are all cached already (another name for the same files) links them and
    adds no bytes, so it does not scan the cache: 10,000 such names scanned it 10,000 times."""
    a, b, _ = served
    store = ModelFileStore(tmp_path / "cache", max_bytes=1)
    a.fetch(store)
    store.release(a.card.mdcsum())  # over the cap, evictable
    alias = ModelDeploymentCard(**{**_fields(a.card), "display_name": "alias-of-a", "slug": "alias-of-a"})
    assert alias.mdcsum() != a.card.mdcsum()
    with structlog.testing.capture_logs() as logs:
        store.model_dir_for(alias, endpoint=a.router.endpoint, timeout_s=5)
        assert not [entry for entry in logs if entry["event"] == "model_cache_evicted"]
        assert (store.models / a.card.mdcsum()).is_dir()  # no scan, so a is still there
        b.fetch(store)  # new bytes: the scan runs and evicts a
    assert [entry for entry in logs if entry["event"] == "model_cache_evicted"]
    assert not (store.models / a.card.mdcsum()).exists()
