"""CURVE trust for the discovery plane: who may announce, and which key announced what.

Rules: the side that binds is the CURVE server (allow-list + ZAP authenticator), workers are
clients. The server socket's ``zap_domain`` and the domain the allow-list is registered under must
agree (both default to ``ZAP_DOMAIN``), or every client is rejected. The authenticated key of a
message is its ZMTP ``User-Id`` (``authenticated_key``, on frames received with ``copy=False``);
receivers key their instance table on it. docs/discovery.md ("Trust") has the whole picture.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "ZAP_DOMAIN",
    "AllowList",
    "ClientCurve",
    "ServerCurve",
    "TrustError",
    "apply_client_curve",
    "apply_server_curve",
    "authenticated_key",
    "generate_keys",
    "start_authenticator",
]

ZAP_DOMAIN = "dynamo_prep"
ALLOW_LIST_RELOAD_S = 2.0  # how soon a key removed from the allow-list stops being accepted


class TrustError(ValueError):
    """A key file or allow-list cannot be used; the message names the path."""


def generate_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, share it) and ``NAME.key_secret`` (keep it) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def _load_key_pair(secret_key_file: Path) -> tuple[bytes, bytes]:
    public, secret = _load(secret_key_file)
    if secret is None:
        raise TrustError(f"{secret_key_file}: no secret key in this file (is it the public .key?)")
    return public, secret


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise TrustError(f"{path}: cannot load CURVE key: {exc}") from exc


@dataclass(frozen=True)
class ClientCurve:
    """This process's key pair plus the public key of the server it connects to (z85 bytes)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    @classmethod
    def load(cls, secret_key_file: Path, server_key_file: Path) -> ClientCurve:
        public, secret = _load_key_pair(secret_key_file)
        server_public, _ = _load(server_key_file)
        return cls(public_key=public, secret_key=secret, server_key=server_public)


@dataclass(frozen=True)
class ServerCurve:
    """The receiving side's key pair and the directory of public keys allowed to connect."""

    public_key: bytes
    secret_key: bytes
    allow_dir: Path

    @classmethod
    def load(cls, secret_key_file: Path, allow_dir: Path) -> ServerCurve:
        if not allow_dir.is_dir():
            raise TrustError(f"{allow_dir}: CURVE allow-list directory not found")
        public, secret = _load_key_pair(secret_key_file)
        return cls(public_key=public, secret_key=secret, allow_dir=allow_dir)


def start_authenticator(
    context: zmq.Context[Any], allow_dir: Path, domain: str = ZAP_DOMAIN
) -> ThreadAuthenticator:
    """Run a ZAP handler in a thread of ``context`` that accepts only keys found in ``allow_dir``.

    It must share the context of the server socket (ZAP is an inproc endpoint). Stop it with
    ``.stop()`` before terminating the context. ``AllowList`` follows later changes of the directory.
    """
    if not allow_dir.is_dir():
        raise TrustError(f"{allow_dir}: CURVE allow-list directory not found")
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain=domain, location=str(allow_dir))
    return authenticator


class AllowList:
    """The allow-list directory as it is now: re-read when its ``*.key`` files change, so a key
    removed from it is refused from then on: new connections by the ZAP handler, and messages on
    connections it already accepted by their sender's key (``allows``)."""

    def __init__(self, directory: Path, authenticator: ThreadAuthenticator, domain: str = ZAP_DOMAIN) -> None:
        self.directory = directory
        self.keys: frozenset[str] = frozenset()
        self._authenticator = authenticator
        self._domain = domain
        self._seen: tuple[tuple[str, int, int], ...] | None = None
        self._checked = time.monotonic()
        self.reload()

    def allows(self, key: str | None) -> bool:
        return key is not None and key in self.keys

    def poll(self) -> frozenset[str]:
        """``reload`` at most every ``ALLOW_LIST_RELOAD_S``: cheap to call on every wake."""
        now = time.monotonic()
        if now - self._checked < ALLOW_LIST_RELOAD_S:
            return frozenset()
        self._checked = now
        return self.reload()

    def reload(self) -> frozenset[str]:
        """Re-read the directory if it changed; the keys it no longer allows (empty: none, or no change)."""
        try:
            seen = tuple(
                sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in self.directory.glob("*.key"))
            )
            if seen == self._seen:
                return frozenset()
            keys = frozenset(key.decode() for key in zmq.auth.load_certificates(str(self.directory)))
        except (OSError, ValueError):  # a file half written or a directory gone: keep the last good list
            return frozenset()
        self._authenticator.configure_curve(domain=self._domain, location=str(self.directory))
        removed = self.keys - keys
        self.keys, self._seen = keys, seen
        return removed


def apply_server_curve(socket: zmq.Socket[Any], curve: ServerCurve, domain: str = ZAP_DOMAIN) -> None:
    """Make ``socket`` a CURVE server checked by the authenticator registered under ``domain``."""
    socket.curve_secretkey = curve.secret_key
    socket.curve_publickey = curve.public_key
    socket.curve_server = True
    socket.zap_domain = domain.encode()


def apply_client_curve(socket: zmq.Socket[Any], curve: ClientCurve) -> None:
    """Make ``socket`` a CURVE client of the server whose public key ``curve`` carries."""
    socket.curve_secretkey = curve.secret_key
    socket.curve_publickey = curve.public_key
    socket.curve_serverkey = curve.server_key


def authenticated_key(frame: zmq.Frame) -> str | None:
    """The z85 public key that sent ``frame`` (received with ``copy=False``), None without CURVE."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user_id if isinstance(user_id, str) and user_id else None
