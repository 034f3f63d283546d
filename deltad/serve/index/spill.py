"""The merged base of a rank's log at some seq, spilled to an unnamed file, so that bootstraps
(base windows) larger than the window cache are not merged again for every bootstrap.

A base window at head ``h`` is the base merged with every delta up to ``h``. Without a spill,
a base window that does not fit the window cache (:class:`deltad.serve.windows.cache.WindowCache`) is
merged again by every bootstrap. With one, the sidecar keeps ``base + deltas[0:p]`` merged
(:class:`Spill`) in a file opened ``O_TMPFILE`` in a 0700 directory of the spool: it has no
name, so no other process can open, replace or change it (the spool is hostile input; this
file is the sidecar's own), and its pages live in the page cache (reclaimable, not the
process's anonymous memory). A base window at a later head is then the spill plus the few
pre-merged runs of deltas ``p..`` (:mod:`deltad.serve.index.runs`), on the cheap ranged path; once
more than :data:`REFRESH_AFTER` deltas sit beyond the spill, the next bootstrap spills anew
at its head (from the old spill and those runs: one pass over the base).

It is used only where it saves a merge: a base window whose base and runs stream range by
range (few parts, little overlap: one copy of each row into the messages, no merge) is
served from them, since a spill would save nothing (measured, 512 MB, base + 16 deltas of
1 %: a later bootstrap costs the same CPU either way, and writing the spill costs the first
one 1.7-2x). It pays when the deltas since the base overlap heavily or are many: their parts
would be merged whole (a shard-sized temporary per shard and a full merge per bootstrap).

A spill is identified by the exact entries it covers (generation; first_seq, seq, path, size,
creation time of each, as a run): a retention merge of those entries, a new base or a new
generation makes it stale (it is dropped at the next lookup). Its disk use is bounded by
``max_bytes`` (a larger merge is not spilled); one spill is kept, and a replaced one's bytes
are freed when its last reader is done with it.

Its pages are not left in the sidecar's resident set (issue 41 item 3): the merge writes it
range by range (:data:`WRITE_RANGE_BYTES`), each range's pages unmapped once written
(``madvise(MADV_DONTNEED)``), and while windows read it, every :data:`TRIM_EVERY_BYTES` of
messages produced (:func:`after_chunk`, called by
:class:`~deltad.serve.windows.encoded.EncodedWindow`) and when a window is done, the pages
read are unmapped again. They stay in the page cache (a later read faults them back without
I/O): file memory the kernel reclaims under pressure, charged to the pod's memory cgroup
while it stays there (docs/sizing.md). With ``drop_page_cache`` they leave the page cache
too (written back first; ``posix_fadvise(DONTNEED)``): the spill is then read from disk.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogEntry
from deltad.serve.index.merge import merge_identities, merge_rows
from deltad.types import ShardKey

log = logging.getLogger(__name__)

Part = dict[ShardKey, ShardRows]
EntryId = tuple[int, int, str, int, float]

#: a base window more than this many deltas past the spill spills anew at its head
REFRESH_AFTER = 8
_ALIGN = 64
#: a spill is merged this many value bytes at a time, each range's pages unmapped once written
WRITE_RANGE_BYTES = 32 << 20
#: the spills' resident pages are unmapped after this many bytes of messages produced
TRIM_EVERY_BYTES = 8 << 20
_PAGE = mmap.PAGESIZE


class SpillPages:
    """A spill's mapping and its file: unmaps its resident pages (and, with
    ``drop_page_cache``, drops them from the page cache)."""

    def __init__(self, mm: mmap.mmap, fd: int, size: int, drop_page_cache: bool) -> None:
        self.mm = mm
        self.fd = fd
        self.size = size
        self.drop_page_cache = drop_page_cache
        #: unmap calls made (tests)
        self.trims = 0

    def trim(self, start: int = 0, length: int | None = None, *, written: bool = False) -> None:
        """Unmap ``[start, start + length)`` (page-aligned outward; default: all of it);
        ``written``: its pages were just written (written back first if they leave the
        page cache)."""
        end = self.size if length is None else min(self.size, start + length)
        start -= start % _PAGE
        if end <= start:
            return
        try:
            if self.drop_page_cache and written:
                self.mm.flush(start, end - start)
            self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            if self.drop_page_cache:
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError):  # (a closed mapping: nothing resident)
            return
        self.trims += 1


_live: weakref.WeakSet[SpillPages] = weakref.WeakSet()
_trim_lock = threading.Lock()
_since_trim = [0]


def after_chunk(nbytes: int, *, done: bool = False) -> None:
    """``nbytes`` of messages were produced (``done``: a window ended): unmap the live spills'
    pages every :data:`TRIM_EVERY_BYTES` and at the end of a window (nothing to do, and no
    lock taken, while no spill is mapped)."""
    if not _live:
        return
    with _trim_lock:
        _since_trim[0] += nbytes
        if _since_trim[0] < TRIM_EVERY_BYTES and not (done and _since_trim[0]):
            return
        _since_trim[0] = 0
        pages = list(_live)
    for p in pages:
        p.trim()


def entry_id(e: LogEntry) -> EntryId:
    """What identifies an entry's content (a file rewritten under one name differs in size or
    creation time)."""
    return (e.first_seq, e.seq, str(e.path), e.nbytes, e.created_unix)


@dataclass
class Spill:
    """``base + deltas[0:count]`` of one generation, merged, in an unnamed mapped file."""

    generation: int
    covers: tuple[EntryId, ...]  # the base and the ``count`` deltas it holds
    part: Part  # tensors are views of the mapping (alive as long as they are)
    nbytes: int  # file size
    pages: SpillPages | None = None

    @property
    def count(self) -> int:
        """Deltas merged into it (after the base)."""
        return len(self.covers) - 1

    def valid_for(self, generation: int, entries: Sequence[LogEntry]) -> bool:
        """Whether ``entries`` (base first) still start with exactly what it covers."""
        if generation != self.generation or len(entries) < len(self.covers):
            return False
        return all(entry_id(e) == c for e, c in zip(entries, self.covers, strict=False))


def open_unnamed(directory: Path) -> int:
    """A read-write fd of a new file in ``directory`` that has no name (``O_TMPFILE``; where
    the filesystem lacks it, a random name unlinked at once). ``directory`` is created 0700
    and must be a real directory owned by this user (not a symlink)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(dfd, 0o700)
            if st.st_uid != os.getuid():
                raise PermissionError(f"{directory} is not owned by this user")
        tmpfile = getattr(os, "O_TMPFILE", 0)
        if tmpfile:
            try:
                return os.open(".", tmpfile | os.O_RDWR, 0o600, dir_fd=dfd)
            except OSError:
                pass  # filesystem without O_TMPFILE
        fd, name = tempfile.mkstemp(prefix=".spill-", dir=directory)
        os.unlink(name)
        return fd
    finally:
        os.close(dfd)


