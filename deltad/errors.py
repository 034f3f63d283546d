"""The exception hierarchy: one root, one subclass per kind of failure callers handle."""

from __future__ import annotations


class DeltadError(Exception):
    """Root of every exception deltad raises on purpose."""


class ConfigError(DeltadError):
    """A flag, config value or argument is invalid."""


class UnsupportedModelError(DeltadError):
    """The model has no sharded embedding module deltad can track, or a table it cannot map."""


class SpoolError(DeltadError):
    """The spool directory cannot be read or written."""


class SegmentCorruptError(DeltadError):
    """A segment file is truncated, has a bad header or fails its checksum."""


class GenerationChangedError(DeltadError):
    """The trainer started a new generation; the reader must resync from its base."""


class OffsetStoreError(DeltadError):
    """Redis (the offset store) is unreachable or refused an operation after bounded retries."""


class StaleCursorError(DeltadError):
    """A commit names a cursor that is behind, foreign, or of another generation."""


class UpstreamError(DeltadError):
    """A relay's upstream serves another model or rank, or went back a generation."""


class ConsumerError(DeltadError):
    """Raised by the consumer library; gRPC errors are translated into it at the boundary."""


class SidecarUnavailableError(ConsumerError):
    """A sidecar did not answer within the deadline after bounded retries."""


class OverloadedError(SidecarUnavailableError):
    """A sidecar stayed at its stream limit (RESOURCE_EXHAUSTED) past the consumer's
    ``overload_wait_s``: raised by the pull, never only reported as a missing rank."""


class HeldStateRefused(ConsumerError):
    """A sidecar refused the state a consumer said its tables hold (GetDeltaRequest.holding:
    another generation served, a step merged away or past the consumer's release cap, a
    commit past it): that rank's tables are to be taken whole from the sidecar instead."""


class WindowRefused(ConsumerError):
    """An applier refused a window it cannot apply (identities inconsistent with what it
    holds, a shape or table it does not serve, values missing): nothing of the window was
    applied, the tables serve what they did before. The consumer asks the ranks of the window
    for their full tables again (:meth:`deltad.consume.client.DeltaConsumer.refuse`) and
    retries with backoff; it never commits such a window."""


class StreamDecodeError(ConsumerError):
    """A GetDelta stream is malformed or incomplete."""


class RolloutError(DeltadError):
    """A rollout control's argument is invalid (a step, a group glob): INVALID_ARGUMENT."""


class RolloutRefused(RolloutError):
    """A rollout control is refused as things stand (a step past a gate failure without
    ``force``, a step outside the restore window, a relay): FAILED_PRECONDITION."""


class OwedBudgetError(DeltadError):
    """Owed rows that would exceed a sidecar's owed-state budget (per consumer or in total):
    the pull is refused (RESOURCE_EXHAUSTED), nothing is written."""
