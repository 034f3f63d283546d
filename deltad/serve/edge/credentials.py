"""The sidecar's own credentials: the tokens file and the TLS files, loaded, checked and reloaded without a restart."""

from __future__ import annotations

import logging
import ssl
import threading
from pathlib import Path
from typing import Any

import grpc

from deltad.clientauth import file_stamp
from deltad.config import ServerConfig
from deltad.errors import ConfigError
from deltad.serve.edge.auth import Credentials, load_tokens_file
from deltad.serve.edge.gate import Gate

log = logging.getLogger(__name__)

#: Look for rewritten credential files (tokens, TLS) this often; a change reloads them as
#: SIGHUP does (mounted secrets rotate without a signal).
CREDENTIALS_WATCH_S = 1.0


def check_tls_files(cert: Path, key: Path, ca: Path | None) -> None:
    """ConfigError unless ``cert`` and ``key`` are a matching PEM pair and ``ca`` (if any)
    holds PEM certificates: a bad file must not replace good ones (every later handshake
    would fail)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
        if ca is not None:
            ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"bad TLS files ({cert}, {key}, {ca}): {e}") from e


def _read(path: Any) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


class ServerCredentials:
    """The credentials a :class:`ServerConfig` names: scoped tokens (``tokens``, ``tokens_file``)
    for the edge :class:`Gate`, and the TLS certificate, key and client CA, served through
    gRPC's dynamic credentials so that a reload reaches the connections made after it."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._tls_lock = threading.Lock()
        self._tls_pending: grpc.ServerCertificateConfiguration | None = None
        self._stamp: tuple[object, ...] = ()
        #: the TLS files' bytes in force (a reload with the same bytes changes nothing)
        self._tls_loaded: tuple[bytes, ...] = ()

    def tokens(self) -> Credentials | None:
        """The scoped credentials (None: no authorization); ConfigError on a bad file."""
        cfg = self.config
        creds = load_tokens_file(cfg.tokens_file) if cfg.tokens_file is not None else None
        if cfg.tokens:
            full = Credentials.full_access(cfg.tokens)
            if creds is None:
                return full
            return Credentials({**full.tokens, **creds.tokens}, creds.identities)
        return creds

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """The port's credentials (None: no TLS configured, an insecure port)."""
        cfg = self.config
        if cfg.tls_cert is None or cfg.tls_key is None:
            return None
        # dynamic: reload() swaps certificate, key and client CA for the connections made
        # after it (gRPC asks _tls_fetch at every handshake)
        self._tls_loaded = self._tls_files()
        return grpc.dynamic_ssl_server_credentials(
            self._tls_configuration(),
            self._tls_fetch,
            require_client_authentication=cfg.tls_client_ca is not None,
        )

    def _tls_configuration(self) -> grpc.ServerCertificateConfiguration:
        """The TLS files as one gRPC certificate configuration; ConfigError if one cannot
        be read, or the key does not match the certificate, or a file is not PEM."""
        cfg = self.config
        assert cfg.tls_cert is not None and cfg.tls_key is not None
        check_tls_files(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        return grpc.ssl_server_certificate_configuration(
            [(_read(cfg.tls_key), _read(cfg.tls_cert))],
            root_certificates=_read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
        )

    def _tls_fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake question: a new configuration (once), or None: no change."""
        with self._tls_lock:
            new, self._tls_pending = self._tls_pending, None
        return new

    def _files(self) -> list[Path | None]:
        cfg = self.config
        files = [cfg.tokens_file, cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca]
        return files if any(f is not None for f in files) else []

    def start_watch(self) -> bool:
        """Note the files as they are now, for :meth:`watch`; False: no file to watch."""
        if not self._files():
            return False
        self._stamp = file_stamp(self._files())
        return True

    def watch(self, gate: Gate) -> bool:
        """Reload the credentials (into ``gate``) if a tokens or TLS file changed on disk
        since the last look (a broken new file is logged once, not every look); True if it
        reloaded."""
        stamp = file_stamp(self._files())
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        log.warning("credential files changed on disk: reloading")
        self.reload(gate)
        return True

    def reload(self, gate: Gate) -> bool:
        """Re-read ``tokens_file`` (into ``gate``) and the TLS certificate, key and client CA
        (SIGHUP); a bad file keeps the old credentials of its kind, logged. True if all new
        ones are in force (TLS: for connections made from now on)."""
        ok = True
        cfg = self.config
        if cfg.tokens_file is not None:
            try:
                creds = self.tokens()
            except ConfigError as e:
                log.error("tokens file not reloaded, the previous credentials stay: %s", e)
                ok = False
            else:
                gate.set_credentials(creds)
                n_tokens = len(creds.tokens) if creds is not None else 0
                n_ids = len(creds.identities) if creds is not None else 0
                log.warning(
                    "tokens file %s reloaded: %d tokens, %d client certificate identities",
                    cfg.tokens_file, n_tokens, n_ids,
                )  # fmt: skip
        if cfg.tls_cert is not None:
            files = self._tls_files()
            if files == self._tls_loaded:  # (the tokens file changed, or SIGHUP: nothing new)
                return ok
            try:
                tls = self._tls_configuration()
            except ConfigError as e:
                log.error("TLS files not reloaded, the previous ones stay: %s", e)
                return False
            with self._tls_lock:
                self._tls_pending = tls
            self._tls_loaded = files
            log.warning("TLS certificate, key and client CA reloaded (new connections)")
        return ok

    def _tls_files(self) -> tuple[bytes, ...]:
        """The TLS files' bytes now (empty for one that cannot be read: then they differ)."""
        out = []
        for f in (self.config.tls_cert, self.config.tls_key, self.config.tls_client_ca):
            try:
                out.append(_read(f) if f is not None else b"")
            except ConfigError:
                out.append(b"")
        return tuple(out)
