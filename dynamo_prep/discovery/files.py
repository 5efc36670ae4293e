"""Model files by content: a worker serves its card's files, a frontend fetches and caches them.

Nothing that arrives on the wire is ever used as a path. The worker serves only files its own
card lists, looked up by sha256; the frontend accepts only the known logical file names a card
may carry and names blobs after verified, validated hashes. The cache holds one copy of each
file (model directories hard-link their blobs) and stays under a size cap (``ModelFileStore``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog
import zmq

from dynamo_prep.card import (
    CARD_FILE_NAMES,
    ModelDeploymentCard,
    file_ref,
    model_files,
)
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.wire import MAX_FILE_BYTES, ErrorReply, FetchFile, FileData

__all__ = [
    "DEFAULT_CACHE_MAX_BYTES",
    "FileFetchError",
    "FileServer",
    "ModelFileError",
    "ModelFileStore",
    "default_cache_dir",
    "default_cache_max_bytes",
    "fetch_file",
]

log = structlog.get_logger("dynamo_prep.discovery")

CACHE_DIR_ENV = "DYN_PREP_CACHE_DIR"
CACHE_MAX_BYTES_ENV = "DYN_PREP_CACHE_MAX_BYTES"
DEFAULT_CACHE_MAX_BYTES = 4 << 30  # 16 files of the largest size the request plane carries
KNOWN_FILE_NAMES = CARD_FILE_NAMES
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
REPLY_OVERHEAD_BYTES = 4096  # a FileData's envelope around the file's bytes


class FileFetchError(RuntimeError):
    """A file could not be fetched from a worker: timeout, error reply or checksum mismatch."""


class ModelFileError(ValueError):
    """A card's files cannot be materialized (unknown file name, invalid hash, no endpoint)."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FileServer:
    """Worker side: answers ``FetchFile`` with the bytes of a file the card lists, by sha256."""

    def __init__(self, card: ModelDeploymentCard, model_dir: Path) -> None:
        paths = model_files(model_dir)
        self._paths = {ref.sha256: paths[name] for name, ref in card.files.items() if name in paths}

    @property
    def hashes(self) -> frozenset[str]:
        return frozenset(self._paths)

    def handle(self, request: FetchFile) -> FileData | ErrorReply:
        """The file's bytes; 404 for a hash the card does not list, 500 if the file changed on disk."""
        path = self._paths.get(request.sha256)
        if path is None:
            return ErrorReply(request_id=request.request_id, code=404, message="no such file in this card")
        try:
            data = path.read_bytes()
        except OSError as exc:
            log.error("model_file_unreadable", sha256=request.sha256, error=str(exc))
            return ErrorReply(request_id=request.request_id, code=500, message="file unreadable")
        if _sha256(data) != request.sha256:
            log.error("model_file_changed", sha256=request.sha256, path=str(path))
            return ErrorReply(request_id=request.request_id, code=500, message="file changed on disk")
        return FileData(request_id=request.request_id, sha256=request.sha256, data=data)


def fetch_file(
    context: zmq.Context[Any] | None, endpoint: str, sha256: str, *, timeout_s: float = 10.0
) -> bytes:
    """Fetch one file from a worker's request plane, verified by sha256 (blocking).

    ``context`` may be an asyncio context: a synchronous shadow of it is used, so this can run in
    a thread (``asyncio.to_thread``) of a process whose sockets are asyncio.
    """
    if not _SHA256.match(sha256):
        raise FileFetchError(f"not a sha256: {sha256[:80]!r}")
    ctx: zmq.Context[Any] = zmq.Context.shadow(context.underlying) if context else zmq.Context.instance()
    request_id = uuid.uuid4().hex
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FILE_BYTES + REPLY_OVERHEAD_BYTES)  # bigger: disconnected
    try:
        socket.connect(endpoint)
        socket.send(wire.encode(FetchFile(request_id=request_id, sha256=sha256)))
        reply = _await_reply(socket, request_id, time.monotonic() + timeout_s, endpoint)
    finally:
        socket.close(linger=0)
    if isinstance(reply, ErrorReply):
        raise FileFetchError(f"{endpoint}: file {sha256} refused: {reply.code} {reply.message}")
    if reply.sha256 != sha256 or _sha256(reply.data) != sha256:
        raise FileFetchError(f"{endpoint}: file {sha256} failed checksum verification")
    return reply.data


