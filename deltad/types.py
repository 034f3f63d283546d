"""Shared enums and small value types: the vocabulary every deltad module speaks.

Configuration dataclasses live in :mod:`deltad.config`, errors in :mod:`deltad.errors`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Form(enum.Enum):
    """What GetDelta returns for a window (see DESIGN.md, "What GetDelta returns")."""

    IDS = "ids"  # compacted global ids touched in the window
    ROWS = "rows"  # those ids with their values at the head
    TOPK = "topk"  # the k rows whose values moved most (L2), the rest stay owed


class WireDtype(enum.Enum):
    """How row values travel on the wire."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"  # row-wise: int8 codes + a float32 (scale, bias) pair per row


class SegmentKind(enum.Enum):
    """A base segment holds every row of a rank's shards; a delta the rows touched since."""

    BASE = "base"
    DELTA = "delta"


class Role(enum.Enum):
    """What a credential may do (a tokens-file line's ROLES field, see deltad.serve.auth)."""

    CONSUME = "consume"  # GetDelta, Commit, Register, Heartbeat for its consumers; Status
    ADMIN = "admin"  # also ListConsumers across every consumer


class TrainLoop(enum.Enum):
    """How the trainer drives its steps; decides how far lookups run ahead of updates.

    ``lookahead`` is the number of batches whose embedding lookup has already happened when a
    step boundary is reached but whose fused optimizer update has not. The publisher keeps the
    ids of those lookups owed to the next segment as well (see :mod:`deltad.publish.tracker`).
    """

    PLAIN = "plain"  # forward / backward / step of one batch at a time
    PIPELINE_BASE = "pipeline-base"  # torchrec TrainPipelineBase
    PIPELINE_SPARSE_DIST = "pipeline-sparse-dist"  # torchrec TrainPipelineSparseDist
    PIPELINE_FUSED_SPARSE_DIST = "pipeline-fused-sparse-dist"  # GPU only (record_stream)
    PIPELINE_SEMI_SYNC = "pipeline-semi-sync"  # GPU only (record_stream)

    @property
    def lookahead(self) -> int:
        """Batches looked up before the previous optimizer step is applied."""
        if self in (TrainLoop.PIPELINE_FUSED_SPARSE_DIST, TrainLoop.PIPELINE_SEMI_SYNC):
            return 1
        return 0


@dataclass(frozen=True)
class ColumnRange:
    """Half-open column range ``[start, end)`` of a (column-wise) shard within its table."""

    start: int
    end: int

    @property
    def width(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Cursor:
    """Where a consumer stands on one rank (mirrors deltad.v1.Cursor)."""

    consumer: str
    rank: int
    generation: int
    seq: int  # last segment applied; -1 = nothing yet
    step: int  # trainer step of that segment
    pull_id: str = ""
