"""What a consumer receives from one rank's GetDelta stream, decoded into tensors.

:mod:`deltad.consume.decode` builds these from the wire messages; the consumer library hands them to
appliers. This is the contract between the two sides of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltad.types import Cursor, Form, Shard, WireDtype

if TYPE_CHECKING:
    from deltad.consume.appliers import ResyncStage


@dataclass
class ShardUpdate:
    """Rows of one shard: write ``values`` at ``[ids, shard.col_start:shard.col_end]``.

    The wire names a shard's table and column range, not the rank's row range: ``shard``
    spans every row of the table (see :meth:`Shard.columns_of`).

    Packed wire dtypes (``WireDtype.PACKED_*``) deliver ``packed`` instead of ``values``: uint8
    [len(ids), row_bytes], each row in the byte layout described in :mod:`deltad.wire`
    (int8 / int4: codes, fp16 scale, fp16 bias, zero padding; fp16: values, zero padding), for
    whole rows only (``shard.covers_full_row``).
    """

    shard: Shard
    ids: torch.Tensor  # int64 global row ids
    #: [len(ids), shard.width] float32 (dequantized); None for IDS
    values: torch.Tensor | None
    owed: int = 0  # top-k: candidate rows not sent, still owed
    #: packed wire dtypes: uint8 [len(ids), row_bytes] rows in the serving table's layout
    packed: torch.Tensor | None = None


#: The former name of :class:`ShardUpdate` (kept for code written against it).
SliceUpdate = ShardUpdate


@dataclass
class RankDelta:
    """One rank's merged window: apply every shard's update, then commit ``cursor``."""

    rank: int
    generation: int
    resync: bool  # replace the tables: the window starts from a base segment
    from_seq: int
    to_seq: int
    to_step: int
    form: Form
    wire_dtype: WireDtype
    cursor: Cursor
    shards: list[ShardUpdate] = field(default_factory=list)
    committed: bool = False  # auto_commit already committed the cursor
    rows: int = 0
    bytes: int = 0  # payload bytes received (rows and dense)
    #: The trainer's dense parameters and buffers (state_dict names) at ``dense_step``, if
    #: this window carries a dense state (asked with ``PullOptions.dense``; rank 0 only).
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    dense_step: int | None = None
    dense_bytes: int = 0
    #: A generation diff (DeltaHeader.diff_from_generation): the older generation the cursor
    #: was of; the rows are applied in place like a delta's. None: not a diff.
    generation_diff: int | None = None
    #: A resync's reason as the sidecar gave it ("new generation: ..."; "" if none).
    resync_reason: str = ""
    #: A resync streamed into an applier's stage (``pull(applier=...)``): the rows of its
    #: staged shards are there, not in :attr:`shards`; ``applier.apply`` installs them.
    stage: ResyncStage | None = None

    @property
    def slices(self) -> list[ShardUpdate]:
        """The former name of :attr:`shards`."""
        return self.shards

    @property
    def empty(self) -> bool:
        return self.rows == 0 and not self.resync
