"""A segment's header: the JSON at the start of the file, and where each shard's rows sit.

:class:`SegmentHeader` says what the segment holds (model, generation, rank, seqs, step,
kind, when it was published); :class:`ShardMeta` where one shard's arrays sit in the payload
and their value dtype (one of :data:`VALUE_DTYPES`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.framing import FORMAT_VERSION, MAGICS
from deltad.types import SegmentKind, Shard

#: The value dtypes a segment stores, by their on-disk name.
VALUE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in VALUE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The on-disk name of a value dtype; raises SpoolError for unsupported ones."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise SpoolError(f"unsupported segment value dtype {dtype}") from None


@dataclass(frozen=True)
class ShardMeta:
    """Where one shard's rows sit in a segment, and what they are.

    On disk (the header's ``chunks`` list) the shard's fields stand flat beside the others.
    """

    shard: Shard
    dtype: str
    count: int  # number of rows of the shard in this segment
    ids_offset: int = 0
    values_offset: int = 0
    #: Version 3, managed-collision tables only: where the ``count`` raw ids (int64, aligned
    #: with ``ids``: the raw id each slot holds now, ``EMPTY_RAW_ID`` for an emptied slot) sit.
    raw_ids_offset: int | None = None
    #: Version 3: raw ids evicted from the shard's slots since the previous segment (int64,
    #: ascending, unique), ``evicted_count`` of them at ``evicted_offset``.
    evicted_count: int = 0
    evicted_offset: int | None = None

    @property
    def has_identities(self) -> bool:
        """The shard is of a managed-collision table and carries its slots' raw ids."""
        return self.raw_ids_offset is not None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            **asdict(self.shard),
            "dtype": self.dtype,
            "count": self.count,
            "ids_offset": self.ids_offset,
            "values_offset": self.values_offset,
        }
        if self.has_identities:  # absent for ordinary tables: version-2 headers unchanged
            d["raw_ids_offset"] = self.raw_ids_offset
            d["evicted_count"] = self.evicted_count
            d["evicted_offset"] = self.evicted_offset
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardMeta:
        d = dict(d)
        shard = Shard(**{f: d.pop(f) for f in _SHARD_FIELDS})
        return cls(shard, **d)


_SHARD_FIELDS = tuple(f.name for f in fields(Shard))


@dataclass(frozen=True)
class SegmentHeader:
    """Everything about a segment except its rows."""

    model: str
    generation: int
    rank: int
    world_size: int
    seq: int
    first_seq: int
    step: int
    kind: SegmentKind
    created_unix: float
    shards: tuple[ShardMeta, ...]
    format_version: int = FORMAT_VERSION
    #: A merge of ``first_seq..seq``: when the trainer published ``first_seq`` (the oldest step
    #: in it); ``created_unix`` is then when it published ``seq`` (the newest). None (files
    #: written before this field, and unmerged segments): ``created_unix``.
    first_created_unix: float | None = None

    @property
    def first_created(self) -> float:
        """When the trainer published the oldest step this segment holds."""
        return self.created_unix if self.first_created_unix is None else self.first_created_unix

    def to_json(self) -> bytes:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["kind"] = self.kind.value
        d["chunks"] = [m.to_dict() for m in d.pop("shards")]
        if self.first_created_unix is None:  # unmerged: the header older deltads read
            del d["first_created_unix"]
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SegmentHeader:
        try:
            d = json.loads(raw)
            if d.get("format_version") not in MAGICS:
                raise SegmentCorruptError(
                    f"segment format version {d.get('format_version')} is not one of "
                    f"{sorted(MAGICS)} (written by a newer deltad?)"
                )
            d["kind"] = SegmentKind(d["kind"])
            d["shards"] = tuple(ShardMeta.from_dict(c) for c in d.pop("chunks"))
            return cls(**d)
        except SegmentCorruptError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise SegmentCorruptError(f"bad segment header: {e}") from e
