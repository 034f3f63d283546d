"""Managed-collision tables through the sidecar: merges keep each slot's newest identity, every
form and wire dtype carries raw ids (ids: admitted and evicted; top-k never owes a slot with a
stale identity), generation diffs and relays carry them, and hostile version-3 files are
refused. Real sidecars, real Redis, hand-written version-3 segments (tests/spoolkit.ZchWriter)."""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from serverkit import Client, server_config, wait_for
from spoolkit import ZchWriter
from test_relay import at_step, status, tree

from deltad import wire
from deltad.consume import decode
from deltad.consume.window import RankDelta
from deltad.errors import StreamDecodeError
from deltad.segment.format import ALIGN, MAGICS, ShardRows, checksum, read_segment, write_segment
from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import SegmentLog
from deltad.serve.index.merge import merge_rows
from deltad.serve.index.runs import RunCache
from deltad.serve.index.spill import SpillStore
from deltad.serve.windows.encode import encode_trailer
from deltad.serve.windows.plan import build_window
from deltad.serve.windows.spec import WindowSpec
from deltad.store import EmbeddedRedis
from deltad.types import EMPTY_RAW_ID, Form, SegmentKind, Shard, WireDtype
from deltad.v1 import delta_pb2 as pb

pytestmark = pytest.mark.timeout(120)

E = EMPTY_RAW_ID


class ZchReplica:
    """What a consumer of managed-collision tables holds: rows and slot -> raw id maps."""

    def __init__(self) -> None:
        self.tables: dict[str, torch.Tensor] = {}
        self.raw: dict[str, torch.Tensor] = {}
        self.evicted: dict[str, set[int]] = {}
        self.admitted: dict[str, set[int]] = {}

    def apply(self, d: RankDelta) -> None:
        self.evicted, self.admitted = {}, {}
        for s in d.shards:
            sh = s.shard
            t = self.tables.setdefault(sh.table, torch.zeros(sh.num_rows, sh.dim))
            if s.values is not None and s.ids.numel():
                t[s.ids, sh.col_start : sh.col_end] = s.values
            if s.raw_ids is None:
                assert s.evicted_raw_ids is None and s.admitted_raw_ids is None
                continue
            assert s.raw_ids.numel() == s.ids.numel()
            raw = self.raw.setdefault(sh.table, torch.full((sh.num_rows,), E, dtype=torch.int64))
            raw[s.ids] = s.raw_ids
            assert s.evicted_raw_ids is not None
            ev = s.evicted_raw_ids.tolist()
            assert ev == sorted(set(ev))  # ascending, unique
            self.evicted.setdefault(sh.table, set()).update(ev)
            if s.admitted_raw_ids is not None:
                ad = s.admitted_raw_ids.tolist()
                assert ad == sorted(set(ad))
                self.admitted.setdefault(sh.table, set()).update(ad)

    def holds(self, w: ZchWriter) -> bool:
        return all(torch.equal(self.raw[t], w.raw[t]) for t in w.mc) and all(
            torch.equal(self.tables[t], w.truth[t]) for t in w.specs
        )


@pytest.fixture
def zch(tmp_path: Path) -> ZchWriter:
    return ZchWriter(tmp_path / "spool", mc={"zch": (64, 8)}, tables={"t0": (40, 4)})


@pytest.fixture
def zsidecar(
    tmp_path: Path, zch: ZchWriter, redis_server: EmbeddedRedis
) -> Iterator[SidecarServer]:
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    yield srv
    srv.stop(0)


@pytest.fixture
def zclient(zsidecar: SidecarServer) -> Iterator[Client]:
    c = Client(f"127.0.0.1:{zsidecar.port}")
    yield c
    c.close()


def _synced(srv: SidecarServer, seq: int) -> None:
    wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq, what=f"seq {seq}")


