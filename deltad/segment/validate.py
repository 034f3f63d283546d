"""The spool is input: open a segment file safely, keep a private verified copy, and check its
structure before anything serves or merges it.

:func:`load_verified` is what the sidecar indexes with:

1. the file is opened without following a symbolic link (``O_NOFOLLOW``), without blocking
   (a FIFO named like a segment), and must be a regular file (``fstat``) in a directory that
   really is inside the spool;
2. its header is read from the file and checked (:func:`check_header`: header field types;
   model, rank and world size; ``first_seq`` (0 exactly for a base, else ``1..seq``); every
   shard of a known table with the manifest's ``num_rows`` and ``dim``, its row range inside
   the table, its columns inside ``dim``, non-negative aligned offsets, a count within its
   row range (a base: every row of it)), and the file may not be bigger than its rows make
   it (:func:`~deltad.segment.reader.file_size`), before anything else is read: a huge file
   (a sparse one costs no disk) named like a segment is refused without being copied;
3. its bytes are copied into an anonymous memory file (``memfd``) private to this process,
   and the header, checksum and structure are verified on that copy; what is served and
   merged later is that copy, so bytes changed on disk after indexing never reach a
   consumer or a merge;
4. :func:`check_rows` checks, vectorized: ids inside the row range, strictly ascending (so
   unique), and a managed-collision shard's evicted raw ids strictly ascending; and
   :func:`check_identities` its identities (no negative raw id, none given to two slots, none
   both evicted and given).

Every failure is a :class:`SegmentCorruptError` (the caller quarantines the file), except a
directory leading outside the spool: SpoolError (held back and logged, nothing there is moved).
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltad.config import clip
from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.format import (
    DenseHeader,
    DenseState,
    Segment,
    SegmentHeader,
    decode_dense,
    dense_dtype,
    dense_file_size,
    file_size,
    read_dense_header_at,
    read_header,
    read_header_at,
    read_segment,
)
from deltad.segment.spool import GenerationManifest, NotRegularFile, open_regular
from deltad.types import EMPTY_RAW_ID, SegmentKind

#: Kinds whose shards are embedding rows checked against the manifest's tables.
ROW_KINDS = (SegmentKind.BASE, SegmentKind.DELTA)
_MAX_INT = 2**63 - 1


def _int(v: Any, what: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise SegmentCorruptError(f"{what} must be an integer in {lo}..{hi}, got {v!r:.40}")
    return v


def check_header(
    h: SegmentHeader,
    manifest: GenerationManifest,
    *,
    generation: int,
    rank: int,
    seq: int,
) -> None:
    """Types, identity and every shard's metadata (no ids needed); SegmentCorruptError."""
    if not isinstance(h.model, str) or h.model != manifest.model:
        raise SegmentCorruptError(f"model {h.model!r:.40} is not {manifest.model!r}")
    if _int(h.generation, "generation") != generation:
        raise SegmentCorruptError(f"generation {h.generation} is not {generation}")
    if _int(h.rank, "rank") != rank:
        raise SegmentCorruptError(f"rank {h.rank} is not {rank}")
    if _int(h.world_size, "world_size", 1) != manifest.world_size:
        raise SegmentCorruptError(
            f"world_size {h.world_size} disagrees with the manifest ({manifest.world_size})"
        )
    if _int(h.seq, "seq") != seq:
        raise SegmentCorruptError(f"seq {h.seq} is not the file name's {seq}")
    first = _int(h.first_seq, "first_seq", 0, seq)
    _int(h.step, "step", -(2**63), _MAX_INT)
    for name, when in (("created_unix", h.created_unix), ("first_created_unix", h.first_created)):
        if isinstance(when, bool) or not isinstance(when, int | float) or not math.isfinite(when):
            raise SegmentCorruptError(f"{name} {when!r:.40} is not a number")
    if h.first_created > h.created_unix:
        raise SegmentCorruptError(
            f"first_created_unix {h.first_created} is after created_unix {h.created_unix}"
        )
    if h.kind not in ROW_KINDS:
        return  # other kinds (dense weights) carry their own checks
    if (h.kind is SegmentKind.BASE) != (first == 0):
        raise SegmentCorruptError(
            f"a {h.kind.value} segment with first_seq {first} (a base, and only a base, "
            "starts at 0)"
        )
    tables = {t.name: t for t in manifest.tables}
    seen: set[tuple[str, int, int]] = set()
    for i, c in enumerate(h.shards):
        where = f"shard {i}"
        if not isinstance(c.shard.table, str) or c.shard.table not in tables:
            raise SegmentCorruptError(f"{where}: unknown table {c.shard.table!r:.60}")
        t = tables[c.shard.table]
        where = f"shard {i} ({c.shard.table})"
        if _int(c.shard.num_rows, f"{where} num_rows") != t.num_rows or (
            _int(c.shard.dim, f"{where} dim") != t.dim
        ):
            raise SegmentCorruptError(
                f"{where}: shape {c.shard.num_rows}x{c.shard.dim} disagrees with the manifest's "
                f"{t.num_rows}x{t.dim}"
            )
        r0 = _int(c.shard.row_start, f"{where} row_start", 0, t.num_rows)
        r1 = _int(c.shard.row_end, f"{where} row_end", r0, t.num_rows)
        c0 = _int(c.shard.col_start, f"{where} col_start", 0, t.dim)
        _int(c.shard.col_end, f"{where} col_end", c0 + 1, t.dim)
        count = _int(c.count, f"{where} count", 0, r1 - r0)
        if h.kind is SegmentKind.BASE and count != r1 - r0:
            raise SegmentCorruptError(f"{where}: a base holds {count} of its {r1 - r0} rows")
        _int(c.ids_offset, f"{where} ids_offset")
        _int(c.values_offset, f"{where} values_offset")
        if c.ids_offset % 8 or c.values_offset % 8:
            raise SegmentCorruptError(f"{where}: offsets are not 8-byte aligned")
        if not isinstance(c.dtype, str):
            raise SegmentCorruptError(f"{where}: dtype {c.dtype!r:.40} is not a name")
        if c.has_identities != t.managed_collision:
            raise SegmentCorruptError(
                f"{where}: a managed-collision table's shard must carry its slots' raw ids, "
                "and only such a shard may"
            )
        if c.has_identities:
            _int(c.evicted_count, f"{where} evicted_count", 0, t.num_rows * 1024)
            for name, off in (
                ("raw_ids_offset", c.raw_ids_offset),
                ("evicted_offset", c.evicted_offset),
            ):
                if _int(off, f"{where} {name}") % 8:
                    raise SegmentCorruptError(f"{where}: {name} is not 8-byte aligned")
        if c.shard.key in seen:
            raise SegmentCorruptError(f"{where}: shard appears twice")
        seen.add(c.shard.key)