def _await_reply(
    socket: zmq.Socket[Any], request_id: str, deadline: float, endpoint: str
) -> FileData | ErrorReply:
    """The reply matching ``request_id``; other or undecodable frames are skipped until the deadline."""
    while (remaining := deadline - time.monotonic()) > 0:
        if not socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
            break
        try:
            reply = wire.decode_from_worker(socket.recv())
        except wire.WireDecodeError:
            continue
        if reply.request_id == request_id and isinstance(reply, FileData | ErrorReply):
            return reply
    raise FileFetchError(f"{endpoint}: no reply within the timeout")


def default_cache_dir() -> Path:
    """``$DYN_PREP_CACHE_DIR``, else ``~/.cache/dynamo_prep``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "dynamo_prep"


def default_cache_max_bytes() -> int:
    """``$DYN_PREP_CACHE_MAX_BYTES``, else ``DEFAULT_CACHE_MAX_BYTES`` (4 GiB)."""
    configured = os.environ.get(CACHE_MAX_BYTES_ENV)
    if not configured:
        return DEFAULT_CACHE_MAX_BYTES
    try:
        value = int(configured)
    except ValueError:
        value = -1
    if value < 0:
        raise ModelFileError(f"{CACHE_MAX_BYTES_ENV} must be a number of bytes, got {configured!r}")
    return value


class ModelFileStore:
    """Frontend side: a content-addressed cache (``root/blobs/<sha256>``) of model files.

    ``model_dir_for`` gives a directory ``ModelDeploymentCard.from_model_dir`` can read and whose
    files match the card byte for byte: a local model directory if its checksums match, else
    ``root/models/<mdcsum>/`` materialized from blobs, fetching missing blobs from the worker.

    One copy per file: a model directory hard-links its blobs (a copy only where the filesystem
    cannot link), so a checksum mismatch in either is the same corruption, found and re-fetched.
    The cache stays under ``max_bytes`` (distinct files counted once): after each materialization
    the least recently used model directories and blobs are evicted, except those of models this
    store handed out and that were not ``release``d since (their builds may read them again).
    """

    def __init__(self, root: Path | None = None, *, max_bytes: int | None = None) -> None:
        self.root = root or default_cache_dir()
        self.blobs = self.root / "blobs"
        self.models = self.root / "models"
        self.max_bytes = default_cache_max_bytes() if max_bytes is None else max_bytes
        self._lock = threading.Lock()  # builds run in threads: eviction and the live set are shared
        # One eviction at a time. Its scan (every entry of the cache) runs outside ``_lock``, which
        # ``release`` takes on the event loop: a scan of thousands of models must not stall it.
        self._evicting = threading.Lock()
        self._live: dict[str, tuple[str, ...]] = {}  # mdcsum -> its blobs' sha256, kept from eviction
        self._clock_ns = 0  # the last use stamped (mtime is the LRU clock; file times are coarse)

    def model_dir_for(
        self,
        card: ModelDeploymentCard,
        *,
        local_model_path: Path | None = None,
        endpoint: str | None = None,
        timeout_s: float = 10.0,
        context: zmq.Context[Any] | None = None,
    ) -> Path:
        _check_card_files(card)
        mdcsum = card.mdcsum()
        if local_model_path is not None and _local_matches(card, local_model_path):
            log.info("model_files_local", model=card.display_name, mdcsum=mdcsum, path=str(local_model_path))
            return resolve_model_dir(local_model_path)
        with self._lock:  # live before anything is fetched: a concurrent eviction keeps its blobs
            was_live = mdcsum in self._live
            self._live[mdcsum] = tuple(ref.sha256 for ref in card.files.values())
        try:
            return self._cached_dir(card, mdcsum, endpoint, timeout_s, context)
        except BaseException:
            if not was_live:
                self.release(mdcsum)
            raise

    def _cached_dir(
        self,
        card: ModelDeploymentCard,
        mdcsum: str,
        endpoint: str | None,
        timeout_s: float,
        context: zmq.Context[Any] | None,
    ) -> Path:
        target = self.models / mdcsum
        blobs = [self.blob_path(ref.sha256) for ref in card.files.values()]
        if _dir_matches(card, target):
            self._touch([target, *blobs])
            log.info(
                "model_files_cached", model=card.display_name, mdcsum=mdcsum, path=str(target), fetched=0
            )
            return target
        fetched = self._ensure_blobs(card, endpoint, timeout_s, context)
        linked = self._materialize(card, target)
        self._touch([target, *blobs])
        log.info(
            "model_files_cached",
            model=card.display_name,
            mdcsum=mdcsum,
            path=str(target),
            fetched=fetched,
            linked=linked,
        )
        if fetched or linked < len(blobs):
            # Only new bytes can push the cache over its cap: a directory of hard links to blobs
            # already held adds none, and scanning thousands of entries per build would not be free.
            self.evict()
        return target

    def release(self, mdcsum: str) -> None:
        """The model left this process: its directory and blobs may be evicted from now on."""
        with self._lock:
            self._live.pop(mdcsum, None)

    def evict(self) -> int:
        """Remove least recently used entries no live model uses until the cache fits ``max_bytes``;
        returns the bytes freed. Over the cap with only live entries left, it warns and keeps them."""
        with self._evicting:
            usage = _CacheUsage(self.blobs, self.models)  # entries added after the scan are kept
            if usage.total <= self.max_bytes:
                return 0
            return self._evict(usage)

    def _evict(self, usage: _CacheUsage) -> int:
        """The removals, under ``_lock``: a model made live since the scan keeps its entries."""
        with self._lock:
            before, evicted = usage.total, 0
            live_blobs = {sha for blobs in self._live.values() for sha in blobs}
            for path in usage.least_recently_used():
                if usage.total <= self.max_bytes:
                    break
                if path.name in self._live or path.name in live_blobs:
                    continue
                usage.remove(path)
                evicted += 1
            freed = before - usage.total
            log.info("model_cache_evicted", entries=evicted, freed_bytes=freed, cache_bytes=usage.total)
            if usage.total > self.max_bytes:
                log.warning(
                    "model_cache_over_limit",
                    cache_bytes=usage.total,
                    max_bytes=self.max_bytes,
                    live_models=len(self._live),
                )
            return freed

    def _touch(self, paths: Iterable[Path]) -> None:
        """Mark entries as used now, each later than any entry marked before (an LRU order even
        when file timestamps tick coarser than uses)."""
        with self._lock:
            self._clock_ns = stamp = max(time.time_ns(), self._clock_ns + 1)
        for path in paths:
            with contextlib.suppress(OSError):  # evicted meanwhile by another store on this directory
                os.utime(path, ns=(stamp, stamp))

    def blob_path(self, sha256: str) -> Path:
        if not _SHA256.match(sha256):
            raise ModelFileError(f"not a sha256: {sha256[:80]!r}")
        return self.blobs / sha256

    def _ensure_blobs(
        self,
        card: ModelDeploymentCard,
        endpoint: str | None,
        timeout_s: float,
        context: zmq.Context[Any] | None,
    ) -> int:
        """Fetch every blob the cache lacks (or holds corrupted); returns how many were fetched."""
        fetched = 0
        for ref in card.files.values():
            path = self.blob_path(ref.sha256)
            if path.is_file() and file_ref(path) == ref:
                continue
            if endpoint is None:
                raise ModelFileError(
                    f"model file {ref.sha256} is not cached and no endpoint to fetch it from"
                )
            data = fetch_file(context, endpoint, ref.sha256, timeout_s=timeout_s)
            if len(data) != ref.size:
                raise FileFetchError(
                    f"{endpoint}: file {ref.sha256} has {len(data)} bytes, card says {ref.size}"
                )
            _atomic_write(path, data)
            fetched += 1
            log.info("model_file_fetched", sha256=ref.sha256, size=len(data), endpoint=endpoint)
        return fetched

    def _materialize(self, card: ModelDeploymentCard, target: Path) -> int:
        """Build the directory beside ``target`` and rename it into place (readers never see half);
        returns how many files are hard links to their blobs (the rest are copies)."""
        self.models.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.models))
        linked = 0
        try:
            for name, ref in card.files.items():
                linked += _link_or_copy(self.blob_path(ref.sha256), staging / name)
            if target.exists():
                shutil.rmtree(target)  # stale or corrupted: _dir_matches said so
            os.replace(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not _dir_matches(card, target):  # a concurrent writer may have won the rename
                raise
        return linked


class _CacheUsage:
    """The cache's blobs and model directories, and its size: each distinct file (inode) once."""

    def __init__(self, blobs: Path, models: Path) -> None:
        self._entries: list[tuple[int, Path]] = []  # (last use in ns, blob or model directory)
        self._files: dict[Path, list[tuple[int, int]]] = {}  # entry -> the inodes it holds
        self._links: dict[tuple[int, int], int] = {}  # inode -> names in the cache
        self._sizes: dict[tuple[int, int], int] = {}
        for blob in _children(blobs):
            self._add(blob, [blob])
        for model in _children(models):
            self._add(model, list(_children(model)))
        self.total = sum(self._sizes.values())

    def least_recently_used(self) -> list[Path]:
        return [path for _, path in sorted(self._entries, key=lambda entry: entry[0])]

    def remove(self, path: Path) -> None:
        """Delete an entry; the bytes of files that lose their last name in the cache are freed."""
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        for inode in self._files.pop(path, []):
            self._links[inode] -= 1
            if not self._links[inode]:
                self.total -= self._sizes[inode]

    def _add(self, entry: Path, files: list[Path]) -> None:
        try:
            last_use = entry.stat().st_mtime_ns
            stats = [file.stat() for file in files]
        except OSError:  # removed meanwhile (another store on the same directory)
            return
        inodes = [(stat.st_dev, stat.st_ino) for stat in stats]
        for inode, stat in zip(inodes, stats, strict=True):
            self._links[inode] = self._links.get(inode, 0) + 1
            self._sizes[inode] = stat.st_size
        self._entries.append((last_use, entry))
        self._files[entry] = inodes