def _rows(ids: list[int], raw: list[int], evicted: list[int] | None = None) -> ShardRows:
    i = torch.tensor(ids, dtype=torch.int64)
    return ShardRows(
        Shard("zch", 16, 2, 0, 16, 0, 2),
        i,
        torch.full((len(ids), 2), float(len(ids))),
        torch.tensor(raw, dtype=torch.int64),
        torch.tensor(evicted or [], dtype=torch.int64),
    )


def test_a_merge_keeps_the_newest_identity_per_slot_and_evicts_only_raw_ids_not_held() -> None:
    a = _rows([1, 2], [10, 20], [5])
    b = _rows([1, 2, 3], [E, 30, 10], [20])  # 10 moves from slot 1 to slot 3, 20 leaves
    c = _rows([4], [5])  # 5, evicted in a, comes back in slot 4
    m = merge_rows([a, b, c])
    assert m.ids.tolist() == [1, 2, 3, 4]
    assert m.raw_ids is not None and m.raw_ids.tolist() == [E, 30, 10, 5]
    assert m.evicted is not None and m.evicted.tolist() == [20]
    # associative: merging merged runs gives the same identities (runs, retention, spills)
    for parts in ([merge_rows([a, b]), c], [a, merge_rows([b, c])]):
        r = merge_rows(parts)
        assert r.raw_ids is not None and r.evicted is not None
        assert torch.equal(r.raw_ids, m.raw_ids) and torch.equal(r.evicted, m.evicted)
    # without values (the ids form) the identities still merge
    ids_only = merge_rows([a, b, c], with_values=False)
    assert ids_only.raw_ids is not None and torch.equal(ids_only.raw_ids, m.raw_ids)
    # one part is passed through with its identities
    one = merge_rows([b])
    assert one.raw_ids is not None and one.evicted is not None and one.evicted.tolist() == [20]


@pytest.mark.parametrize(
    "dtype", [WireDtype.FP32, WireDtype.FP16, WireDtype.INT8, WireDtype.PACKED_INT8]
)
def test_the_rows_form_carries_every_slots_raw_id_in_every_wire_dtype(
    dtype: WireDtype, zch: ZchWriter, zsidecar: SidecarServer, zclient: Client
) -> None:
    rep = ZchReplica()
    d = zclient.pull("p", dtype=dtype)
    assert d.resync
    (mc,) = [s for s in d.shards if s.shard.table == "zch"]
    assert mc.raw_ids is not None and mc.ids.tolist() == list(range(64))  # the whole map
    (plain,) = [s for s in d.shards if s.shard.table == "t0"]
    assert plain.raw_ids is None and plain.evicted_raw_ids is None
    rep.apply(d)
    zclient.commit(d)
    assert torch.equal(rep.raw["zch"], zch.raw["zch"])
    for _ in range(3):
        before = zch.raw["zch"].clone()
        zch.delta(n=4)
        _synced(zsidecar, zch.seq)
        d = zclient.pull("p", dtype=dtype)
        assert not d.resync
        rep.apply(d)
        zclient.commit(d)
        assert torch.equal(rep.raw["zch"], zch.raw["zch"])
        # every raw id that left the slots is reported evicted; none still held is
        gone = set(before.tolist()) - set(zch.raw["zch"].tolist())
        assert gone == rep.evicted["zch"]
        if dtype is WireDtype.FP32:
            assert rep.holds(zch)


