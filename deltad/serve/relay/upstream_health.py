"""What a relay says of the upstream it follows, whichever kind it is: a sidecar or relay
(:class:`~deltad.serve.relay.mirror.RelayMirror`) or the object store
(:class:`~deltad.serve.archive.follow.ArchiveFollower`). One threshold for "lost" and one set of
series, so that the same alerts (``DeltadRelayUpstreamLost``, ...) and dashboards apply to both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from deltad.serve.metrics import SidecarMetrics

__all__ = ["LOST_AFTER_S", "UpstreamHealth", "track_upstream_series"]

#: Seconds of failed rounds after which a relay says it lost its upstream (in every window and
#: in Status: a predictor behind it is then not caught up): past a restart of the upstream, not
#: past a real outage.
LOST_AFTER_S = 10.0


@dataclass(frozen=True)
class UpstreamHealth:
    """How the series read a follower's state: when its last round succeeded (monotonic;
    None: never), whether its rounds fail now, why it is lost ("" if it is not), how many
    segments it is behind (-1: not known) and how many rounds failed."""

    last_ok: Callable[[], float | None]
    failing: Callable[[], bool]
    lost: Callable[[], str]
    lag_segments: Callable[[], int]
    errors: Callable[[], int]


def track_upstream_series(metrics: SidecarMetrics, health: UpstreamHealth) -> None:
    """Declare the relay's upstream series on its /metrics."""

    def contact_age() -> float:
        last = health.last_ok()
        return -1.0 if last is None else time.monotonic() - last

    metrics.track(
        "deltad_upstream_up",
        "1 while the relay's last round with its upstream succeeded, else 0",
        lambda: 1.0 if health.last_ok() is not None and not health.failing() else 0.0,
    )
    metrics.track(
        "deltad_upstream_contact_age_seconds",
        "Seconds since the upstream last answered a mirror round (-1: never)",
        contact_age,
    )
    metrics.track(
        "deltad_upstream_lost",
        f"1 while mirroring has failed for over {LOST_AFTER_S:.0f}s (windows and Status "
        "say the relay lost its upstream; predictors are not caught up), else 0",
        lambda: 1.0 if health.lost() else 0.0,
    )
    metrics.track(
        "deltad_mirror_lag_segments",
        "Segments the relay's head is behind its upstream's (-1: not known)",
        lambda: float(health.lag_segments()),
    )
    metrics.track_counter(
        "deltad_mirror_errors", "Mirror rounds that failed (retried with backoff)", health.errors
    )
