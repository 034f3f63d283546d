"""Relay sidecars: ``deltad serve --upstream HOST:PORT`` mirrors one rank's log from an upstream
sidecar (or another relay) into its own spool and serves it to its own predictors.

::

    relay = RelayServer(ServerConfig(spool_dir=..., model="m", rank=0, listen=...),
                        RelayConfig(upstream="sidecar-0:50051", consumer="relay-a")).start()

A relay is an ordinary sidecar (:class:`~deltad.serve.edge.app.SidecarServer`: its own spool, its
own Redis with its own consumers' cursors, retention, every GetDelta form, top-k with owed rows
per downstream consumer) whose spool is written by a :class:`RelayMirror` instead of a trainer.
Its data path: :mod:`~deltad.serve.relay.upstream` (the calls to the upstream) ->
:mod:`~deltad.serve.relay.mirror` (what each pull becomes: numbering, durability, generations,
dense states) -> :mod:`~deltad.serve.relay.spool` (the segments written) -> this sidecar.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from deltad.config import RelayConfig, ServerConfig
from deltad.errors import ConfigError, DeltadError
from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.app import LOOPBACK_HOSTS
from deltad.serve.relay.base import RelayedSidecar
from deltad.serve.relay.mirror import RelayMirror
from deltad.serve.relay.spool import clean_temp_files
from deltad.serve.relay.upstream import refuses

__all__ = ["RelayMirror", "RelayServer", "clean_temp_files", "refuses"]

log = logging.getLogger(__name__)


class RelayServer(RelayedSidecar):
    """A sidecar whose spool a :class:`RelayMirror` fills from ``relay.upstream``.

    Same surface as :class:`~deltad.serve.edge.app.SidecarServer` (``start``, ``port``,
    ``endpoint``, ``stop``, ``wait``); Status says ``upstream``. ``wait`` also returns when
    the mirror stopped for good (``error``: an upstream of another model or rank).
    """

    def __init__(self, config: ServerConfig, relay: RelayConfig) -> None:
        super().__init__(config)
        self.relay = relay
        self.mirror: RelayMirror | None = None
        self._failed = threading.Event()

    @property
    def error(self) -> DeltadError | None:
        return self.mirror.error if self.mirror is not None else None

    def start(self) -> RelayServer:
        """Clean temp files, start the sidecar, then the mirror; raises DeltadError."""
        layout = SpoolLayout(self.config.spool_dir, self.config.model)
        n = clean_temp_files(layout, self.config.rank)
        if n:
            log.info("deleted %d temp file(s) of an interrupted write", n)
        self.server.start()
        try:
            self._refuse_itself()
            self.server.servicer.upstream = self.relay.upstream
            self.mirror = RelayMirror(self.relay, self.server, lambda e: self._failed.set())
            self.server.servicer.windows.dense_check = self.mirror.dense_missing
            self.server.servicer.windows.upstream_check = self.mirror.lost
            self.mirror.track(self.server.metrics)
            self.mirror.start()
        except BaseException:
            self.server.stop(0)
            raise
        return self

    def _refuse_itself(self) -> None:
        """ConfigError if ``--upstream`` is this relay's own port on this machine (it would
        mirror itself forever and say SERVING)."""
        host, _, port = self.relay.upstream.rpartition(":")
        host = host.rsplit("/", 1)[-1].removeprefix("ipv4:").removeprefix("ipv6:")
        listen_host = self.config.listen.rpartition(":")[0]
        local = {*LOOPBACK_HOSTS, "0.0.0.0", "[::]", listen_host, socket.gethostname(),
                 socket.getfqdn()}  # fmt: skip
        if port == str(self.server.port) and host in local:
            raise ConfigError(
                f"--upstream {self.relay.upstream} is this relay itself (it listens on port "
                f"{self.server.port}): give the sidecar or relay it mirrors"
            )

    def stop(self, grace: float | None = None) -> None:
        if self.mirror is not None:
            self.mirror.stop()
        self.server.stop(grace)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops or the mirror failed (True), or ``timeout`` (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._failed.is_set() or self.server.wait(0):
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._failed.wait(0.2 if left is None else min(0.2, left))
