"""A relay that follows the archive: ``deltad serve --upstream-archive URL`` serves one rank's
log read from the object store (deltad.serve.archive.follow) instead of an upstream sidecar.

::

    relay = ArchiveRelayServer(ServerConfig(spool_dir=..., model="m", rank=0, listen=...),
                               ArchiveFollowConfig("s3://bucket/prefix", endpoint=...)).start()

Like :class:`~deltad.serve.relay.server.RelayServer`, an ordinary sidecar in relay mode (its own
spool, Redis, cursors, retention and forms) whose spool is written by an
:class:`~deltad.serve.archive.follow.ArchiveFollower`. Its release state is the one the
trainer's sidecars archive with every manifest (kept in its spool across restarts); it serves
nothing before it has read one. Nothing here reaches the trainer's sidecar: a region behind a
replicated bucket loads only the store.
"""

from __future__ import annotations

import logging

from deltad.config import ArchiveFollowConfig, ServerConfig
from deltad.errors import DeltadError
from deltad.serve.archive.follow import ArchiveFollower
from deltad.serve.archive.opening import open_store
from deltad.serve.relay.base import RelayedSidecar
from deltad.serve.relay.upstream_health import UpstreamHealth, track_upstream_series
from deltad.serve.state.release import FollowedRollout

__all__ = ["ArchiveRelayServer"]

log = logging.getLogger(__name__)


class ArchiveRelayServer(RelayedSidecar):
    """A sidecar whose spool an :class:`ArchiveFollower` fills from ``follow.url``.

    Same surface as :class:`~deltad.serve.relay.server.RelayServer` (``start``, ``port``,
    ``endpoint``, ``stop``, ``wait``, ``error``); Status says ``upstream`` (the store's URL)."""

    def __init__(self, config: ServerConfig, follow: ArchiveFollowConfig) -> None:
        super().__init__(config)
        self.follow = follow
        self.follower: ArchiveFollower | None = None

    @property
    def error(self) -> DeltadError | None:
        return None  # the follower retries for ever; Status and windows say when it is lost

    def start(self) -> ArchiveRelayServer:
        """Open the store, start the sidecar, then the follower; raises DeltadError."""
        store = open_store(self.follow.url, endpoint=self.follow.endpoint)
        try:
            self.server.start()
        except BaseException:
            store.close()
            raise
        try:
            rollout = self.server.rollout
            assert isinstance(rollout, FollowedRollout)
            self.follower = f = ArchiveFollower(
                store, self.server.layout, self.config.rank, rollout,
                interval_s=self.follow.poll_interval_s, fsync=self.follow.fsync,
            )  # fmt: skip
            self.server.servicer.upstream = self.follow.url
            self.server.servicer.windows.upstream_check = f.lost
            self._track(f)
            f.start()
        except BaseException:
            store.close()
            self.server.stop(0)
            raise
        return self

    def _track(self, f: ArchiveFollower) -> None:
        m = self.server.metrics

        def local_seq() -> int | None:
            snap = self.server.log.snapshot()
            return None if snap is None else snap.head.seq

        # (a mirroring relay's series: its alerts and dashboard apply)
        track_upstream_series(
            m,
            UpstreamHealth(
                last_ok=lambda: f.last_ok,
                failing=lambda: f.failing_since is not None,
                lost=f.lost,
                lag_segments=lambda: f.lag(local_seq()),
                errors=lambda: f.rounds_failed,
            ),
        )
        m.track_counter(
            "deltad_archive_follow_placed_bytes",
            "Bytes of the archived objects the relay placed in its spool",
            lambda: f.placed_bytes,
        )

    def stop(self, grace: float | None = None) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.server.stop(grace)