def write_spill(
    directory: Path, parts: Sequence[Part], max_bytes: int, *, drop_page_cache: bool = False
) -> tuple[Part, int, SpillPages] | None:
    """Merge ``parts`` (oldest first) shard by shard straight into a new unnamed mapped file;
    (its part, its size, its pages), or None if it would exceed ``max_bytes``. No shard-sized
    temporary: each shard's rows are merged into the mapping itself, a range of
    :data:`WRITE_RANGE_BYTES` at a time, each range's pages unmapped once written."""
    keys: list[ShardKey] = []
    for p in parts:
        keys += [k for k in p if k not in keys]
    layout: list[tuple[ShardKey, list[ShardRows], torch.Tensor, int, int]] = []
    size = 0
    for key in keys:
        cs = [p[key] for p in parts if key in p]
        ids = merge_rows(cs, with_values=False).ids
        width = cs[-1].shard.col_end - cs[-1].shard.col_start
        vbytes = ids.numel() * width * cs[-1].values.element_size()
        layout.append((key, cs, ids, size, width))
        size += -(-(ids.numel() * 8 + vbytes) // _ALIGN) * _ALIGN
    if size > max_bytes:
        return None
    fd = open_unnamed(directory)
    try:
        os.ftruncate(fd, max(size, 1))
        mm = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    pages = SpillPages(mm, fd, max(size, 1), drop_page_cache)
    weakref.finalize(mm, os.close, fd)  # (the file lives while a view of the mapping does)
    out: Part = {}
    for key, cs, ids, off, width in layout:
        n = ids.numel()
        dtype = cs[-1].values.dtype
        at_ids = torch.frombuffer(mm, dtype=torch.int64, count=n, offset=off) if n else ids[:0]
        vals = (
            torch.frombuffer(mm, dtype=dtype, count=n * width, offset=off + n * 8).view(n, width)
            if n * width
            else torch.empty(n, width, dtype=dtype)
        )
        at_ids.copy_(ids)
        raw_ids = evicted = None
        if any(c.has_identities for c in cs):  # (a managed-collision shard: in memory)
            raw_ids, evicted = merge_identities(cs, ids)
        row_bytes = max(1, width * cs[-1].values.element_size())
        step = max(1, WRITE_RANGE_BYTES // row_bytes)
        for a in range(0, n, step):
            b = min(n, a + step)
            merge_rows(_rows_between(cs, ids, a, b), out=vals[a:b])
            pages.trim(off + n * 8 + a * row_bytes, (b - a) * row_bytes, written=True)
        pages.trim(off, n * 8, written=True)
        out[key] = cs[-1].with_rows(at_ids, vals, raw_ids, evicted)
    _live.add(pages)
    return out, size, pages


def _rows_between(cs: list[ShardRows], ids: torch.Tensor, a: int, b: int) -> list[ShardRows]:
    """The parts' rows among ``ids[a:b]`` (the union's), as parts of the row range they span
    (identities left out: merged apart)."""
    lo_id, hi_id = int(ids[a]), int(ids[b - 1]) + 1
    out = []
    bounds = torch.tensor([lo_id, hi_id], dtype=torch.int64)
    for c in cs:
        lo, hi = torch.searchsorted(c.ids, bounds).tolist()
        shard = replace(c.shard, row_start=lo_id, row_end=hi_id)
        out.append(ShardRows(shard, c.ids[lo:hi], c.values[lo:hi]))
    return out


class SpillStore:
    """The one spill of a rank (see the module docstring); thread-safe, one build at a time."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        *,
        only_when_merged: bool = True,
        drop_page_cache: bool = False,
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        #: the spill's pages leave the page cache too once read (see the module doc)
        self.drop_page_cache = drop_page_cache
        #: used only for a base window that would otherwise merge whole shards (see
        #: :func:`deltad.serve.windows.parts.window_parts`); False: for every base window (tests)
        self.only_when_merged = only_when_merged
        self._lock = threading.Lock()
        self._build = threading.Lock()
        self._spill: Spill | None = None
        #: spills written, and base windows served from one (for tests and metrics)
        self.built = 0
        self.hits = 0

    @property
    def nbytes(self) -> int:
        """Disk bytes of the kept spill."""
        s = self._spill
        return 0 if s is None else s.nbytes

    @property
    def current(self) -> Spill | None:
        return self._spill

    def _valid(self, generation: int, entries: Sequence[LogEntry]) -> Spill | None:
        with self._lock:
            s = self._spill
            if s is not None and not s.valid_for(generation, entries):
                self._spill = s = None  # stale: its bytes go with its last reader
            return s

    def base_parts(
        self,
        generation: int,
        entries: Sequence[LogEntry],
        hi: int,
        delta_parts: Callable[[int, int], list[Part]],
        cheap: Callable[[list[Part]], bool] = lambda parts: True,
    ) -> list[Part] | None:
        """Parts of the base window over ``entries[0:hi]`` (``hi`` >= 1): the spill and the
        parts of the deltas after it (``delta_parts(lo, hi)``, positions among the deltas);
        spilled anew at ``hi`` if there is none, it is more than :data:`REFRESH_AFTER`
        deltas behind, or the parts after it are not ``cheap`` (would be merged whole). None: no spill (over ``max_bytes``, or the spill is newer than ``hi``:
        a bootstrap at an older head is merged from the base, the spill stays)."""
        if self.max_bytes <= 0 or hi <= 1:  # (the base alone is not merged)
            return None

        def parts_of(s: Spill | None) -> list[Part] | None:
            if s is None or s.count > hi - 1 or hi - 1 - s.count > REFRESH_AFTER:
                return None
            parts = [s.part, *delta_parts(s.count, hi - 1)]
            return parts if cheap(parts) else None

        s = self._valid(generation, entries)
        if s is not None and s.count > hi - 1:  # a head older than the spill (rare)
            return None
        parts = parts_of(s)
        if parts is None:
            with self._build:  # concurrent bootstraps spill once
                s = self._valid(generation, entries)
                if s is not None and s.count > hi - 1:
                    return None
                parts = parts_of(s)
                if parts is None:
                    s = self._write(generation, entries, hi, delta_parts, s)
                    if s is None:
                        return None
                    parts = [s.part]
        with self._lock:
            self.hits += 1
        return parts

    def _write(
        self,
        generation: int,
        entries: Sequence[LogEntry],
        hi: int,
        delta_parts: Callable[[int, int], list[Part]],
        old: Spill | None,
    ) -> Spill | None:
        if old is not None:  # (older than hi: see base_parts)
            parts = [old.part, *delta_parts(old.count, hi - 1)]
        else:
            parts = [entries[0].shards, *delta_parts(0, hi - 1)]
        try:
            got = write_spill(
                self.directory, parts, self.max_bytes, drop_page_cache=self.drop_page_cache
            )
        except OSError as e:
            log.warning("spill of the base at seq %d failed: %s", entries[hi - 1].seq, e)
            return None
        if got is None:
            return None
        part, size, pages = got
        s = Spill(generation, tuple(entry_id(e) for e in entries[:hi]), part, size, pages)
        with self._lock:
            self._spill = s
            self.built += 1
        return s

    def drop(self) -> None:
        """Forget the spill (its bytes go with its last reader)."""
        with self._lock:
            self._spill = None
