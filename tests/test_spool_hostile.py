"""The spool is input: a matrix of hostile files (valid checksums, bad content; links, FIFOs,
odd names), each quarantined and never served; and bytes changed on disk after indexing never
reach a consumer or a merge."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from serverkit import MODEL, Client, Replica, SpoolWriter, redis_server, server_config, wait_for

from deltad.segment.format import (
    ALIGN,
    DENSE_END_MAGIC,
    DENSE_MAGIC,
    END_MAGIC,
    MAGIC,
    ShardRows,
    checksum,
    encode_dense,
    write_segment,
)
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import SegmentLog
from deltad.store import EmbeddedRedis
from deltad.types import SegmentKind, Shard

__all__ = ["redis_server"]


def _write(spool: SpoolWriter, seq: int, chunks: list[ShardRows], **kw: object) -> Path:
    path = spool.layout.segment_path(1, 0, seq)
    opts: dict[str, object] = {
        "model": MODEL, "generation": 1, "rank": 0, "world_size": 1, "seq": seq, "step": 99,
        "kind": SegmentKind.DELTA, "shards": chunks, "fsync": False,
    }  # fmt: skip
    opts.update(kw)
    write_segment(path, **opts)  # type: ignore[arg-type]
    return path


def _chunk(
    ids: list[int], table: str = "t0", n: int = 1000, dim: int = 8, cols: tuple[int, int] = (0, 8)
) -> ShardRows:
    i = torch.tensor(ids, dtype=torch.int64)
    return ShardRows(Shard(table, n, dim, 0, n, *cols), i, torch.ones(len(ids), cols[1] - cols[0]))


def _rewrite_header(path: Path, mutate: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    """Change a segment's header and give it a valid checksum again (payload kept)."""
    raw = path.read_bytes()
    hlen = struct.unpack_from("<I", raw, 8)[0]
    header = json.loads(raw[16 : 16 + hlen])
    payload = raw[(16 + hlen + ALIGN - 1) // ALIGN * ALIGN : -16]
    mutate(header)
    new = json.dumps(header).encode()
    head = struct.pack("<8sII", MAGIC, len(new), 0) + new
    body = head + b"\0" * ((-len(head)) % ALIGN) + payload
    path.write_bytes(body + struct.pack("<Q8s", checksum(body), END_MAGIC))


def _chunk0(**kw: object) -> Callable[[dict], None]:  # type: ignore[type-arg]
    def mutate(h: dict) -> None:  # type: ignore[type-arg]
        h["chunks"][0].update(kw)

    return mutate


def _set(**kw: object) -> Callable[[dict], None]:  # type: ignore[type-arg]
    return lambda h: h.update(kw)


def _hostile(case: str, spool: SpoolWriter, outside: Path) -> None:
    """Write hostile seq 2 (or a hostile file) into rank 0 of generation 1."""
    d = spool.layout.rank_dir(1, 0)
    ok = [_chunk([1, 5, 9])]
    if case == "ids out of range":
        _write(spool, 2, [_chunk([1, 5, 1000])])
    elif case == "negative id":
        _write(spool, 2, [_chunk([-1, 5])])
    elif case == "unsorted ids":
        _write(spool, 2, [_chunk([9, 5])])
    elif case == "duplicate ids":
        _write(spool, 2, [_chunk([5, 5])])
    elif case == "dim disagrees with manifest":
        _write(spool, 2, [_chunk([1], dim=9, cols=(0, 9))])
    elif case == "num_rows disagrees with manifest":
        _write(spool, 2, [_chunk([1], n=2000)])
    elif case == "columns beyond dim":
        c = _chunk([1], cols=(4, 12))
        _write(spool, 2, [c])
    elif case == "unknown table":
        _write(spool, 2, [_chunk([1], table="nope")])
    elif case == "negative offset":
        _rewrite_header(_write(spool, 2, ok), _chunk0(ids_offset=-64))
    elif case == "string count":
        _rewrite_header(_write(spool, 2, ok), _chunk0(count="3"))
    elif case == "float count":
        _rewrite_header(_write(spool, 2, ok), _chunk0(count=3.0))
    elif case == "string seq":
        _rewrite_header(_write(spool, 2, ok), _set(seq="2"))
    elif case == "float generation":
        _rewrite_header(_write(spool, 2, ok), _set(generation=1.0))
    elif case == "bool rank":
        _rewrite_header(_write(spool, 2, ok), _set(rank=False))
    elif case == "delta claiming first_seq 0":
        _rewrite_header(_write(spool, 2, ok), _set(first_seq=0))
    elif case == "count past the payload":
        _rewrite_header(_write(spool, 2, ok), _chunk0(count=999))
    elif case == "header not an object":
        _rewrite_header(_write(spool, 2, ok), lambda h: h.clear())
    elif case == "symlink outside the spool":
        target = outside / "evil.dseg"
        _write(spool, 2, ok)
        os.replace(spool.layout.segment_path(1, 0, 2), target)
        os.symlink(target, spool.layout.segment_path(1, 0, 2))
    elif case == "fifo named like a segment":
        os.mkfifo(spool.layout.segment_path(1, 0, 2))
    elif case == "non-ascii digits":
        _write(spool, 2, ok)
        os.replace(spool.layout.segment_path(1, 0, 2), d / "seg-\u0660\u0660\u0660\u0660"
                   "\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0662.dseg")  # fmt: skip
    elif case == "trailing newline":
        _write(spool, 2, ok)
        os.replace(spool.layout.segment_path(1, 0, 2), d / "seg-000000000002.dseg\n")
    else:
        raise AssertionError(case)


CASES = [
    "ids out of range",
    "negative id",
    "unsorted ids",
    "duplicate ids",
    "dim disagrees with manifest",
    "num_rows disagrees with manifest",
    "columns beyond dim",
    "unknown table",
    "negative offset",
    "string count",
    "float count",
    "string seq",
    "float generation",
    "bool rank",
    "delta claiming first_seq 0",
    "count past the payload",
    "header not an object",
    "symlink outside the spool",
    "fifo named like a segment",
    "non-ascii digits",
    "trailing newline",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES)
def test_a_hostile_file_is_quarantined_and_never_indexed(case: str, tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()  # seq 1, valid
    outside = tmp_path / "outside"
    outside.mkdir()
    _hostile(case, spool, outside)
    seglog = SegmentLog(spool.layout, 0)
    seglog.refresh()
    seglog.refresh()
    snap = seglog.snapshot()
    assert snap is not None and snap.head.seq == 1, case
    assert seglog.quarantined == 1, case
    names = sorted(p.name for p in spool.layout.rank_dir(1, 0).iterdir())
    stray = case in ("non-ascii digits", "trailing newline")
    # a lost segment asks the publisher for a fresh base; a stray name loses nothing
    assert names == [
        *([] if stray else ["rebase.request"]),
        "seg-000000000000.dseg",
        "seg-000000000001.dseg",
    ]
    if case == "symlink outside the spool":
        assert (outside / "evil.dseg").exists()  # the link was moved, not its target


def test_a_rank_directory_linked_outside_the_spool_is_never_indexed_nor_touched(
    tmp_path: Path,
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()
    d = spool.layout.rank_dir(1, 0)
    outside = tmp_path / "outside"
    os.replace(d, outside)
    os.symlink(outside, d)
    seglog = SegmentLog(spool.layout, 0)
    seglog.refresh()
    assert seglog.snapshot() is None and seglog.quarantined == 0
    assert sorted(p.name for p in outside.iterdir()) == [
        "seg-000000000000.dseg",
        "seg-000000000001.dseg",
    ]


def test_bytes_changed_on_disk_after_indexing_never_reach_a_consumer_or_a_merge(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    for _ in range(3):
        spool.delta()
    srv = SidecarServer(
        server_config(tmp_path / "spool", redis_server.url, merge_min_segments=2)
    ).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == 3)
        for seq in (0, 2):  # flip 64 bytes in place (same inode) of the base and of a delta
            path = spool.layout.segment_path(1, 0, seq)
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                for at in (size // 3, size // 2):
                    f.seek(at)
                    f.write(bytes(b ^ 0xFF for b in f.read(32)))
        rep = Replica()
        rep.apply(c.pull("new"))  # a new consumer: the full tables, as indexed
        assert all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.specs)
        assert srv.retention.run_once()  # the merge reads the verified copies
        rep2 = Replica()
        rep2.apply(c.pull("newer"))
        assert all(torch.equal(rep2.tables[t], spool.truth[t]) for t in spool.specs)
    finally:
        c.close()
        srv.stop(0)


def _dense_bytes(header_mutate: Callable[[dict], None] | None = None, seq: int = 1) -> bytes:  # type: ignore[type-arg]
    raw = encode_dense(
        model=MODEL, generation=1, rank=0, seq=seq, step=10,
        tensors={"mlp.weight": torch.ones(3, 4), "bn.num_batches_tracked": torch.tensor(7)},
    )  # fmt: skip
    if header_mutate is None:
        return raw
    hlen = struct.unpack_from("<I", raw, 8)[0]
    header = json.loads(raw[16 : 16 + hlen])
    payload = raw[(16 + hlen + ALIGN - 1) // ALIGN * ALIGN : -16]
    header_mutate(header)
    new = json.dumps(header).encode()
    head = struct.pack("<8sII", DENSE_MAGIC, len(new), 0) + new
    body = head + b"\0" * ((-len(head)) % ALIGN) + payload
    return body + struct.pack("<Q8s", checksum(body), DENSE_END_MAGIC)


def _tensor0(**kw: object) -> Callable[[dict], None]:  # type: ignore[type-arg]
    def mutate(h: dict) -> None:  # type: ignore[type-arg]
        h["tensors"][0].update(kw)

    return mutate


DENSE_CASES: dict[str, Callable[[dict], None] | None] = {  # type: ignore[type-arg]
    "string generation": _set(generation="1"),
    "another model": _set(model="other"),
    "seq not its name": _set(seq=5),
    "float step": _set(step=10.5),
    "negative tensor offset": _tensor0(offset=-64),
    "unknown dtype": _tensor0(dtype="complex1024"),
    "repeated tensor name": lambda h: h["tensors"].append(dict(h["tensors"][0])),
    "symlink outside the spool": None,
    "fifo named like a dense state": None,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_a_hostile_dense_state_is_quarantined_and_never_served(case: str, tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()  # seq 1
    d = spool.layout.rank_dir(1, 0)
    (d / "dense-000000000000.dseg").write_bytes(_dense_bytes(seq=0))  # a valid one at seq 0
    target = d / "dense-000000000001.dseg"
    if case == "symlink outside the spool":
        evil = tmp_path / "evil.dseg"
        evil.write_bytes(_dense_bytes())
        os.symlink(evil, target)
    elif case == "fifo named like a dense state":
        os.mkfifo(target)
    else:
        target.write_bytes(_dense_bytes(DENSE_CASES[case]))
    seglog = SegmentLog(spool.layout, 0)
    seglog.refresh()
    snap = seglog.snapshot()
    assert snap is not None and [x.seq for x in snap.dense] == [0], case
    assert seglog.quarantined == 1, case
    assert not os.path.lexists(target), case
    if case == "symlink outside the spool":
        assert (tmp_path / "evil.dseg").exists()  # the link was moved, not its target


_HUGE_CHILD = r"""
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from deltad.segment.spool import SpoolLayout
from deltad.serve.index.log import SegmentLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
# no file this process writes may pass 64 MiB: copying the huge file would fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
layout = SpoolLayout(Path(sys.argv[1]), "m")
seglog = SegmentLog(layout, 0, on_quarantine=lambda p, why: print("QUARANTINED", p.name, why))
seglog.refresh()
snap = seglog.snapshot()
print("HEAD", snap.head.seq, [d.seq for d in snap.dense])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case",
    [
        "zeros",
        "valid segment, padded",
        "dense state, padded",
        "segment offset past its rows, padded",
        "dense offset past its tensors, padded",
    ],
)
def test_a_huge_sparse_file_is_refused_before_any_of_it_is_copied(
    case: str, tmp_path: Path
) -> None:
    """Review 11: a 3 GB sparse file named like a segment was copied whole into memory (2.9 GB
    of the sidecar's cgroup) before its first bytes were checked; one past the pod's limit gets
    it killed, again at every restart. The header is read and the file's size checked against
    it first: here in a process that may write no file past 64 MiB, so a copy would fail."""
    import subprocess
    import sys

    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()  # seq 1
    assert MODEL == "m"
    d = spool.layout.rank_dir(1, 0)
    huge = 8 << 30  # sparse: no disk used
    if case == "zeros":
        target = spool.layout.segment_path(1, 0, 2)
        with open(target, "wb") as f:
            f.truncate(huge)
        why = "not a deltad segment"
    elif case == "valid segment, padded":
        target = _write(spool, 2, [_chunk([1, 5, 9])])
        os.truncate(target, huge)
        why = "more than the"
    elif case == "segment offset past its rows, padded":  # (review 12: offsets claimed room)
        target = _write(spool, 2, [_chunk([1, 5, 9])])
        _rewrite_header(target, _chunk0(values_offset=huge - (1 << 20)))
        os.truncate(target, huge)
        why = "more than the"
    elif case == "dense offset past its tensors, padded":
        target = d / "dense-000000000001.dseg"
        target.write_bytes(_dense_bytes(_tensor0(offset=huge - (1 << 20))))
        os.truncate(target, huge)
        why = "more than the"
    else:
        target = d / "dense-000000000001.dseg"
        target.write_bytes(_dense_bytes())
        os.truncate(target, huge)
        why = "more than the"
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_CHILD, str(tmp_path / "spool"), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "QUARANTINED" in out.stdout and target.name in out.stdout, out.stdout
    assert why in out.stdout, out.stdout
    assert "HEAD 1 []" in out.stdout, out.stdout
    assert not os.path.lexists(target)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["fifo", "link to /dev/zero", "huge"])
def test_a_hostile_manifest_never_blocks_the_poll_and_a_good_one_is_taken_later(
    case: str, tmp_path: Path
) -> None:
    """Review 11: a generation manifest that was a FIFO hung the sidecar's spool poll for good
    (no new segment indexed, health still SERVING, no log line), and one linked to /dev/zero
    was read without bound. Manifests are opened as segments are: no link followed, no wait on
    a FIFO, a regular file of bounded size."""
    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()  # generation 1, seq 1
    seglog = SegmentLog(spool.layout, 0)
    seglog.refresh()
    spool.start_generation(2)  # manifest + base of generation 2
    manifest = spool.layout.manifest_path(2)
    good = manifest.read_bytes()
    manifest.unlink()
    if case == "fifo":
        os.mkfifo(manifest)
    elif case == "link to /dev/zero":
        os.symlink("/dev/zero", manifest)
    else:
        with open(manifest, "wb") as f:
            f.write(b"{")
            f.truncate(1 << 30)  # sparse
    for _ in range(2):  # the poll returns, and stays on generation 1
        seglog.refresh()
        snap = seglog.snapshot()
        assert snap is not None and snap.generation == 1 and snap.head.seq == 1, case
    os.unlink(manifest)
    manifest.write_bytes(good)
    seglog.refresh()
    snap = seglog.snapshot()
    assert snap is not None and snap.generation == 2 and snap.head.seq == 0, case
