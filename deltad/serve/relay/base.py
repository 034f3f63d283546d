"""What every relay is: a sidecar in relay mode (its own spool, Redis, cursors, retention and
forms) whose spool a follower fills instead of a trainer. The followers differ
(:class:`~deltad.serve.relay.server.RelayServer`: an upstream sidecar or relay;
:class:`~deltad.serve.relay.archived.ArchiveRelayServer`: the object store); the surface is
this one."""

from __future__ import annotations

from deltad.config import ServerConfig
from deltad.serve.edge.app import SidecarServer

__all__ = ["RelayedSidecar"]


class RelayedSidecar:
    """The surface of :class:`~deltad.serve.edge.app.SidecarServer` (``port``, ``endpoint``,
    ``wait``, ``reload_credentials``) over the relay-mode sidecar ``server``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server = SidecarServer(config, relay=True)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def reload_credentials(self) -> bool:
        """Re-read the relay's own tokens file (SIGHUP), as a sidecar does."""
        return self.server.reload_credentials()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or ``timeout`` (False)."""
        return self.server.wait(timeout)
