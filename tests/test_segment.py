"""The segment file format: round trip, atomic write, corruption detection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.format import (
    ShardRows,
    apply_segments,
    read_header,
    read_segment,
    write_segment,
)
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.types import SegmentKind, Shard


def _rows(
    table: str, ids: list[int], width: int = 4, col_start: int = 0, dim: int = 4
) -> ShardRows:
    t = torch.tensor(ids, dtype=torch.int64)
    vals = torch.randn(len(ids), width)
    return ShardRows(Shard(table, 100, dim, 0, 100, col_start, col_start + width), t, vals)


def _write(path: Path, chunks: list[ShardRows], seq: int = 1) -> None:
    write_segment(
        path,
        model="m",
        generation=7,
        rank=1,
        world_size=2,
        seq=seq,
        step=seq * 10,
        kind=SegmentKind.DELTA,
        shards=chunks,
    )


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    chunks = [
        _rows("t0", [3, 5, 99]),
        _rows("t1", [], width=2, col_start=2),
        _rows("t0", [1], width=2, col_start=2),
    ]
    chunks.append(
        ShardRows(
            Shard("bf", 10, 3, 0, 10, 0, 3), torch.tensor([2]), torch.randn(1, 3).to(torch.bfloat16)
        )
    )
    p = tmp_path / "seg.dseg"
    _write(p, chunks)
    seg = read_segment(p)
    assert seg.header.generation == 7 and seg.header.rank == 1 and seg.header.seq == 1
    assert seg.header.first_seq == 1 and seg.header.step == 10
    assert read_header(p) == seg.header
    assert len(seg.shards) == len(chunks)
    for a, b in zip(chunks, seg.shards, strict=True):
        assert a.key == b.key
        assert torch.equal(a.ids, b.ids)
        assert a.values.dtype == b.values.dtype
        assert torch.equal(a.values, b.values)
    # the views are writable copies-on-write: mutating them never touches the file
    seg.shards[0].values.zero_()
    assert torch.equal(read_segment(p).shards[0].values, chunks[0].values)


def test_flipped_byte_fails_checksum(tmp_path: Path) -> None:
    p = tmp_path / "seg.dseg"
    _write(p, [_rows("t0", list(range(50)))])
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(SegmentCorruptError, match="checksum"):
        read_segment(p)
    read_segment(p, verify=False)  # still parseable when asked not to verify


def _as_version_1(raw: bytes) -> bytes:
    """The same segment in format 1: its magics, version and a zlib crc32 trailer."""
    import struct
    import zlib

    body = bytearray(raw[:-16])
    assert body[:8] == b"DLTSEG02"
    body[:8] = b"DLTSEG01"
    at = body.index(b'"format_version":2')
    body[at : at + 18] = b'"format_version":1'
    return bytes(body) + struct.pack("<II8s", zlib.crc32(body), 0, b"DLTEND01")


def test_version_1_segments_are_still_read_and_verified(tmp_path: Path) -> None:
    """A spool written before format 2 (crc32) is served as it was, and its corruption found."""
    chunks = [_rows("t0", [3, 5, 99]), _rows("t1", [7], width=2, col_start=2)]
    p2, p1 = tmp_path / "v2.dseg", tmp_path / "v1.dseg"
    _write(p2, chunks)
    assert p2.read_bytes()[:8] == b"DLTSEG02" and p2.read_bytes()[-8:] == b"DLTEND02"
    p1.write_bytes(_as_version_1(p2.read_bytes()))
    seg = read_segment(p1)
    assert seg.header.format_version == 1 and read_header(p1).format_version == 1
    for a, b in zip(chunks, seg.shards, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.values, b.values)
    raw = bytearray(p1.read_bytes())
    raw[-17] ^= 0x01  # the payload's last byte (the trailer is 16)
    p1.write_bytes(bytes(raw))
    with pytest.raises(SegmentCorruptError, match="checksum"):
        read_segment(p1)


def test_unknown_or_inconsistent_versions_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "seg.dseg"
    _write(p, [_rows("t0", [1, 2])])
    good = p.read_bytes()
    p.write_bytes(b"DLTSEG09" + good[8:])  # a newer writer's file
    for read in (read_segment, read_header):
        with pytest.raises(SegmentCorruptError, match="newer deltad"):
            read(p)
    p.write_bytes(b"DLTSEG01" + good[8:])  # magic and header disagree
    for read in (read_segment, read_header):
        with pytest.raises(SegmentCorruptError, match="header says format 2, magic says 1"):
            read(p)
    p.write_bytes(b"DLTSEG03" + good[8:])  # an identity-format magic on a version-2 header
    for read in (read_segment, read_header):
        with pytest.raises(SegmentCorruptError, match="header says format 2, magic says 3"):
            read(p)
    p.write_bytes(b"NOTASEG!" + good[8:])
    with pytest.raises(SegmentCorruptError, match="not a deltad segment"):
        read_segment(p)


@pytest.mark.parametrize("cut", [0, 10, 200, -1])
def test_truncated_file_is_corrupt(tmp_path: Path, cut: int) -> None:
    p = tmp_path / "seg.dseg"
    _write(p, [_rows("t0", list(range(50)))])
    raw = p.read_bytes()
    p.write_bytes(raw[:cut] if cut >= 0 else raw[:-1])
    with pytest.raises(SegmentCorruptError):
        read_segment(p)


def test_apply_segments_latest_value_wins(tmp_path: Path) -> None:
    a, b = _rows("t0", [1, 2, 3]), _rows("t0", [2, 4])
    _write(tmp_path / "a", [a], seq=1)
    _write(tmp_path / "b", [b], seq=2)
    tables = apply_segments({}, [read_segment(tmp_path / "a"), read_segment(tmp_path / "b")])
    t = tables["t0"]
    assert t.shape == (100, 4)
    assert torch.equal(t[1], a.values[0]) and torch.equal(t[3], a.values[2])
    assert torch.equal(t[2], b.values[0]) and torch.equal(t[4], b.values[1])


def test_unwritable_spool_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # running as root: permissions do not bind; use a file as dir
        blocker = tmp_path / "file"
        blocker.write_text("x")
        with pytest.raises(SpoolError):
            SpoolLayout(blocker, "m").ensure_writable()
        with pytest.raises(SpoolError):
            _write(blocker / "sub" / "seg.dseg", [_rows("t0", [1])])
    else:
        with pytest.raises(SpoolError):
            SpoolLayout(ro, "m").ensure_writable()


def test_layout_lists_only_complete_segments(tmp_path: Path) -> None:
    lay = SpoolLayout(tmp_path, "m")
    for seq in (2, 0, 1):
        _write(lay.segment_path(5, 0, seq), [_rows("t0", [seq])], seq=seq)
    (lay.rank_dir(5, 0) / ".tmp-abc.dseg").write_bytes(b"partial")
    assert [s for s, _ in lay.segments(5, 0)] == [0, 1, 2]
    assert lay.latest_generation() is None  # no manifest yet
    lay.write_manifest(
        GenerationManifest(
            "m", 5, 2, 0, 0.0, (TableInfo("t0", 100, 4, "float32", "ec", "ec", "row_wise"),)
        )
    )
    assert lay.latest_generation() == 5
    assert lay.read_manifest(5).tables[0].name == "t0"


@pytest.mark.slow
def test_killed_writer_leaves_no_visible_partial_segment(tmp_path: Path) -> None:
    """SIGKILL a process in the middle of writing large segments: only complete files show."""
    code = textwrap.dedent(
        f"""
        import torch, sys
        from deltad.segment.format import ShardRows, write_segment
        from deltad.segment.spool import SpoolLayout
        from deltad.types import SegmentKind, Shard
        lay = SpoolLayout({str(tmp_path)!r}, "m")
        ids = torch.arange(2_000_000)
        vals = torch.randn(2_000_000, 16)
        for seq in range(1000):
            write_segment(lay.segment_path(1, 0, seq), model="m", generation=1, rank=0,
                world_size=1, seq=seq, step=seq, kind=SegmentKind.DELTA,
                shards=[ShardRows(Shard("t", 2_000_000, 16, 0, 2_000_000, 0, 16), ids, vals)])
            print(seq, flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "0"  # one complete segment exists
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    lay = SpoolLayout(tmp_path, "m")
    segs = lay.segments(1, 0)
    assert segs, "the first segment was reported written"
    for _, path in segs:
        read_segment(path)  # every visible segment verifies


def test_the_header_json_keeps_each_shard_flat_under_chunks(tmp_path: Path) -> None:
    """The on-disk header is what version 2 always wrote: ``chunks``, one flat object per
    shard (the Shard record is an in-memory type only)."""
    import json
    import struct

    p = tmp_path / "seg.dseg"
    _write(p, [_rows("t0", [3, 5], width=2, col_start=2)])
    raw = p.read_bytes()
    (hlen,) = struct.unpack_from("<I", raw, 8)
    header = json.loads(raw[16 : 16 + hlen])
    assert "shards" not in header
    (entry,) = header["chunks"]
    assert entry == {
        "table": "t0", "num_rows": 100, "dim": 4, "row_start": 0, "row_end": 100,
        "col_start": 2, "col_end": 4, "dtype": "float32", "count": 2,
        "ids_offset": entry["ids_offset"], "values_offset": entry["values_offset"],
    }  # fmt: skip
    (meta,) = read_header(p).shards
    assert meta.shard == Shard("t0", 100, 4, 0, 100, 2, 4)
    assert (meta.shard.rows, meta.shard.width, meta.shard.covers_full_row) == (100, 2, False)
    assert meta.shard.key == ("t0", 2, 4)
    assert Shard.columns_of("t0", 100, 4, 0, 4).covers_full_row


def test_managed_collision_identities_round_trip_in_a_version_3_file(tmp_path: Path) -> None:
    from deltad.segment.format import IDENTITY_FORMAT_VERSION, MAGICS
    from deltad.types import EMPTY_RAW_ID

    mc = _rows("mc", [2, 7, 40])
    mc.raw_ids = torch.tensor([10_000_017, EMPTY_RAW_ID, 5], dtype=torch.int64)
    mc.evicted = torch.tensor([3, 99_999_999], dtype=torch.int64)
    plain = _rows("t0", [1, 2])
    p = tmp_path / "seg.dseg"
    _write(p, [plain, mc])
    assert p.read_bytes()[:8] == MAGICS[IDENTITY_FORMAT_VERSION][0]
    seg = read_segment(p)
    assert seg.header.format_version == IDENTITY_FORMAT_VERSION
    back = {c.shard.table: c for c in seg.shards}
    assert back["t0"].raw_ids is None and back["t0"].evicted is None
    assert back["mc"].raw_ids is not None and back["mc"].evicted is not None
    assert torch.equal(back["mc"].raw_ids, mc.raw_ids)
    assert torch.equal(back["mc"].evicted, mc.evicted)
    assert torch.equal(back["mc"].values, mc.values)
    # an ordinary segment stays version 2, byte for byte the format older readers know
    q = tmp_path / "plain.dseg"
    _write(q, [plain])
    assert q.read_bytes()[:8] == b"DLTSEG02"
    assert b"raw_ids_offset" not in q.read_bytes()


def test_identities_that_do_not_match_their_slots_are_refused_at_write(tmp_path: Path) -> None:
    mc = _rows("mc", [2, 7])
    mc.raw_ids = torch.tensor([1], dtype=torch.int64)
    with pytest.raises(SpoolError, match="raw ids for"):
        _write(tmp_path / "s.dseg", [mc])
