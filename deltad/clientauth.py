"""A gRPC client's credentials (bearer token, TLS CA, mTLS client certificate), re-read when
their files change, for every deltad client: the consumer library, a relay's upstream
connection, `deltad status` and the healthcheck.

::

    auth = ClientAuth(tls_ca=ca, tls_cert=cert, tls_key=key, token_file=tok)
    channel = auth.channel("host:50051")   # secure when a CA or certificate is set
    stub.Status(req, metadata=auth.metadata(), timeout=5)
    if auth.tls_changed():                 # before a (re)connect: rotated files?
        channel = auth.channel("host:50051")

A file that cannot be read at construction is a ConfigError; one that cannot be read later
(caught mid-rotation) keeps the previous credentials and logs a warning.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from deltad.errors import ConfigError

log = logging.getLogger(__name__)

#: (inode, size, mtime) of each file, or None for a missing one.
Stamp = tuple[tuple[int, int, int] | None, ...]


def file_stamp(paths: Sequence[Path | None]) -> Stamp:
    """(inode, size, mtime) of each file (symlinks followed; None: missing or no path): a
    change of any means the file was rewritten or replaced."""
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        if p is None:
            out.append(None)
            continue
        try:
            st = os.stat(p)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _read(what: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e


def check_token(token: str, where: str) -> str:
    """``token`` if an ``authorization`` header can carry it (printable ASCII, no spaces);
    ConfigError naming ``where`` otherwise (gRPC would refuse the call with a dump of its
    own, as if the server were at fault)."""
    if not token or not all("!" <= ch <= "~" for ch in token):
        raise ConfigError(
            f"{where}: the token must be printable ASCII without spaces (a header carries it)"
        )
    return token


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (its first non-empty line); ConfigError if none, or if
    it is not one a header can carry (:func:`check_token`)."""
    for line in _read("token file", path).decode("utf-8", "replace").splitlines():
        if line.strip():
            return check_token(line.strip(), f"token file {path}")
    raise ConfigError(f"token file {path} is empty")


class ClientAuth:
    """Credentials of one client (see the module docstring); thread-safe."""

    def __init__(
        self,
        *,
        token: str | None = None,
        token_file: Path | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("a client certificate and its key go together")
        self._token = None if token is None else check_token(token, "DELTAD_TOKEN / the token set")
        self._token_file = token_file
        self._tls = (tls_ca, tls_cert, tls_key)
        self._lock = threading.Lock()
        self._token_stamp: Stamp = ()
        self._tls_stamp: Stamp = ()
        self._credentials: grpc.ChannelCredentials | None = None
        #: Bumped whenever the TLS files are re-read with new contents (channels to replace).
        self.generation = 0
        self._load_token(strict=True)
        self._load_tls(strict=True)

    @classmethod
    def of(cls, settings: Any) -> ClientAuth:
        """The credentials a config names (``token``, ``token_file``, ``tls_ca``,
        ``tls_cert``, ``tls_key``: a ConsumerConfig, a RelayConfig)."""
        return cls(
            token=settings.token,
            token_file=settings.token_file,
            tls_ca=settings.tls_ca,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
        )

    @property
    def secure(self) -> bool:
        """Whether channels use TLS (a CA or a client certificate is set)."""
        return self._tls[0] is not None or self._tls[1] is not None

    # --- token ----------------------------------------------------------------------------

    def _load_token(self, strict: bool) -> None:
        if self._token_file is None:
            return
        stamp = file_stamp([self._token_file])
        if stamp == self._token_stamp:
            return
        try:
            token = read_token(self._token_file)
        except ConfigError as e:
            if strict:
                raise
            log.warning("token file not re-read, the previous token stays: %s", e)
            return
        if self._token_stamp:
            log.info("token re-read from %s", self._token_file)
        self._token, self._token_stamp = token, stamp

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (``authorization: Bearer``), the token file re-read if it
        changed."""
        with self._lock:
            self._load_token(strict=False)
            token = self._token
        return (("authorization", f"Bearer {token}"),) if token else ()

    # --- TLS ------------------------------------------------------------------------------

    def _load_tls(self, strict: bool) -> bool:
        """Re-read the TLS files if they changed; True if the credentials are new."""
        if not self.secure:
            return False
        stamp = file_stamp(self._tls)
        if stamp == self._tls_stamp:
            return False
        ca, cert, key = self._tls
        try:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read("TLS CA", ca) if ca else None,
                private_key=_read("TLS client key", key) if key else None,
                certificate_chain=_read("TLS client certificate", cert) if cert else None,
            )
        except ConfigError as e:
            if strict:
                raise
            log.warning("TLS files not re-read, the previous ones stay: %s", e)
            return False
        if self._tls_stamp:
            log.info("TLS files re-read (%s)", ", ".join(str(p) for p in self._tls if p))
        self._credentials, self._tls_stamp = creds, stamp
        self.generation += 1
        return True

    def tls_changed(self) -> bool:
        """Re-read the TLS files if they changed on disk; True if channels opened before
        should be replaced (call before a reconnect)."""
        with self._lock:
            return self._load_tls(strict=False)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A new channel to ``target`` with the current credentials (files re-read first)."""
        with self._lock:
            self._load_tls(strict=False)
            creds = self._credentials
        if creds is None:
            return grpc.insecure_channel(target, list(options))
        return grpc.secure_channel(target, creds, list(options))