@pytest.mark.parametrize(
    "dtype", [WireDtype.FP32, WireDtype.BF16, WireDtype.INT8, WireDtype.PACKED_FP16]
)
def test_a_window_of_several_segments_reports_the_newest_identity_and_what_left(
    dtype: WireDtype, zch: ZchWriter, zsidecar: SidecarServer, zclient: Client
) -> None:
    rep = ZchReplica()
    d = zclient.pull("p")
    rep.apply(d)
    zclient.commit(d)
    before = zch.raw["zch"].clone()
    zch.delta(admit={"zch": {1: 111, 40: 222}})  # 1 held 1007: evicted
    zch.delta(admit={"zch": {2: 111, 41: 1007}}, empty={"zch": [3]})  # 111 moves; 1007 is back
    zch.delta(admit={"zch": {40: 333}}, touch={"zch": [5]})  # 222 admitted, then evicted
    _synced(zsidecar, 3)
    d = zclient.pull("p", dtype=dtype)  # (merged range by range as it is encoded)
    rep.apply(d)
    assert torch.equal(rep.raw["zch"], zch.raw["zch"])
    assert dtype is not WireDtype.FP32 or rep.holds(zch)
    # 1007 came back (not evicted); 2007 (slot 2) and 3007 (slot 3) and 222 left
    assert rep.evicted["zch"] == {2007, 3007, 222}
    assert {2007, 3007} == set(before.tolist()) - set(zch.raw["zch"].tolist())
    (mc,) = [s for s in d.shards if s.shard.table == "zch"]
    assert mc.ids.tolist() == [1, 2, 3, 5, 40, 41]
    assert mc.raw_ids is not None and mc.raw_ids.tolist() == [E, 111, E, 5007, 333, 1007]


def test_the_ids_form_reports_the_raw_ids_admitted_and_evicted(
    zch: ZchWriter, zsidecar: SidecarServer, zclient: Client
) -> None:
    d = zclient.pull("i", Form.IDS)
    (mc,) = [s for s in d.shards if s.shard.table == "zch"]
    assert mc.values is None and mc.raw_ids is not None and mc.admitted_raw_ids is not None
    assert mc.admitted_raw_ids.tolist() == sorted(x for x in zch.raw["zch"].tolist() if x != E)
    zclient.commit(d)
    zch.delta(admit={"zch": {1: 111, 40: 222}}, touch={"zch": [7]})
    zch.delta(admit={"zch": {2: 111}}, empty={"zch": [3]}, touch={"zch": [8]})
    _synced(zsidecar, 2)
    d = zclient.pull("i", Form.IDS)
    (mc,) = [s for s in d.shards if s.shard.table == "zch"]
    assert mc.values is None and mc.ids.tolist() == [1, 2, 3, 7, 8, 40]
    assert mc.raw_ids is not None and mc.raw_ids.tolist() == [E, 111, E, 7007, 8007, 222]
    assert mc.admitted_raw_ids is not None and mc.admitted_raw_ids.tolist() == [111, 222]
    assert mc.evicted_raw_ids is not None and mc.evicted_raw_ids.tolist() == [1007, 2007, 3007]
    (plain,) = [s for s in d.shards if s.shard.table == "t0"]
    assert plain.raw_ids is None and plain.admitted_raw_ids is None