def check_rows(seg: Segment) -> None:
    """Every shard's ids inside its row range and strictly ascending (vectorized)."""
    if seg.header.kind not in ROW_KINDS:
        return
    for c in seg.shards:
        ids = c.ids
        n = ids.numel()
        if n == 0:
            continue
        if int(ids[0]) < c.shard.row_start or int(ids[-1]) >= c.shard.row_end:
            raise SegmentCorruptError(
                f"shard {c.shard.table}: ids {int(ids[0])}..{int(ids[-1])} outside rows "
                f"{c.shard.row_start}..{c.shard.row_end}"
            )
        if n > 1 and not bool(torch.all(ids[1:] > ids[:-1])):
            raise SegmentCorruptError(f"shard {c.shard.table}: ids not strictly ascending")
    for c in seg.shards:
        ev = c.evicted
        if ev is not None and ev.numel() > 1 and not bool(torch.all(ev[1:] > ev[:-1])):
            raise SegmentCorruptError(
                f"shard {c.shard.table}: evicted raw ids not strictly ascending"
            )
    check_identities(seg)


def check_identities(seg: Segment) -> None:
    """The managed-collision identities of one segment are consistent on their own (per
    table, over all its shards in the file): every raw id a slot is given is a real one
    (``>= 0``) or :data:`~deltad.types.EMPTY_RAW_ID`; no raw id is given to two slots; every
    evicted raw id is a real one and is given to none of the listed slots. What a segment
    cannot show alone (a raw id given here that an unlisted slot still holds) is checked
    against the rank's log by :mod:`deltad.serve.index.identities`."""
    given: dict[str, list[torch.Tensor]] = {}
    evicted: dict[str, list[torch.Tensor]] = {}
    for c in seg.shards:
        if c.raw_ids is None:
            continue
        given.setdefault(c.shard.table, []).append(c.raw_ids)
        if c.evicted is not None and c.evicted.numel():
            evicted.setdefault(c.shard.table, []).append(c.evicted)
    for table, parts in given.items():
        raw = torch.cat(parts) if len(parts) > 1 else parts[0]
        if raw.numel() and int(raw.min()) < 0:
            raise SegmentCorruptError(f"shard {table}: negative raw id {int(raw.min())}")
        held = raw[raw != EMPTY_RAW_ID].sort().values
        if held.numel() > 1 and bool((held[1:] == held[:-1]).any()):
            dup = int(held[1:][held[1:] == held[:-1]][0])
            raise SegmentCorruptError(f"shard {table}: raw id {dup} given to two slots")
        ev = torch.cat(evicted[table]) if table in evicted else None
        if ev is None:
            continue
        if int(ev.min()) < 0 or bool((ev == EMPTY_RAW_ID).any()):
            raise SegmentCorruptError(
                f"shard {table}: evicted raw id {int(ev.min())} is not a raw id"
            )
        if held.numel():
            pos = torch.searchsorted(held, ev).clamp(max=held.numel() - 1)
            still = ev[held[pos] == ev]
            if still.numel():
                raise SegmentCorruptError(
                    f"shard {table}: raw id {int(still[0])} evicted but given to a slot"
                )