def _children(directory: Path) -> list[Path]:
    """Entries of a cache directory, without the ``.tmp-`` files and directories being written."""
    try:
        return [path for path in directory.iterdir() if not path.name.startswith(".")]
    except OSError:
        return []


def _link_or_copy(blob: Path, target: Path) -> bool:
    """Hard-link ``blob`` as ``target``; copy it where the filesystem cannot link (True: linked)."""
    try:
        os.link(blob, target)
    except OSError:
        shutil.copyfile(blob, target)
        return False
    return True


def _check_card_files(card: ModelDeploymentCard) -> None:
    """Refuse names and hashes from the wire that could escape the cache or confuse the loader."""
    for name, ref in card.files.items():
        if name not in KNOWN_FILE_NAMES:
            raise ModelFileError(f"card lists an unknown model file name {name[:80]!r}")
        if not _SHA256.match(ref.sha256):
            raise ModelFileError(f"card lists {name} with an invalid sha256")
        if not 0 <= ref.size <= MAX_FILE_BYTES:
            raise ModelFileError(f"card lists {name} of {ref.size} bytes (the limit is {MAX_FILE_BYTES})")


def _local_matches(card: ModelDeploymentCard, path: Path) -> bool:
    try:
        files = model_files(resolve_model_dir(path))
        return {name: file_ref(file) for name, file in files.items()} == card.files
    except (OSError, ValueError):
        return False


def _dir_matches(card: ModelDeploymentCard, path: Path) -> bool:
    try:
        return path.is_dir() and all(file_ref(path / name) == ref for name, ref in card.files.items())
    except OSError:
        return False


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory and rename, so a crash never leaves half a blob."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
