"""Polling the spool: an idle poll stats the rank's directory instead of listing and indexing
it (a log of thousands of segments, kept by a restore window or spread cursors, made every
poll cost a pass per pair of segments), yet no segment is missed: one written within the
directory clock's tick of a listing, or into a directory whose time does not move, is seen
within a bounded time."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from serverkit import SpoolWriter

from deltad.segment.format import write_segment
from deltad.serve.index import files
from deltad.serve.index.files import LogEntry, covered
from deltad.serve.index.log import SegmentLog
from deltad.serve.index.merge import merge_entries
from deltad.types import SegmentKind


def _entry(first_seq: int, seq: int) -> LogEntry:
    return LogEntry(
        first_seq, seq, seq * 10, SegmentKind.DELTA, Path(f"seg-{seq:012d}.dseg"), 0, 0.0,
        segment=None, shards={},  # type: ignore[arg-type]
    )  # fmt: skip


def test_covered_finds_every_range_inside_another_and_nothing_else() -> None:
    es = [_entry(0, 0), _entry(1, 1), _entry(2, 2), _entry(1, 3), _entry(3, 3), _entry(4, 4),
          _entry(2, 6), _entry(5, 5), _entry(6, 6), _entry(7, 7)]  # fmt: skip
    got = sorted((e.first_seq, e.seq) for e in covered(reversed(es)))
    # (1, 3) covers 1..3; (2, 6) covers 2..6; (1, 3) and (2, 6) overlap without covering
    assert got == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6)]
    assert covered([_entry(0, 0), _entry(1, 1), _entry(2, 2)]) == []
    assert covered([]) == []


def _settle(log: SegmentLog) -> None:
    """Refresh once the directory's time is past the racy window: the next idle poll trusts it."""
    time.sleep(files.RACY_S * 2)
    log.refresh()


def _head(log: SegmentLog) -> int:
    snap = log.snapshot()
    assert snap is not None
    return snap.head.seq


def test_a_segment_written_right_after_a_poll_is_seen_by_the_next(tmp_path: Path) -> None:
    """Segments renamed in one after another, each well within a tick of a coarse directory
    clock (a few ms) of the listing before it, each seen at the next poll. (Where the kernel
    gives a directory a fine time once it was looked at, the time moves with each; with a
    coarse clock it may not, and the racy window makes the next poll list anyway.)"""
    w = SpoolWriter(tmp_path)
    seqs = [w.delta(n=3) for _ in range(30)]
    d = w.layout.rank_dir(1, 0)
    staged = tmp_path / "staged"
    staged.mkdir()
    for s in seqs:
        os.rename(w.layout.segment_path(1, 0, s), staged / str(s))
    log = SegmentLog(w.layout, 0)
    log.refresh()
    assert _head(log) == 0
    for s in seqs:  # (a rename and a poll: well within a tick)
        os.rename(staged / str(s), d / w.layout.segment_path(1, 0, s).name)
        log.refresh()
        assert _head(log) == s


def test_an_idle_poll_does_not_list_and_a_stuck_directory_time_costs_a_bounded_delay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "FULL_SCAN_EVERY_S", 1.0)
    w = SpoolWriter(tmp_path)
    w.delta(n=3)
    log = SegmentLog(w.layout, 0)
    _settle(log)
    listed = time.monotonic()  # (just after the listing the next polls compare with)
    assert _head(log) == 1
    d = w.layout.rank_dir(1, 0)
    before = os.stat(d)
    seq = w.delta(n=3)  # then the directory's time put back: a filesystem that did not move it
    os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))
    log.refresh()
    if time.monotonic() - listed < files.FULL_SCAN_EVERY_S / 2:  # (else a loaded machine
        # may have reached the full scan: nothing to conclude from this poll)
        assert _head(log) == 1, "an unchanged directory was listed again"
    deadline = time.monotonic() + 5 * files.FULL_SCAN_EVERY_S
    while _head(log) != seq and time.monotonic() < deadline:
        time.sleep(0.05)
        log.refresh()
    assert _head(log) == seq  # found by the full scan every FULL_SCAN_EVERY_S
    # and a directory whose time moves is listed at once
    _settle(log)
    seq = w.delta(n=3)
    log.refresh()
    assert _head(log) == seq


def test_whole_second_directory_times_are_not_trusted_for_a_full_scan_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem keeping whole seconds: a file added in the second of the last change does
    not move the directory's time, so such a time is trusted only once it is older than the
    full-scan interval."""
    monkeypatch.setattr(files, "FULL_SCAN_EVERY_S", 60.0)
    w = SpoolWriter(tmp_path)
    log = SegmentLog(w.layout, 0)
    d = w.layout.rank_dir(1, 0)
    whole = int(time.time()) * 1_000_000_000  # this second, as such a filesystem records it
    os.utime(d, ns=(whole, whole))
    time.sleep(files.RACY_S * 2)
    log.refresh()
    seq = w.delta(n=3)
    os.utime(d, ns=(whole, whole))  # the same second: the time did not move
    log.refresh()
    assert _head(log) == seq


def test_thousands_of_segments_are_indexed_once_and_leftovers_still_deleted(
    tmp_path: Path,
) -> None:
    """A long log (a restore window keeps every segment): the idle poll finds nothing to do,
    a merge's leftovers among thousands are still found and deleted, new segments still come."""
    w = SpoolWriter(tmp_path, tables={"t0": (100, 4)})
    for _ in range(1500):
        w.delta(n=1)
    log = SegmentLog(w.layout, 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None and len(snap.entries) == 1501
    _settle(log)
    assert log.snapshot() is snap  # nothing changed: the same snapshot
    # a restart after a merge of 700..710 that crashed before deleting its inputs
    merged = merge_entries(snap.entries[700:711])
    write_segment(
        w.layout.segment_path(1, 0, 710), model="m", generation=1, rank=0, world_size=1,
        seq=710, first_seq=700, step=snap.entries[710].step, kind=SegmentKind.DELTA,
        shards=list(merged.values()), fsync=False,
    )  # fmt: skip
    log = SegmentLog(w.layout, 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None and len(snap.entries) == 1501 - 10
    assert [s for s, _ in w.layout.segments(1, 0)][699:702] == [699, 710, 711]
    assert (snap.entries[700].first_seq, snap.entries[700].seq) == (700, 710)
    _settle(log)
    seq = w.delta(n=1)
    log.refresh()
    assert _head(log) == seq