def _inside(path: Path, root: Path) -> bool:
    real_dir = os.path.realpath(path.parent)
    want = os.path.join(os.path.realpath(root), os.path.relpath(path.parent, root))
    return real_dir == os.path.normpath(want)


def _private_copy(path: Path, sized: Callable[[int], int]) -> int:
    """A memfd holding the bytes of the regular file ``path`` (opened without following links
    or blocking); SegmentCorruptError if it is anything else, or bigger than ``sized(fd)``
    (the size its header accounts for, read from the file before anything is copied),
    SpoolError if unreadable."""
    try:
        fd, st = open_regular(path)
    except NotRegularFile as e:
        raise SegmentCorruptError(f"{path}: {e}") from e
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise SpoolError(f"cannot read segment {path}: {e}") from e
    try:
        limit = sized(fd)
        if st.st_size > limit:
            raise SegmentCorruptError(
                f"{path}: {st.st_size} bytes, more than the {limit} its header accounts for"
            )
        mfd = os.memfd_create("deltad-segment", os.MFD_CLOEXEC)
        try:
            left, off = st.st_size, 0
            while left > 0:
                n = os.sendfile(mfd, fd, off, min(left, 1 << 30))
                if n == 0:
                    raise SegmentCorruptError(f"{path}: shrank while being read")
                off += n
                left -= n
        except BaseException:
            os.close(mfd)
            raise
        return mfd
    except OSError as e:
        raise SpoolError(f"cannot read segment {path}: {e}") from e
    finally:
        os.close(fd)