def test_raw_ids_survive_chunking_and_zero_copy_decoding(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Tiny chunks: a window's raw ids, evicted and admitted runs span many RowChunks (and
    chunks with no rows); assembled and zero-copy decoding agree."""
    w = ZchWriter(tmp_path / "spool", mc={"zch": (300, 4)}, tables={})
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        d0 = c.pull("z", Form.IDS, chunk_bytes=64)
        c.commit(d0)
        before = w.raw["zch"].clone()
        # 150 slots re-identified, 100 emptied: 250 evicted over few rows per chunk
        w.delta(
            admit={"zch": {s: 50_000 + s for s in range(150)}},
            empty={"zch": list(range(150, 300))},
        )
        _synced(srv, 1)
        for raw in (True, False):  # the fast path, and parsed protos (zero-copy off)
            for form in (Form.IDS, Form.ROWS):
                d = c.pull("z", form, chunk_bytes=64, raw=raw)
                rep = ZchReplica()
                rep.raw["zch"] = before.clone()
                rep.apply(d)
                assert torch.equal(rep.raw["zch"], w.raw["zch"])
                assert rep.evicted["zch"] == set(before.tolist()) - {E} - set(w.raw["zch"].tolist())
                if form is Form.IDS:
                    assert rep.admitted["zch"] == {50_000 + s for s in range(150)}
        req = pb.GetDeltaRequest(consumer="z", form=wire.form_to_pb(Form.IDS), chunk_bytes=64)
        zc = decode.pull(c.channel, req, timeout=30, zero_copy=True)
        rep = ZchReplica()
        rep.raw["zch"] = before.clone()
        rep.apply(zc)
        assert torch.equal(rep.raw["zch"], w.raw["zch"])
        # the 150 raw ids slots 0..149 held but 50007 (admitted into slot 7)
        assert len(rep.evicted["zch"]) == 149 and 50_007 not in rep.evicted["zch"]
    finally:
        c.close()
        srv.stop(0)


def test_retention_merges_stay_version_3_and_serve_the_same_identities(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    w = ZchWriter(tmp_path / "spool")
    srv = SidecarServer(
        server_config(tmp_path / "spool", redis_server.url, merge_min_segments=2)
    ).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        for _ in range(5):
            w.delta(n=3)
        _synced(srv, 5)
        before = ZchReplica()
        before.apply(c.pull("early"))
        assert before.holds(w)
        assert srv.retention.run_once()
        snap = srv.log.snapshot()
        assert snap is not None and snap.base.seq == 5
        seg = read_segment(snap.base.path)
        assert seg.header.format_version == 3
        (mc,) = [s for s in seg.shards if s.shard.table == "zch"]
        assert mc.raw_ids is not None and torch.equal(mc.raw_ids, w.raw["zch"])
        after = ZchReplica()
        after.apply(c.pull("late"))
        assert after.holds(w)
    finally:
        c.close()
        srv.stop(0)


def _reidentified(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set((before != after).nonzero().flatten().tolist())


@pytest.mark.parametrize("how", ["k", "max_rows"])
def test_topk_never_leaves_a_reidentified_slot_owed_and_converges(
    how: str, zch: ZchWriter, zsidecar: SidecarServer, zclient: Client
) -> None:
    cap = {"k": 1} if how == "k" else {"max_rows": 2}
    form = Form.TOPK if how == "k" else Form.ROWS
    rep = ZchReplica()
    d = zclient.pull("t", form, **cap)
    assert d.resync  # complete, whatever the cap
    rep.apply(d)
    zclient.commit(d)
    owed_slots: set[int] = set()
    for round_ in range(4):
        before = rep.raw["zch"].clone()
        # rows move in many slots (candidates for top-k), a few slots change identity,
        # one of them a slot left owed by the previous pull
        again = sorted(owed_slots)[:1]
        zch.delta(
            touch={"zch": list(range(20, 40)), "t0": list(range(10))},
            admit={"zch": {s: 70_000 + 100 * round_ + s for s in [*again, 50 + round_]}},
            empty={"zch": [3 + round_]},
        )
        _synced(zsidecar, zch.seq)
        changed = _reidentified(before, zch.raw["zch"])
        assert changed >= {50 + round_, 3 + round_, *again}
        d = zclient.pull("t", form, **cap)
        (mc,) = [s for s in d.shards if s.shard.table == "zch"]
        sent = set(mc.ids.tolist())
        assert changed <= sent  # beyond k / max_rows if need be
        assert mc.owed > 0
        rep.apply(d)
        zclient.commit(d)
        # the consumer's identities are the head's after every pull, whatever is owed
        assert torch.equal(rep.raw["zch"], zch.raw["zch"])
        owed_slots = {
            s for s in range(20, 40) if not torch.equal(rep.tables["zch"][s], zch.truth["zch"][s])
        }
        assert owed_slots
    for _ in range(60):  # training paused: repeated pulls converge bit-exactly
        d = zclient.pull("t", form, **cap)
        rep.apply(d)
        zclient.commit(d)
        if all(s.owed == 0 for s in d.shards):
            break
    assert rep.holds(zch)


@pytest.mark.parametrize("form", [Form.ROWS, Form.IDS])
def test_a_generation_diff_sends_reidentified_slots_even_with_equal_rows(
    form: Form, zch: ZchWriter, zsidecar: SidecarServer, zclient: Client
) -> None:
    rep = ZchReplica()
    zch.delta(n=3)
    _synced(zsidecar, 1)
    d = zclient.pull("g", form)
    rep.apply(d)
    zclient.commit(d)
    old_raw = zch.raw["zch"].clone()
    # the trainer restarts from the same rows; slots 1 and 60 hold other raw ids (row kept),
    # slot 2 is emptied (row kept), one ordinary row moves
    raw = {"zch": old_raw.clone()}
    raw["zch"][1], raw["zch"][60], raw["zch"][2] = 424_242, 434_343, E
    truth = {t: v.clone() for t, v in zch.truth.items()}
    truth["t0"][5] += 1.0
    zch.start_generation(2, start_step=100, truth=truth, raw=raw)
    wait_for(lambda: (s := zsidecar.log.snapshot()) is not None and s.generation == 2)
    d = zclient.pull("g", form)
    assert d.generation_diff == 1 and not d.resync
    got = {s.shard.table: s for s in d.shards}
    assert got["zch"].ids.tolist() == [1, 2, 60]
    assert got["zch"].raw_ids is not None and got["zch"].raw_ids.tolist() == [424_242, E, 434_343]
    assert got["zch"].evicted_raw_ids is not None
    assert set(got["zch"].evicted_raw_ids.tolist()) == {
        int(old_raw[1]),
        int(old_raw[2]),
        int(old_raw[60]),
    } - {E}
    assert got["t0"].ids.tolist() == [5] and got["t0"].raw_ids is None
    if form is Form.IDS:
        assert got["zch"].admitted_raw_ids is not None
        assert got["zch"].admitted_raw_ids.tolist() == [424_242, 434_343]
    else:
        assert got["zch"].admitted_raw_ids is None
        rep.apply(d)
        assert rep.holds(zch)


def test_relays_one_and_two_levels_up_carry_identities_bit_equal(
    tmp_path: Path, redis_url: str
) -> None:
    w = ZchWriter(tmp_path / "spool")
    with tree(tmp_path, redis_url, 1, 2) as levels:
        reps = {lv: ZchReplica() for lv in (1, 2)}
        clients = {lv: Client(levels[lv][0]) for lv in (1, 2)}
        try:
            for round_ in range(3):
                if round_:
                    w.delta(n=4)
                wait_for(lambda: at_step(levels[2], w.step), 30, f"relays at step {w.step}")
                for lv, c in clients.items():
                    d = c.pull("p")
                    assert d.resync == (round_ == 0)
                    reps[lv].apply(d)
                    c.commit(d)
                    assert reps[lv].holds(w), f"level {lv}, round {round_}"
            for lv in (1, 2):
                assert [t.managed_collision for t in status(levels[lv][0]).tables] == [True, False]
                segs = [
                    read_segment(p)
                    for _, p in SpoolLayout(tmp_path / f"relay-{lv}-0", "m").segments(1, 0)
                ]
                assert [s.header.format_version for s in segs] == [3, 3, 3]
        finally:
            for c in clients.values():
                c.close()


def _zch_segment(w: ZchWriter, seq: int, chunks: list[ShardRows], magic_version: int = 3) -> Path:
    path = w.layout.segment_path(1, 0, seq)
    write_segment(
        path, model="m", generation=1, rank=0, world_size=1, seq=seq, step=99,
        kind=SegmentKind.DELTA, shards=chunks, fsync=False,
    )  # fmt: skip
    return path


def _mc(ids: list[int], raw: list[int] | None, evicted: list[int] | None = None) -> ShardRows:
    i = torch.tensor(ids, dtype=torch.int64)
    return ShardRows(
        Shard("zch", 64, 8, 0, 64, 0, 8),
        i,
        torch.ones(len(ids), 8),
        None if raw is None else torch.tensor(raw, dtype=torch.int64),
        None if evicted is None else torch.tensor(evicted, dtype=torch.int64),
    )


def _plain(ids: list[int], raw: list[int] | None = None) -> ShardRows:
    i = torch.tensor(ids, dtype=torch.int64)
    r = None if raw is None else torch.tensor(raw, dtype=torch.int64)
    return ShardRows(Shard("t0", 40, 4, 0, 40, 0, 4), i, torch.ones(len(ids), 4), r)


def _rewrite_v3(path: Path, mutate: Callable[[dict[str, Any]], None], version: int = 3) -> None:
    """Change a segment's header, keep its payload, and give it a valid checksum again (with
    the magic of ``version``)."""
    raw = path.read_bytes()
    hlen = struct.unpack_from("<I", raw, 8)[0]
    header = json.loads(raw[16 : 16 + hlen])
    payload = raw[(16 + hlen + ALIGN - 1) // ALIGN * ALIGN : -16]
    mutate(header)
    new = json.dumps(header).encode()
    magic, end = MAGICS[version]
    head = struct.pack("<8sII", magic, len(new), 0) + new
    body = head + b"\0" * ((-len(head)) % ALIGN) + payload
    path.write_bytes(body + struct.pack("<Q8s", checksum(body, version), end))


def _mc_chunk(**kw: object) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        next(c for c in h["chunks"] if c["table"] == "zch").update(kw)

    return mutate


def _hostile_v3(case: str, w: ZchWriter) -> None:
    ok = [_mc([1, 5], [11, 55], [7]), _plain([2])]
    if case == "raw ids on an ordinary table":
        _zch_segment(w, 2, [_mc([1], [11], []), _plain([2], [22])])
    elif case == "no raw ids on a managed-collision table":
        _zch_segment(w, 2, [_mc([1, 5], None), _plain([2])])
    elif case == "evicted not ascending":
        _zch_segment(w, 2, [_mc([1], [11], [9, 3]), _plain([2])])
    elif case == "evicted repeated":
        _zch_segment(w, 2, [_mc([1], [11], [3, 3]), _plain([2])])
    elif case == "raw ids past the payload":
        _rewrite_v3(_zch_segment(w, 2, ok), _mc_chunk(raw_ids_offset=1 << 20))
    elif case == "evicted past the payload":
        _rewrite_v3(_zch_segment(w, 2, ok), _mc_chunk(evicted_count=1 << 16))
    elif case == "negative evicted count":
        _rewrite_v3(_zch_segment(w, 2, ok), _mc_chunk(evicted_count=-1))
    elif case == "unaligned raw ids offset":
        _rewrite_v3(_zch_segment(w, 2, ok), _mc_chunk(raw_ids_offset=3))
    elif case == "string evicted offset":
        _rewrite_v3(_zch_segment(w, 2, ok), _mc_chunk(evicted_offset="0"))
    elif case == "identities in a version 2 file":
        _rewrite_v3(_zch_segment(w, 2, ok), lambda h: h.update(format_version=2), version=2)
    elif case == "a raw id given to two slots":
        _zch_segment(w, 2, [_mc([1, 5], [11, 11], []), _plain([2])])
    elif case == "a raw id given to a slot while an unlisted slot holds it":
        held = _held_slot(w, avoid={40})
        _zch_segment(w, 2, [_mc([40], [int(w.raw["zch"][held])], []), _plain([2])])
    elif case == "an evicted raw id still held by an unlisted slot":
        held = _held_slot(w, avoid={1})
        _zch_segment(w, 2, [_mc([1], [11], [int(w.raw["zch"][held])]), _plain([2])])
    elif case == "an evicted raw id given to a listed slot":
        _zch_segment(w, 2, [_mc([1, 5], [11, 55], [11]), _plain([2])])
    elif case == "a negative raw id":
        _zch_segment(w, 2, [_mc([1, 5], [11, -5], []), _plain([2])])
    elif case == "a negative evicted raw id":
        _zch_segment(w, 2, [_mc([1], [11], [-3]), _plain([2])])
    elif case == "the empty id evicted":
        _zch_segment(w, 2, [_mc([1], [11], [E]), _plain([2])])
    else:
        raise AssertionError(case)


HOSTILE_V3 = [
    "raw ids on an ordinary table",
    "no raw ids on a managed-collision table",
    "evicted not ascending",
    "evicted repeated",
    "raw ids past the payload",
    "evicted past the payload",
    "negative evicted count",
    "unaligned raw ids offset",
    "string evicted offset",
    "identities in a version 2 file",
    # inconsistent identities: a predictor can install none of them (a raw id held twice, an
    # evicted one still held), so one such file served would stop every serving predictor
    "a raw id given to two slots",
    "a raw id given to a slot while an unlisted slot holds it",
    "an evicted raw id still held by an unlisted slot",
    "an evicted raw id given to a listed slot",
    "a negative raw id",
    "a negative evicted raw id",
    "the empty id evicted",
]


def _held_slot(w: ZchWriter, avoid: set[int]) -> int:
    """A slot of rank 0's ``zch`` that holds a raw id (not in ``avoid``)."""
    return next(s for s in range(64) if int(w.raw["zch"][s]) != E and s not in avoid)


