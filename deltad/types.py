"""Shared enums and small value types: the vocabulary every deltad module speaks.

Configuration dataclasses live in :mod:`deltad.config`, errors in :mod:`deltad.errors`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Form(enum.Enum):
    """What GetDelta returns for a window (the ``Form`` enum of protos/deltad/v1/delta.proto)."""

    IDS = "ids"  # compacted global ids touched in the window
    ROWS = "rows"  # those ids with their values at the head
    TOPK = "topk"  # the k rows whose values moved most (L2), the rest stay owed


class WireDtype(enum.Enum):
    """How row values travel on the wire."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"  # row-wise: int8 codes + a float32 (scale, bias) pair per row
    # Rows in the byte layout of a TorchRec / fbgemm inference table (see deltad.wire):
    # decoded into ShardUpdate.packed (uint8 [n, row_bytes]), not into float values.
    PACKED_INT8 = "packed-int8"  # int8 codes, fp16 scale, fp16 bias, zero pad to alignment
    PACKED_INT4 = "packed-int4"  # int4 codes (2 per byte), fp16 scale, fp16 bias, zero pad
    PACKED_FP16 = "packed-fp16"  # fp16 values, zero pad to alignment

    @property
    def packed(self) -> bool:
        """Rows travel in a serving table's byte layout (full rows only)."""
        return self in (WireDtype.PACKED_INT8, WireDtype.PACKED_INT4, WireDtype.PACKED_FP16)


class SegmentKind(enum.Enum):
    """A base segment holds every row of a rank's shards; a delta the rows touched since."""

    BASE = "base"
    DELTA = "delta"


class Role(enum.Enum):
    """What a credential may do (a tokens-file line's ROLES field, see deltad.serve.edge.auth)."""

    CONSUME = "consume"  # GetDelta, Commit, Register, Heartbeat for its consumers; Status
    ADMIN = "admin"  # also ListConsumers across every consumer
    #: a relay's mirror: GetDelta with ``mirror`` (served past the model's release caps, which
    #: the relay applies to its own consumers); rollout-control, issue 21
    RELAY = "relay"


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


class ServeDtype(enum.Enum):
    """How a predictor's quantized inference tables hold their rows (torchrec quantize_embeddings).

    ``bf16`` is named so that asking for it gets a clear error: torchrec 1.8's
    ``quantize_embeddings(dtype=torch.bfloat16)`` kills the process (SIGFPE).
    """

    INT8 = "int8"  # row-wise int8 codes + fp16 scale and bias per row
    INT4 = "int4"  # row-wise packed 4-bit codes + fp16 scale and bias per row
    FP16 = "fp16"
    FP32 = "fp32"
    BF16 = "bf16"  # not supported: rejected with ConfigError


class ApplyConsistency(enum.Enum):
    """What a forward may observe while a window is written into a serving model.

    ``window``: a forward sees none or all of a window (it may wait for the whole copy);
    ``chunk``: a forward waits at most one chunk's copy and sees each row either old or new,
    but rows of one window may be mixed old and new.
    """

    WINDOW = "window"
    CHUNK = "chunk"


@dataclass(frozen=True)
class ColumnRange:
    """Half-open column range ``[start, end)`` of a (column-wise) shard within its table."""

    start: int
    end: int

    @property
    def width(self) -> int:
        return self.end - self.start


#: The raw id of an empty managed-collision slot: torchrec's MCH modules fill unused slots of
#: ``_mch_sorted_raw_ids`` with int64 max, and a segment lists a slot emptied by eviction
#: with this raw id.
EMPTY_RAW_ID = (1 << 63) - 1

#: Identifies a shard's column range of a table across segments and windows:
#: ``(table, col_start, col_end)`` (the row range is the rank's, fixed for a generation).
ShardKey = tuple[str, int, int]


@dataclass(frozen=True)
class Shard:
    """A shard: the piece of one embedding table a rank holds, rows ``[row_start, row_end)``
    by columns ``[col_start, col_end)`` of a ``num_rows`` x ``dim`` table.

    Segments, the trainer's tracker, the sidecar's merges and the consumer's updates all
    describe their rows with one. The GetDelta wire does not carry a rank's row range: a
    consumer's shards span the whole table's rows (``0, num_rows``).
    """

    table: str
    num_rows: int  # rows of the whole (global) table
    dim: int  # columns of the whole table
    row_start: int  # global row range of the shard
    row_end: int
    col_start: int  # column range of the shard
    col_end: int

    @classmethod
    def columns_of(cls, table: str, num_rows: int, dim: int, col_start: int, col_end: int) -> Shard:
        """A consumer's shard: a column range over every row of the table."""
        return cls(table, num_rows, dim, 0, num_rows, col_start, col_end)

    @property
    def rows(self) -> int:
        """Rows in the shard's row range."""
        return self.row_end - self.row_start

    @property
    def width(self) -> int:
        """Columns in the shard's column range."""
        return self.col_end - self.col_start

    @property
    def columns(self) -> ColumnRange:
        return ColumnRange(self.col_start, self.col_end)

    @property
    def covers_full_row(self) -> bool:
        """The shard holds every column of its rows (not a column-wise shard)."""
        return self.col_start == 0 and self.col_end == self.dim

    @property
    def key(self) -> ShardKey:
        """Identifies the shard's column range of its table across segments."""
        return (self.table, self.col_start, self.col_end)


@dataclass(frozen=True)
class Cursor:
    """Where a consumer stands on one rank (mirrors deltad.v1.Cursor)."""

    consumer: str
    rank: int
    generation: int
    seq: int  # last segment applied; -1 = nothing yet
    step: int  # trainer step of that segment
    pull_id: str = ""
