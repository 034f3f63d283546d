"""What a consumer receives from one rank's GetDelta stream, decoded into tensors.

:mod:`deltad.consume.decode` builds these from the wire messages; the consumer library hands them to
appliers. This is the contract between the two sides of the stream.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field

import torch

from deltad.errors import ConsumerError, WindowRefused
from deltad.types import Cursor, Form, Shard, WireDtype

#: What an applier's checks may raise on a window it cannot apply (as well as ConsumerError):
#: torch's own refusals of a shape or index the wire carried.
INPUT_ERRORS = (ConsumerError, ValueError, RuntimeError, IndexError, TypeError)


def refused(e: BaseException) -> WindowRefused:
    """``e`` (an applier's refusal of a window) as a :class:`WindowRefused`."""
    if isinstance(e, WindowRefused):
        return e
    err = WindowRefused(str(e) or type(e).__name__)
    err.__cause__ = e
    return err


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
    #: A managed-collision table's shard (None for ordinary tables): int64 aligned with
    #: ``ids``, the raw id each slot holds at the window's head (``deltad.types.EMPTY_RAW_ID``:
    #: the slot is empty). A resync window lists every slot: the whole slot -> raw id map.
    raw_ids: torch.Tensor | None = None
    #: Raw ids that left the shard's slots in the window and are held by none of them at its
    #: head (int64, ascending, unique). When a shard comes in several parts (``zero_copy``),
    #: the first part carries them (empty on the others).
    evicted_raw_ids: torch.Tensor | None = None
    #: FORM_IDS only: raw ids that entered the shard's slots in the window (held at the head,
    #: by a slot that held another raw id at the cursor; a resync: every raw id held),
    #: ascending; on the first part like ``evicted_raw_ids``. None in other forms.
    admitted_raw_ids: torch.Tensor | None = None

    @property
    def has_identities(self) -> bool:
        """The shard is of a managed-collision table (its raw ids travel with its rows)."""
        return self.raw_ids is not None


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
    #: The segment seq the dense state was taken with (None: no dense state in this window).
    dense_seq: int | None = None
    #: The server knows this window lacks the dense state it should carry (asked with
    #: ``PullOptions.dense``): why (DeltaHeader.dense_missing; "" when nothing is missing).
    dense_missing: str = ""
    #: A relay served this window and has lost its upstream: why (DeltaHeader.upstream_lost;
    #: "" otherwise). The rows are right for the relay's log, which may be behind the model.
    upstream_lost: str = ""
    #: A generation diff (DeltaHeader.diff_from_generation): the older generation the cursor
    #: was of; the rows are applied in place like a delta's. None: not a diff.
    generation_diff: int | None = None
    #: A resync's reason as the sidecar gave it ("new generation: ..."; "" if none).
    resync_reason: str = ""
    #: A rollback (DeltaHeader.rollback_to_step): an operator rolled the model back to this
    #: step; the window takes the tables (and the dense state) back to ``to_step``, the
    #: newest step at or before it, and its cursor moves back. None: not a rollback.
    rollback_to: int | None = None
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


class ResyncStage(abc.ABC):
    """Tables a resync window's rows are written into as its chunks arrive, installed by
    :meth:`Applier.apply` only once every rank's stream completed and the pull was kept.

    One stage serves one pull of every rank (several threads at once): ranks' windows fill
    disjoint parts of it (row-wise shards: other rows of a table; column-wise: other columns;
    table-wise: other tables). The consumer library calls :meth:`open` for every table slice
    of a resync window's header, :meth:`write` for each of its chunks, then hands the windows
    to ``apply`` (which calls :meth:`prepare` and :meth:`commit` under the applier's lock) or
    calls :meth:`discard`. Implementations override :meth:`_open`, :meth:`_write`,
    :meth:`commit` and :meth:`_release`.
    """

    def __init__(self, applier: object) -> None:
        #: the applier whose ``apply`` installs this stage
        self.applier = applier
        self._lock = threading.Lock()
        #: ranks that took a shard here: a failure of one of them discards the stage
        self.ranks: set[int] = set()
        self.rows = 0  # rows written so far
        self.installed = False
        self.discarded: str | None = None  # why, once discarded
        #: the applier refused a shard: the pull raises it, as apply would
        self.error: WindowRefused | None = None

    def open(self, rank: int, shard: Shard, packed_row_bytes: int) -> bool:
        """A resync window's header announces ``shard`` (``packed_row_bytes``: > 0 if its rows
        come packed). True: its rows go here, chunk by chunk; False: they stay in the window
        and ``apply`` writes them as before. Raises ConsumerError if they cannot be applied."""
        with self._lock:
            self._usable()
            try:
                taken = self._open(shard, packed_row_bytes)
            except ConsumerError as e:
                self.error = self.error or refused(e)
                raise
            if taken:
                self.ranks.add(rank)
            return taken

    def write(self, rank: int, update: ShardUpdate) -> None:
        """One chunk of an opened shard: check it, write its rows into the staged table."""
        self._usable()
        try:
            n = self._write(update)
        except ConsumerError as e:
            self.error = self.error or refused(e)
            raise
        with self._lock:
            self.rows += n

    def touched(self, rank: int) -> bool:
        """Whether ``rank`` put anything here (its failed stream then spoils the stage)."""
        with self._lock:
            return rank in self.ranks

    def prepare(self) -> None:
        """Under the applier's lock, before anything is written: raise ConsumerError if the
        stage cannot be installed (discarded, installed already, or the tables changed)."""
        self._usable()

    def discard(self, why: str = "discarded") -> None:
        """Drop the staged tables (the held tables never saw them)."""
        with self._lock:
            if self.installed or self.discarded is not None:
                return
            self.discarded = why
            self._release()

    def _usable(self) -> None:
        if self.installed:
            raise ConsumerError("this pull's staged resync was installed already")
        if self.discarded is not None:
            raise ConsumerError(f"this pull's staged resync was discarded ({self.discarded})")

    @abc.abstractmethod
    def _open(self, shard: Shard, packed_row_bytes: int) -> bool:
        """:meth:`open` under the stage's lock."""

    @abc.abstractmethod
    def _write(self, update: ShardUpdate) -> int:
        """:meth:`write`: the rows written (threads of other ranks write at the same time)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Under the applier's lock, after :meth:`prepare` passed: the staged rows replace the
        held ones (must not fail); then release the staged tables."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Drop every reference to staged tables."""
