"""The archive's place in a sidecar: restore before serving, the uploader, its metrics and its
health service (what deltad.serve.edge.app calls)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2

from deltad.config import ServerConfig
from deltad.segment.spool import SpoolLayout
from deltad.serve.archive.opening import open_store
from deltad.serve.archive.restore import RestoreResult, restore_rank
from deltad.serve.archive.store import ArchiveError, ArchiveUnavailable, ObjectStore
from deltad.serve.archive.uploader import ArchiveUploader
from deltad.serve.index.log import SegmentLog
from deltad.serve.metrics import SidecarMetrics

__all__ = ["ARCHIVE_HEALTH", "RESTORE_WAIT_S", "SidecarArchive"]

log = logging.getLogger(__name__)

#: The health service that answers NOT_SERVING while the archive is behind by more than
#: ``archive_lag_bound_s`` (the sidecar serves regardless: readiness is not affected).
ARCHIVE_HEALTH = "deltad.v1.Archive"
#: How long a sidecar on an empty spool waits for a store that does not answer before it
#: gives up starting (serving an empty log would send its consumers back to a full resync).
RESTORE_WAIT_S = 60.0


class SidecarArchive:
    """One sidecar's archive: the store, the restore at start, the uploader."""

    def __init__(self, config: ServerConfig, layout: SpoolLayout) -> None:
        assert config.archive_url is not None
        self.config = config
        self.layout = layout
        self.store: ObjectStore = open_store(config.archive_url, endpoint=config.archive_endpoint)
        self.uploader: ArchiveUploader | None = None
        self.restored: RestoreResult | None = None
        self._behind: bool | None = None

    def restore(self, wait_s: float = RESTORE_WAIT_S) -> RestoreResult | None:
        """Restore the rank's log into an empty spool (see deltad.serve.archive.restore),
        waiting up to ``wait_s`` for a store that does not answer (then ArchiveUnavailable).
        A log that cannot be restored (a corrupted base) is logged; the sidecar serves without."""
        deadline = time.monotonic() + wait_s
        delay = 0.5
        while True:  # bounded by the deadline
            try:
                self.restored = restore_rank(self.store, self.layout, self.config.rank)
                return self.restored
            except ArchiveUnavailable as e:
                if time.monotonic() + delay > deadline:
                    raise ArchiveUnavailable(
                        f"cannot restore rank {self.config.rank} from {self.store.url} within "
                        f"{wait_s:g} s: {e}"
                    ) from None
                log.warning("archive %s: %s (retrying the restore)", self.store.url, e)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            except ArchiveError as e:
                log.error("archive %s: not restored, serving without: %s", self.store.url, e)
                return None

    def start(
        self,
        seglog: SegmentLog,
        metrics: SidecarMetrics,
        release: Callable[[], str | None] | None = None,
    ) -> ArchiveUploader:
        """Start the uploader of ``seglog``; its lag and counters in ``metrics``; the release
        state (``release``, its JSON) recorded with each manifest."""
        up = ArchiveUploader(
            self.store,
            seglog,
            self.config.model,
            scratch_dir=self.layout.sidecar_dir / f"archive-rank-{self.config.rank:05d}",
            interval_s=max(self.config.poll_interval_s, 0.05),
            gc_grace_s=self.config.archive_gc_grace_s,
            base_deltas=self.config.archive_base_deltas,
            base_every_s=self.config.archive_base_every_s,
            release=release,
        )
        self.uploader = up
        metrics.track(
            "deltad_archive_lag_seconds",
            "Age of the oldest segment of the served log not in the archive yet (0: none)",
            lambda: up.lag().seconds,
        )
        metrics.track(
            "deltad_archive_lag_segments",
            "Segments of the served log not in the archive yet",
            lambda: up.lag().segments,
        )
        metrics.track_counter(
            "deltad_archive_uploads", "Objects the archive uploader created", lambda: up.uploads
        )
        metrics.track_counter(
            "deltad_archive_uploaded_bytes",
            "Bytes of the objects the archive uploader created",
            lambda: up.uploaded_bytes,
        )
        metrics.track_counter(
            "deltad_archive_deleted",
            "Objects retention in the archive deleted (named by no manifest past the grace)",
            lambda: up.deleted,
        )
        metrics.track_counter(
            "deltad_archive_failures",
            "Archive upload rounds that failed (retried with backoff): see the log",
            lambda: up.failures,
        )
        up.start()
        return up

    def lag(self) -> tuple[str, int, float]:
        """(the store's URL, segments behind, seconds behind) for Status (0, 0 before the
        uploader started)."""
        up = self.uploader
        if up is None:
            return self.store.url, 0, 0.0
        lag = up.lag()
        return self.store.url, int(lag.segments), float(lag.seconds)

    def check_health(self, health: Any) -> bool:
        """Set :data:`ARCHIVE_HEALTH` from the lag (on a change only); True while behind."""
        up = self.uploader
        if up is None:
            return False
        lag = up.lag()
        behind = lag.seconds > self.config.archive_lag_bound_s
        if behind != self._behind and not health.stopped:
            status = health_pb2.HealthCheckResponse
            health.servicer.set(ARCHIVE_HEALTH, status.NOT_SERVING if behind else status.SERVING)
            if behind:
                log.warning(
                    "archive %s is %d segments (%.0f s) behind the log%s",
                    self.store.url, lag.segments, lag.seconds,
                    f": {up.last_error}" if up.last_error else "",
                )  # fmt: skip
            elif self._behind is not None:
                log.warning("archive %s caught up with the log", self.store.url)
            self._behind = behind
        return behind

    def stop(self) -> None:
        if self.uploader is not None:
            self.uploader.stop()
        else:
            self.store.close()