def load_verified(
    path: Path,
    root: Path,
    manifest: GenerationManifest,
    *,
    generation: int,
    rank: int,
    seq: int,
) -> Segment:
    """The segment at ``path`` from a private copy whose checksum and structure were verified
    (see the module docstring). ``root``: the spool's model directory the file must be in."""
    path = Path(path)
    if not _inside(path, root):  # not quarantined: nothing outside the spool is touched
        raise SpoolError(f"{path}: its directory leads outside the spool {root}; not indexed")

    def sized(fd: int) -> int:
        hlen, header = read_header_at(fd, path)
        check_header(header, manifest, generation=generation, rank=rank, seq=seq)
        return file_size(header, hlen)

    mfd = -1
    try:
        mfd = _private_copy(path, sized)
        copy = Path(f"/proc/self/fd/{mfd}")
        # (the copy's header again: the file may have changed since it was read)
        check_header(read_header(copy), manifest, generation=generation, rank=rank, seq=seq)
        seg = read_segment(copy, verify=True)  # maps the copy; the mapping outlives the fd
        check_rows(seg)
    except (SegmentCorruptError, SpoolError) as e:
        msg = str(e).replace(f"/proc/self/fd/{mfd}", str(path))
        raise SegmentCorruptError(msg if str(path) in msg else f"{path}: {msg}") from None
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError, OverflowError) as e:
        raise SegmentCorruptError(f"{path}: malformed segment: {e}") from None
    finally:
        if mfd >= 0:
            os.close(mfd)
    return seg


def check_dense_header(
    header: DenseHeader, manifest: GenerationManifest, *, generation: int, rank: int, seq: int
) -> None:
    """SegmentCorruptError unless a dense state's header is well typed and belongs here:
    this model, generation, rank and seq; tensor names unique strings, known dtypes, shapes of
    non-negative ints, offsets and sizes non-negative ints."""
    if not isinstance(header.model, str) or header.model != manifest.model:
        raise SegmentCorruptError(
            f"dense state of model {clip(header.model)}, not {manifest.model}"
        )
    if _int(header.generation, "generation") != generation:
        raise SegmentCorruptError(
            f"dense state of generation {header.generation}, not {generation}"
        )
    if _int(header.rank, "rank") != rank:
        raise SegmentCorruptError(f"dense state of rank {header.rank}, not {rank}")
    if _int(header.seq, "seq") != seq:
        raise SegmentCorruptError(f"dense state header says seq {header.seq}, its name {seq}")
    _int(header.step, "step")
    if not isinstance(header.created_unix, int | float) or isinstance(header.created_unix, bool):
        raise SegmentCorruptError("dense state created_unix must be a number")
    names: set[str] = set()
    for i, m in enumerate(header.tensors):
        if not isinstance(m.name, str) or not m.name or m.name in names:
            raise SegmentCorruptError(f"dense tensor {i}: name {clip(m.name)} missing or repeated")
        names.add(m.name)
        if not isinstance(m.dtype, str):
            raise SegmentCorruptError(f"dense tensor {m.name!r}: dtype must be a string")
        try:
            dense_dtype(m.dtype)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SegmentCorruptError(
                f"dense tensor {m.name!r}: unknown dtype {clip(m.dtype)}"
            ) from e
        for s in m.shape:
            _int(s, f"dense tensor {m.name!r} dimension")
        _int(m.offset, f"dense tensor {m.name!r} offset")
        _int(m.nbytes, f"dense tensor {m.name!r} nbytes")


def load_verified_dense(
    path: Path,
    root: Path,
    manifest: GenerationManifest,
    *,
    generation: int,
    rank: int,
    seq: int,
) -> DenseState:
    """The dense state at ``path`` from a private copy (regular file inside the spool, no link
    followed), checksummed and checked like a segment (:func:`load_verified`)."""
    path = Path(path)
    if not _inside(path, root):
        raise SpoolError(f"{path}: its directory leads outside the spool {root}; not indexed")

    def sized(fd: int) -> int:
        hlen, header = read_dense_header_at(fd, path)
        check_dense_header(header, manifest, generation=generation, rank=rank, seq=seq)
        return dense_file_size(header, hlen)

    mfd = -1
    try:
        mfd = _private_copy(path, sized)
        size = os.fstat(mfd).st_size
        buf = mmap.mmap(mfd, size, access=mmap.ACCESS_COPY) if size else b""
        state = decode_dense(buf, path, verify=True)
        check_dense_header(state.header, manifest, generation=generation, rank=rank, seq=seq)
    except (SegmentCorruptError, SpoolError):
        raise
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError, OverflowError) as e:
        raise SegmentCorruptError(f"{path}: malformed dense state: {e}") from None
    finally:
        if mfd >= 0:
            os.close(mfd)
    return state