@pytest.mark.parametrize("case", HOSTILE_V3)
def test_a_hostile_version_3_file_is_quarantined_and_never_indexed(
    case: str, tmp_path: Path
) -> None:
    w = ZchWriter(tmp_path / "spool")
    w.delta(n=2)  # seq 1, valid
    _hostile_v3(case, w)
    seglog = SegmentLog(w.layout, 0)
    seglog.refresh()
    snap = seglog.snapshot()
    assert snap is not None and snap.head.seq == 1, case
    assert seglog.quarantined == 1, case
    assert not w.layout.segment_path(1, 0, 2).exists(), case
    assert w.layout.rebase_request_path(1, 0).exists(), case  # the trainer is told
    w.seq = 1
    w.delta(n=2)  # a good seq 2 after it is served
    seglog.refresh()
    snap = seglog.snapshot()
    assert snap is not None and snap.head.seq == 2, case


def test_windows_from_runs_and_the_spill_carry_the_same_identities_as_merged_ones(
    tmp_path: Path,
) -> None:
    w = ZchWriter(tmp_path / "spool", mc={"zch": (200, 4)}, tables={"t0": (50, 4)})
    maps = {0: w.raw["zch"].clone()}
    for seq in range(1, 22):
        w.delta(n=6)
        maps[seq] = w.raw["zch"].clone()
    log = SegmentLog(w.layout, 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None and snap.head.seq == 21
    runs = RunCache(1 << 30)
    spill = SpillStore(tmp_path / "spill", 1 << 30, only_when_merged=False)

    def window(spec: WindowSpec, **kw: Any) -> list[bytes]:
        win = build_window(snap, spec, 0, {}, lazy=False, **kw)
        assert win.bound is not None and win.nbytes <= win.bound  # what the cache reserves
        return [win.header, *win.chunks]

    cases = [(True, -1, 21), (True, -1, 13), (False, 2, 21), (False, 0, 17), (False, 20, 21)]
    for (resync, frm, to), form, chunk in itertools.product(
        cases, (Form.ROWS, Form.IDS), (64, 1024)
    ):
        spec = WindowSpec(0, 1, resync, frm, to, form, WireDtype.FP32, (), 0, 0.0, 0, chunk)
        want = window(spec)
        assert window(spec, runs=runs, spill=spill) == want, (resync, frm, to, form)
        d = decode.decode_stream([*want, encode_trailer(pb.DeltaTrailer())])
        rep = ZchReplica()
        rep.raw["zch"] = maps[max(frm, 0)].clone()
        rep.apply(d)
        assert torch.equal(rep.raw["zch"], maps[to])
    assert runs.built > 0 and spill.hits > 0


def _stream(identities: bool, chunk: pb.RowChunk, evicted_count: int = 0) -> list[bytes]:
    header = pb.DeltaHeader(form=pb.FORM_ROWS, dtype=pb.WIRE_DTYPE_FP32)
    header.slices.add(
        table="zch", num_rows=8, dim=1, col_start=0, col_end=1, count=chunk.count,
        identities=identities, evicted_count=evicted_count,
    )  # fmt: skip
    return [
        pb.GetDeltaResponse(header=header).SerializeToString(),
        pb.GetDeltaResponse(chunk=chunk).SerializeToString(),
        encode_trailer(pb.DeltaTrailer()),
    ]


def _i64(*xs: int) -> bytes:
    return torch.tensor(xs, dtype=torch.int64).numpy().tobytes()


@pytest.mark.parametrize(
    ("case", "identities", "chunk", "evicted_count"),
    [
        ("raw ids on an ordinary slice", False, {"raw_ids": _i64(5)}, 0),
        ("evicted on an ordinary slice", False, {"evicted": _i64(5)}, 0),
        ("raw ids missing", True, {}, 0),
        ("raw ids short", True, {"raw_ids": _i64(5)[:4]}, 0),
        ("evicted past its count", True, {"raw_ids": _i64(5), "evicted": _i64(1, 2)}, 1),
        ("evicted missing", True, {"raw_ids": _i64(5)}, 2),
        ("admitted outside the ids form", True, {"raw_ids": _i64(5), "admitted": _i64(1)}, 0),
    ],
)
def test_a_consumer_refuses_a_stream_whose_identities_do_not_add_up(
    case: str, identities: bool, chunk: dict[str, bytes], evicted_count: int
) -> None:
    c = pb.RowChunk(count=1, ids=_i64(3), values=torch.ones(1).numpy().tobytes(), **chunk)
    with pytest.raises(StreamDecodeError):
        decode.decode_stream(_stream(identities, c, evicted_count))
    ok = pb.RowChunk(count=1, ids=_i64(3), values=torch.ones(1).numpy().tobytes())
    if identities:
        ok.raw_ids = _i64(5)
        ok.evicted = _i64(*range(evicted_count))
    d = decode.decode_stream(_stream(identities, ok, evicted_count))  # the same, well formed
    assert (d.shards[0].raw_ids is not None) == identities


@pytest.mark.parametrize("form", [Form.ROWS, Form.IDS])
def test_more_evicted_raw_ids_than_rows_travel_in_chunks_of_no_rows(
    form: Form, zch: ZchWriter, zsidecar: SidecarServer, zclient: Client
) -> None:
    d = zclient.pull("x", form)
    zclient.commit(d)
    before = zch.raw["zch"].clone()
    for r in range(4):  # slots 0..9 take a new raw id every step: 4 raw ids leave each
        zch.delta(admit={"zch": {s: 900_000 + 100 * r + s for s in range(10)}})
    _synced(zsidecar, 4)
    for chunk in (64, 4096):
        d = zclient.pull("x", form, chunk_bytes=chunk)
        (mc,) = [s for s in d.shards if s.shard.table == "zch"]
        assert mc.ids.tolist() == list(range(10))
        assert mc.raw_ids is not None and mc.raw_ids.tolist() == [900_300 + s for s in range(10)]
        want = {int(x) for x in before[:10]} | {
            900_000 + 100 * r + s for r in range(3) for s in range(10)
        }
        assert mc.evicted_raw_ids is not None and set(mc.evicted_raw_ids.tolist()) == want
        if form is Form.IDS:
            assert mc.admitted_raw_ids is not None
            assert mc.admitted_raw_ids.tolist() == [900_300 + s for s in range(10)]
        snap = zsidecar.log.snapshot()
        assert snap is not None
        spec = WindowSpec(0, 1, False, 0, 4, form, WireDtype.FP32, (), 0, 0.0, 0, chunk)
        win = build_window(snap, spec, 0, {}, lazy=False)
        assert win.bound is not None and win.nbytes <= win.bound
        row_chunks = 10 if form is Form.ROWS else 5  # (64 bytes: 1 row, or 2 ids, a chunk)
        assert len(win.chunks) > row_chunks or chunk > 64  # then chunks of no rows
