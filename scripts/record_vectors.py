"""Record the conformance vectors (docs/conformance.md) from real sidecars over hand-built spools.

    .venv/bin/python scripts/record_vectors.py [--out tests/vectors] [--only NAME ...]

Each scenario writes a spool (tests/spoolkit's FakeTrainer / ZchWriter), runs real in-process
sidecars (``deltad serve``'s SidecarServer) on an embedded Redis, pulls from them as a consumer
named after the vector (Status, Register, GetDelta, Commit: the raw bytes), and writes the
exchanges and the state the pulls must produce (computed by :mod:`deltad.conformance.reference`
and checked against the trainer's truth). Deterministic: the same code records the same bytes
(the server's random pull ids and timings are replaced by fixed values).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from spoolkit import FakeTrainer, ZchWriter  # noqa: E402

from deltad import wire  # noqa: E402
from deltad.config import ServerConfig  # noqa: E402
from deltad.conformance import reference as ref  # noqa: E402
from deltad.conformance import vectors as vf  # noqa: E402
from deltad.segment.dense import encode_dense, write_dense  # noqa: E402
from deltad.store.embedded import EmbeddedRedis  # noqa: E402
from deltad.types import WireDtype  # noqa: E402
from deltad.v1 import delta_pb2 as pb  # noqa: E402
from deltad.v1 import delta_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "m"
DEFAULT_OUT = ROOT / "tests" / "vectors"
RECORD_COMMAND = ".venv/bin/python scripts/record_vectors.py"
Forge = Callable[[list[bytes]], list[bytes]]


class Recorder:
    """One vector: sidecars over ``spool``, a consumer named ``name``, the exchanges on disk."""

    def __init__(
        self,
        out: Path,
        redis_url: str,
        spool: Path,
        name: str,
        description: str,
        world: int,
        *,
        form: int = pb.FORM_ROWS,
        dtype: int = pb.WIRE_DTYPE_FP32,
        k: int = 0,
        with_dense: bool = False,
        strict_identities: bool = False,
        server: dict[str, Any] | None = None,
    ) -> None:
        self.dir = out / name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.name, self.world, self.redis_url = name, world, redis_url
        self.options = {"form": form, "dtype": dtype, "k": k, "with_dense": with_dense}
        self.manifest: dict[str, Any] = {
            "format": vf.FORMAT_VERSION,
            "name": name,
            "description": description,
            "consumer": name,
            "model": MODEL,
            "world_size": world,
            "request": {
                "form": pb.Form.Name(form),
                "dtype": pb.WireDtype.Name(dtype),
                "k": k,
                "with_dense": with_dense,
            },
            "strict_identities": strict_identities,
            "ranks": [],
            "pulls": [],
        }
        self.servers = []
        from deltad.serve.edge.app import SidecarServer

        for r in range(world):
            cfg = ServerConfig(
                spool_dir=spool, model=MODEL, listen="127.0.0.1:0", redis_url=redis_url,
                rank=r, poll_interval_s=0.02, retention_interval_s=3600.0, grace_period_s=0.2,
                **(server or {}),
            )  # fmt: skip
            self.servers.append(SidecarServer(cfg).start())
        self.channels = [grpc.insecure_channel(s.endpoint) for s in self.servers]
        self.stubs = [pb_grpc.DeltaServiceStub(c) for c in self.channels]
        self.state = ref.State()
        self.pull_ids: dict[str, str] = {}
        self.first = True
        self.registered = False
        self.committed: dict[int, pb.Cursor] = {}

    def close(self) -> None:
        for c in self.channels:
            c.close()
        for s in self.servers:
            s.stop(0)

    # ---- normalization (fixed values for what the server makes up per call) ------------------

    def _cursor(self, c: pb.Cursor) -> None:
        if c.pull_id:
            c.pull_id = self.pull_ids.setdefault(c.pull_id, f"{self.name}.pull{len(self.pull_ids)}")

    def _norm_stream(self, msgs: list[bytes]) -> list[bytes]:
        out = []
        for raw in msgs:
            m = pb.GetDeltaResponse.FromString(raw)
            if m.WhichOneof("msg") == "trailer":
                m.trailer.merge_seconds = 0.0
                self._cursor(m.trailer.cursor)
                raw = m.SerializeToString(deterministic=True)
            out.append(raw)
        return out

    @staticmethod
    def _norm_status(s: pb.StatusResponse) -> bytes:
        s.head_age_seconds = 0.0
        s.log_bytes = 0
        if s.rollout_state:
            st = json.loads(s.rollout_state)
            for key in list(st):
                if key.endswith("_unix") or key in ("updated", "at"):
                    st[key] = 0
            for rb in st.get("rollbacks", []):
                if isinstance(rb, dict):
                    for key in list(rb):
                        if key.endswith("_unix"):
                            rb[key] = 0
            s.rollout_state = json.dumps(st, sort_keys=True, separators=(",", ":"))
        return s.SerializeToString(deterministic=True)

    def _write(self, rel: str, data: bytes) -> str:
        p = self.dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return rel

    # ---- the exchanges -----------------------------------------------------------------------

    def wait(self, step: int, generation: int | None = None, cap: int | None = None) -> None:
        """Until every sidecar's head is at ``step`` (and ``generation``; and the consumer's
        cap at ``cap``)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sts = [s.Status(pb.StatusRequest(consumer=self.name), timeout=10) for s in self.stubs]
            if all(
                st.head_step == step
                and (generation is None or st.generation == generation)
                and (cap is None or st.cap_step == cap)
                for st in sts
            ):
                return
            time.sleep(0.02)
        raise RuntimeError(f"{self.name}: sidecars not at step {step}")

    def register(self) -> None:
        for r, stub in enumerate(self.stubs):
            resp = stub.Register(
                pb.RegisterRequest(consumer=self.name, lease_ttl_seconds=30.0), timeout=10
            )
            self._cursor(resp.cursor)
            rel = self._write(f"rank{r}/register.bin", resp.SerializeToString(deterministic=True))
            self.manifest["ranks"].append({"rank": r, "register": rel, "pulls": []})
        self.registered = True

    def pull(
        self,
        step: int,
        *,
        generation: int | None = None,
        cap: int | None = None,
        outcome: str = "applied",
        forge: Forge | None = None,
        cut_after: int | None = None,
        refuse_first_ms: int | None = None,
        note: str = "",
    ) -> list[ref.Window]:
        """One aligned pull at ``step`` on every rank, recorded; applied to the reference state
        (``outcome`` "applied") or refused by it ("refused": ``forge`` makes the stream hostile)."""
        self.wait(step, generation, cap)
        if not self.registered:
            self.register()
        k = len(self.manifest["pulls"])
        statuses = [s.Status(pb.StatusRequest(consumer=self.name), timeout=10) for s in self.stubs]
        target = min(st.head_step for st in statuses)
        caps = [st.cap_step for st in statuses if st.rollout_state and st.cap_step >= 0]
        target = min([target, *caps])
        windows, recs, real_cursors = [], [], []
        undecodable = ""
        for r, st in enumerate(statuses):
            pre = f"rank{r}/pull{k}"
            req = pb.GetDeltaRequest(
                consumer=self.name, form=self.options["form"], dtype=self.options["dtype"],
                k=self.options["k"], with_dense=self.options["with_dense"],
                from_base=self.first, max_step=target,
            )  # fmt: skip
            rec = vf.PullRecord(
                status=self._write(f"{pre}.status.bin", self._norm_status(st)),
                request=self._write(
                    f"{pre}.request.bin", req.SerializeToString(deterministic=True)
                ),
                stream="",
            )
            call = self.channels[r].unary_stream(
                wire.GET_DELTA_METHOD,
                request_serializer=pb.GetDeltaRequest.SerializeToString,
                response_deserializer=None,
            )
            msgs = list(call(req, timeout=30))
            trailer = pb.GetDeltaResponse.FromString(msgs[-1]).trailer
            real_cursors.append(pb.Cursor())
            real_cursors[-1].CopyFrom(trailer.cursor)
            if cut_after is not None:
                h = pb.GetDeltaResponse.FromString(msgs[0]).header
                again = pb.GetDeltaRequest()
                again.CopyFrom(req)
                again.max_step = h.to_step
                again.resume.generation, again.resume.to_seq = h.generation, h.to_seq
                again.resume.from_seq, again.resume.messages = h.from_seq, cut_after
                resumed = list(call(again, timeout=30))
                hr = pb.GetDeltaResponse.FromString(resumed[0]).header
                assert hr.resumed_messages == cut_after, "the sidecar did not resume"
                assert len(resumed) == len(msgs) - cut_after
                real_cursors[-1].CopyFrom(
                    pb.GetDeltaResponse.FromString(resumed[-1]).trailer.cursor
                )
                rec.cut_after = cut_after
                rec.resumed_request = self._write(
                    f"{pre}.resumed.request.bin", again.SerializeToString(deterministic=True)
                )
                resumed = self._norm_stream(resumed)
                vf.write_stream(self.dir / f"{pre}.resumed.stream.bin", resumed)
                rec.resumed_stream = f"{pre}.resumed.stream.bin"
            msgs = self._norm_stream(msgs)
            if forge is not None:
                msgs = forge(msgs)
            vf.write_stream(self.dir / f"{pre}.stream.bin", msgs)
            rec.stream = f"{pre}.stream.bin"
            rec.refuse_first_ms = refuse_first_ms
            recs.append(rec)
            try:
                windows.append(ref.decode(msgs))
            except ref.Refused as e:
                if outcome != "refused":
                    raise
                undecodable = f"rank {r}: {e}"
        summary: dict[str, Any] = {"outcome": outcome, "note": note, "ranks": []}
        try:
            if outcome == "ids":
                raise _Skip
            if len(windows) != self.world:
                raise ref.Refused(undecodable)
            new = ref.apply(self.state, windows)
        except _Skip:
            pass
        except ref.Refused as e:
            if outcome != "refused":
                raise
            summary["refused_because"] = str(e)
        else:
            if outcome == "refused":
                raise RuntimeError(f"{self.name}: pull {k} should be refused by the reference")
            self.state = new
        for r, (rec, w) in enumerate(zip(recs, windows, strict=False)):
            if outcome in ("applied", "ids"):
                resp = self.stubs[r].Commit(
                    pb.CommitRequest(consumer=self.name, cursor=real_cursors[r]), timeout=10
                )
                self._cursor(resp.committed)
                rec.commit = self._write(
                    f"rank{r}/pull{k}.commit.bin", resp.SerializeToString(deterministic=True)
                )
                self.committed[r] = w.trailer.cursor
            summary["ranks"].append(_window_summary(w))
        for r, rec in enumerate(recs):
            self.manifest["ranks"][r]["pulls"].append(rec.to_json())
        self.manifest["pulls"].append(summary)
        if outcome in ("applied", "ids") and any(w.header.resync for w in windows):
            self.first = False
        return windows

    def finish(self, truth: Callable[[ref.State], None] | None = None) -> None:
        """Check the state against the trainer's truth, write it and the manifest."""
        if truth is not None:
            truth(self.state)
        exp: dict[str, Any] = {"tables": [], "slots": [], "dense": [], "cursors": []}
        for name in sorted(self.state.tables):
            exp["tables"].append(
                vf.array_entry(
                    self.dir, f"expected/tables/{name}.bin", self.state.tables[name], name=name
                )
            )
        for name in sorted(self.state.slots):
            exp["slots"].append(
                vf.array_entry(
                    self.dir, f"expected/slots/{name}.bin", self.state.slots[name], name=name
                )
            )
        for i, name in enumerate(sorted(self.state.dense)):
            dt, shape, data = self.state.dense[name]
            arr = np.frombuffer(data, dtype=np.dtype(ref.DENSE_DTYPES[dt]).newbyteorder("<"))
            entry = vf.array_entry(
                self.dir, f"expected/dense/{i}.bin", arr.reshape(shape), name=name
            )
            entry["dtype"] = dt
            exp["dense"].append(entry)
        if self.state.dense_step is not None:
            exp["dense_step"] = self.state.dense_step
        for r in range(self.world):
            c = self.committed.get(r)
            exp["cursors"].append(None if c is None else _cursor_json(c))
        self.manifest["expected"] = exp
        vf.write_manifest(self.dir, self.manifest)


class _Skip(Exception):
    """A FORM_IDS pull: nothing to apply."""


def _cursor_json(c: pb.Cursor) -> dict[str, Any]:
    return {
        "consumer": c.consumer, "rank": c.rank, "generation": c.generation, "seq": c.seq,
        "step": c.step, "pull_id": c.pull_id,
    }  # fmt: skip


def _window_summary(w: ref.Window) -> dict[str, Any]:
    h = w.header
    out: dict[str, Any] = {
        "rank": h.rank, "generation": h.generation, "resync": h.resync, "from_seq": h.from_seq,
        "to_seq": h.to_seq, "to_step": h.to_step, "rows": sum(s.meta.count for s in w.slices),
        "cursor": _cursor_json(w.trailer.cursor),
    }  # fmt: skip
    if h.HasField("diff_from_generation"):
        out["diff_from_generation"] = h.diff_from_generation
    if h.HasField("rollback_to_step"):
        out["rollback_to_step"] = h.rollback_to_step
    if h.form == pb.FORM_IDS:
        out["ids"] = {}
        for s in w.slices:
            e = out["ids"].setdefault(s.meta.table, {"ids": []})
            e["ids"] += s.cat(s.ids, np.int64).tolist()
            if s.meta.identities:
                e["admitted"] = s.cat(s.admitted, np.int64).tolist()
                e["evicted"] = s.cat(s.evicted, np.int64).tolist()
    if h.form == pb.FORM_TOPK:
        out["owed"] = {s.meta.table: s.meta.owed for s in w.slices}
    return out


# ---- truth checks ------------------------------------------------------------------------------


def truth_float(
    tables: dict[str, torch.Tensor], dtype: WireDtype = WireDtype.FP32
) -> Callable[[ref.State], None]:
    def check(state: ref.State) -> None:
        for n, t in tables.items():
            got = torch.from_numpy(state.tables[n])
            if dtype is WireDtype.INT8:
                bound = wire.int8_error_bound(t) * (1 + 1e-5) + 1e-7
                assert bool(((got - t).abs().amax(dim=1) <= bound).all()), n
                continue
            want = wire.dequantize(*wire.quantize(t, dtype), dtype)
            assert torch.equal(got, want), f"table {n} differs from the trainer's"

    return check


def truth_packed(tables: dict[str, torch.Tensor], dtype: WireDtype) -> Callable[[ref.State], None]:
    def check(state: ref.State) -> None:
        for n, t in tables.items():
            want = torch.zeros(
                t.shape[0], wire.packed_row_bytes(t.shape[1], dtype, 16), dtype=torch.uint8
            )
            wire.pack_rows(t, dtype, want)
            assert torch.equal(torch.from_numpy(state.tables[n]), want), f"packed {n} differs"

    return check


def truth_mc(z: ZchWriter) -> Callable[[ref.State], None]:
    def check(state: ref.State) -> None:
        truth_float(z.truth)(state)
        for n, raw in z.raw.items():
            assert np.array_equal(state.slots[n], raw.numpy()), f"slot map {n} differs"

    return check


# ---- hostile forgeries of a recorded (valid) delta stream --------------------------------------


def _edit(msgs: list[bytes], fn: Callable[[pb.GetDeltaResponse], bool]) -> list[bytes]:
    """``msgs`` with the first message ``fn`` changes (returns True for) re-serialized."""
    out = list(msgs)
    for i, raw in enumerate(out):
        m = pb.GetDeltaResponse.FromString(raw)
        if fn(m):
            out[i] = m.SerializeToString(deterministic=True)
            return out
    raise RuntimeError("nothing to forge")


def _mc_chunk(msgs: list[bytes]) -> int:
    h = pb.GetDeltaResponse.FromString(msgs[0]).header
    return next(i for i, s in enumerate(h.slices) if s.identities)


def _held(raw_ids: bytes) -> list[int]:
    ids = np.frombuffer(raw_ids, dtype="<i8")
    return [i for i, x in enumerate(ids.tolist()) if x != ref.EMPTY_RAW_ID]


def forge_dup(msgs: list[bytes]) -> list[bytes]:
    """Two slots of the window hold one raw id."""
    sl = _mc_chunk(msgs)

    def fn(m: pb.GetDeltaResponse) -> bool:
        if m.WhichOneof("msg") != "chunk" or m.chunk.slice != sl or len(_held(m.chunk.raw_ids)) < 2:
            return False
        a, b = _held(m.chunk.raw_ids)[:2]
        raw = np.frombuffer(m.chunk.raw_ids, dtype="<i8").copy()
        raw[b] = raw[a]
        m.chunk.raw_ids = raw.tobytes()
        return True

    return _edit(msgs, fn)


def forge_negative(msgs: list[bytes]) -> list[bytes]:
    """A slot holds a negative raw id."""
    sl = _mc_chunk(msgs)

    def fn(m: pb.GetDeltaResponse) -> bool:
        if m.WhichOneof("msg") != "chunk" or m.chunk.slice != sl or not m.chunk.count:
            return False
        raw = np.frombuffer(m.chunk.raw_ids, dtype="<i8").copy()
        raw[0] = -5
        m.chunk.raw_ids = raw.tobytes()
        return True

    return _edit(msgs, fn)


def forge_evicted_held(msgs: list[bytes]) -> list[bytes]:
    """The window says a raw id was evicted and gives it to one of its slots."""
    sl = _mc_chunk(msgs)
    chunk = next(
        pb.GetDeltaResponse.FromString(r).chunk
        for r in msgs
        if pb.GetDeltaResponse.FromString(r).WhichOneof("msg") == "chunk"
        and pb.GetDeltaResponse.FromString(r).chunk.slice == sl
        and _held(pb.GetDeltaResponse.FromString(r).chunk.raw_ids)
    )
    held = int(np.frombuffer(chunk.raw_ids, dtype="<i8")[_held(chunk.raw_ids)[0]])

    def header(m: pb.GetDeltaResponse) -> bool:
        if m.WhichOneof("msg") != "header":
            return False
        m.header.slices[sl].evicted_count += 1
        return True

    def body(m: pb.GetDeltaResponse) -> bool:
        if m.WhichOneof("msg") != "chunk" or m.chunk.slice != sl:
            return False
        ev = np.frombuffer(m.chunk.evicted, dtype="<i8").tolist()
        m.chunk.evicted = np.array(sorted([*ev, held]), dtype="<i8").tobytes()
        return True

    return _edit(_edit(msgs, header), body)


def forge_truncated(msgs: list[bytes]) -> list[bytes]:
    """The stream ends (OK) after its first row chunk: no more chunks, no trailer."""
    return msgs[:2]


def forge_shape(msgs: list[bytes]) -> list[bytes]:
    """The delta says its first table has twice the rows the consumer holds."""

    def fn(m: pb.GetDeltaResponse) -> bool:
        if m.WhichOneof("msg") != "header":
            return False
        m.header.slices[0].num_rows *= 2
        return True

    return _edit(msgs, fn)


def _first_chunk(msgs: list[bytes], fn: Callable[[pb.RowChunk], None]) -> list[bytes]:
    def edit(m: pb.GetDeltaResponse) -> bool:
        if m.WhichOneof("msg") != "chunk" or not m.chunk.count:
            return False
        fn(m.chunk)
        return True

    return _edit(msgs, edit)


def forge_short_values(msgs: list[bytes]) -> list[bytes]:
    """A chunk's values are 4 bytes short of count x width."""

    def fn(c: pb.RowChunk) -> None:
        c.values = c.values[:-4]

    return _first_chunk(msgs, fn)


def forge_row_out_of_range(msgs: list[bytes]) -> list[bytes]:
    """A chunk names a row past its table's num_rows."""
    h = pb.GetDeltaResponse.FromString(msgs[0]).header

    def fn(c: pb.RowChunk) -> None:
        ids = np.frombuffer(c.ids, dtype="<i8").copy()
        ids[0] = h.slices[c.slice].num_rows + 5
        c.ids = ids.tobytes()

    return _first_chunk(msgs, fn)


def forge_row_bytes(msgs: list[bytes]) -> list[bytes]:
    """A packed slice says its rows are 16 bytes longer than its dtype and dim make them (and
    its chunks carry rows that long)."""

    def header(m: pb.GetDeltaResponse) -> bool:
        if m.WhichOneof("msg") != "header":
            return False
        m.header.slices[0].row_bytes += 16
        return True

    out = _edit(msgs, header)
    h = pb.GetDeltaResponse.FromString(out[0]).header
    rb = h.slices[0].row_bytes
    for i, raw in enumerate(out):
        m = pb.GetDeltaResponse.FromString(raw)
        if m.WhichOneof("msg") == "chunk" and m.chunk.slice == 0 and m.chunk.count:
            rows = np.frombuffer(m.chunk.values, dtype=np.uint8).reshape(m.chunk.count, -1)
            pad = np.zeros((m.chunk.count, rb - rows.shape[1]), dtype=np.uint8)
            m.chunk.values = np.concatenate([rows, pad], axis=1).tobytes()
            out[i] = m.SerializeToString(deterministic=True)
    return out


# ---- the scenarios -----------------------------------------------------------------------------

SHAPES = {"t0": (64, 8), "t1": (40, 4)}
PACKED_SHAPES = {"t0": (64, 8), "t1": (40, 16)}


def _trainer(
    spool: Path, world: int, shapes: dict[str, tuple[int, int]] = SHAPES, seed: int = 0
) -> FakeTrainer:
    ft = FakeTrainer(spool, model=MODEL, world_size=world, tables=shapes, seed=seed)
    ft.start(0)
    ft.step(10, touch=6)
    return ft


def rows(out: Path, url: str, tmp: Path, name: str, dtype: int, world: int) -> None:
    wd = wire.dtype_from_pb(dtype)
    ft = _trainer(tmp / name, world)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        f"FORM_ROWS in {pb.WireDtype.Name(dtype)}, {world} rank(s): a base then a delta",
        world,
        dtype=dtype,
    )
    try:
        rec.pull(10, note="base (resync)")
        ft.step(20, touch=5)
        rec.pull(20, note="delta")
        rec.finish(truth_float(ft.history[20], wd))
    finally:
        rec.close()


def packed(out: Path, url: str, tmp: Path, name: str, dtype: int) -> None:
    wd = wire.dtype_from_pb(dtype)
    ft = _trainer(tmp / name, 1, PACKED_SHAPES)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        f"FORM_ROWS in {pb.WireDtype.Name(dtype)} (row_alignment 16): a base then a delta",
        1,
        dtype=dtype,
    )
    try:
        rec.pull(10, note="base (resync)")
        ft.step(20, touch=5)
        rec.pull(20, note="delta")
        rec.finish(truth_packed(ft.history[20], wd))
    finally:
        rec.close()


def ids(out: Path, url: str, tmp: Path) -> None:
    name = "ids"
    ft = _trainer(tmp / name, 1)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        "FORM_IDS: the base's ids, then a delta's ids (no values: nothing to apply)",
        1,
        form=pb.FORM_IDS,
    )
    try:
        rec.pull(10, outcome="ids", note="base ids")
        ft.step(20, touch=5)
        rec.pull(20, outcome="ids", note="delta ids")
        rec.finish()
    finally:
        rec.close()


def topk(out: Path, url: str, tmp: Path) -> None:
    name = "topk"
    ft = _trainer(tmp / name, 1)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        "FORM_TOPK k=3: a base (complete), a delta of 8 rows a table (3 sent, 5 owed), then owed + new rows",
        1,
        form=pb.FORM_TOPK,
        k=3,
    )
    try:
        rec.pull(10, note="base (complete whatever k)")
        ft.step(20, touch=8)
        rec.pull(20, note="top 3 of 8; 5 owed")
        ft.step(30, touch=2)
        rec.pull(30, note="top 3 of owed + new")
        rec.finish()
    finally:
        rec.close()


def mc(out: Path, url: str, tmp: Path, name: str, form: int) -> None:
    z = ZchWriter(tmp / name, model=MODEL, mc={"zch": (64, 8)}, tables={"t0": (40, 4)}, seed=3)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        f"managed-collision table zch (identities) beside t0, {pb.Form.Name(form)}: a base then two deltas with admissions, evictions and emptied slots",
        1,
        form=form,
        strict_identities=True,
    )
    outcome = "ids" if form == pb.FORM_IDS else "applied"
    try:
        rec.pull(0, outcome=outcome, note="base (resync) with every slot's raw id")
        z.delta(n=4)
        rec.pull(10, outcome=outcome, note="admissions, evictions")
        z.delta(n=3, admit={"zch": {60: 7}})  # raw id 7 (slot 0's) moves to slot 60
        rec.pull(20, outcome=outcome, note="a raw id moves to another slot")
        rec.finish(truth_mc(z) if form != pb.FORM_IDS else None)
    finally:
        rec.close()


def hostile_mc(out: Path, url: str, tmp: Path, name: str, forge: Forge, why: str) -> None:
    z = ZchWriter(tmp / name, model=MODEL, mc={"zch": (64, 8)}, tables={"t0": (40, 4)}, seed=5)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        f"hostile: {why}; must be refused, nothing of it applied",
        1,
        strict_identities=True,
    )
    try:
        rec.pull(0, note="base (resync)")
        z.delta(n=4)
        rec.pull(10, outcome="refused", forge=forge, note=why)
        rec.finish()
    finally:
        rec.close()


def hostile_rows(
    out: Path,
    url: str,
    tmp: Path,
    name: str,
    forge: Forge,
    why: str,
    dtype: int = pb.WIRE_DTYPE_FP32,
) -> None:
    ft = _trainer(tmp / name, 1, PACKED_SHAPES if dtype != pb.WIRE_DTYPE_FP32 else SHAPES)
    rec = Recorder(
        out, url, tmp / name, name, f"hostile: {why}; must be refused, nothing of it applied", 1,
        dtype=dtype,
    )  # fmt: skip
    try:
        rec.pull(10, note="base (resync)")
        ft.step(20, touch=5)
        rec.pull(20, outcome="refused", forge=forge, note=why)
        if dtype == pb.WIRE_DTYPE_FP32:
            rec.finish(truth_float(ft.history[10]))
        else:
            rec.finish(truth_packed(ft.history[10], wire.dtype_from_pb(dtype)))
    finally:
        rec.close()


def gendiff(out: Path, url: str, tmp: Path) -> None:
    name = "generation-diff"
    ft = _trainer(tmp / name, 2)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        "2 ranks at generation 1 step 10; the trainer restarts as generation 2 (5% of rows changed, step 100, then 110): a generation diff applied in place",
        2,
    )
    try:
        rec.pull(10, note="base (resync)")
        new = FakeTrainer(
            tmp / name, model=MODEL, world_size=2, generation=2, tables=SHAPES, seed=11
        )
        new.tables = {n: t.clone() for n, t in ft.tables.items()}
        for t in new.tables.values():
            t[torch.randperm(t.shape[0], generator=new.gen)[: max(1, t.shape[0] // 20)]] += 1.0
        new.start(100)
        new.step(110, touch=4)
        rec.pull(110, generation=2, note="generation diff (diff_from_generation 1)")
        rec.finish(truth_float(new.history[110]))
    finally:
        rec.close()


def rollback(out: Path, url: str, tmp: Path) -> None:
    import redis as redis_lib

    from deltad.serve import rollout as ro
    from deltad.serve.state.release import RolloutStore

    name = "rollback"
    ft = _trainer(tmp / name, 1)
    ft.step(20, touch=5)
    ft.step(30, touch=5)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        "at step 30, an operator rolls back to step 10: a rollback window applied in place, the cursor moves back",
        1,
        server={"restore_window_steps": 1000},
    )
    try:
        rec.pull(30, note="base (resync) at step 30")
        client = redis_lib.Redis.from_url(url)
        RolloutStore(client, MODEL).update(lambda st: ro.rollback(st, 10, "*", head_step=None))
        client.close()
        rec.pull(30, cap=10, note="rollback to step 10")
        rec.finish(truth_float(ft.history[10]))
    finally:
        rec.close()


def resumed(out: Path, url: str, tmp: Path) -> None:
    name = "resumed-stream"
    ft = _trainer(tmp / name, 1)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        "the base's stream breaks (UNAVAILABLE) after 1 message after its header; the retry asks to resume and gets the rest",
        1,
    )
    try:
        rec.pull(10, cut_after=1, note="base, cut and resumed")
        ft.step(20, touch=5)
        rec.pull(20, note="delta")
        rec.finish(truth_float(ft.history[20]))
    finally:
        rec.close()


def overload(out: Path, url: str, tmp: Path) -> None:
    name = "overload-retry"
    ft = _trainer(tmp / name, 1)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        "the first GetDelta is refused RESOURCE_EXHAUSTED with deltad-retry-after-ms 50; the retry is served",
        1,
    )
    try:
        rec.pull(10, refuse_first_ms=50, note="base, after one refusal")
        rec.finish(truth_float(ft.history[10]))
    finally:
        rec.close()


def dense(out: Path, url: str, tmp: Path) -> None:
    name = "dense"
    spool = tmp / name
    ft = FakeTrainer(spool, model=MODEL, world_size=1, tables=SHAPES, seed=7)
    g = torch.Generator().manual_seed(9)

    def publish(step: int) -> None:
        tensors = {
            "over.0.weight": torch.randn(3, 5, generator=g),
            "over.0.bias": torch.randn(3, generator=g).half(),
            "bn.num_batches_tracked": torch.tensor(step, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
        }
        seq = ft.seq[0] + 1
        data = encode_dense(model=MODEL, generation=1, rank=0, seq=seq, step=step, tensors=tensors)
        write_dense(ft.layout.dense_path(1, 0, seq), data, fsync=False)

    publish(0)
    ft.start(0)
    publish(10)
    ft.step(10, touch=6)
    rec = Recorder(
        out,
        url,
        tmp / name,
        name,
        "with_dense: rank 0's dense state (float32, float16, int64, bool tensors) with the base, then a newer one with a delta",
        1,
        with_dense=True,
    )
    try:
        rec.pull(10, note="base + dense state of step 10")
        publish(20)
        ft.step(20, touch=5)
        rec.pull(20, note="delta + dense state of step 20")
        rec.finish(truth_float(ft.history[20]))
    finally:
        rec.close()


def column_shards(out: Path, url: str, tmp: Path) -> None:
    from serverkit import SpoolWriter

    name = "packed-int8-column-shards"
    sw = SpoolWriter(tmp / name, tables={"t0": (64, 8), "t1": (40, 16)}, col_split=2, seed=13)
    rec = Recorder(
        out, url, tmp / name, name,
        "PACKED_INT8 asked of column-wise shards (two column halves of each table on one rank): "
        "they cannot be packed and travel as fp32 slices (TableSlice.dtype = WIRE_DTYPE_FP32, "
        "row_bytes 0); a base then a delta",
        1, dtype=pb.WIRE_DTYPE_PACKED_INT8,
    )  # fmt: skip
    try:
        rec.pull(0, note="base (resync), fp32 column slices")
        sw.delta(n=5)
        rec.pull(10, note="delta, fp32 column slices")
        rec.finish(truth_float(sw.truth))
    finally:
        rec.close()


def scenarios() -> dict[str, Callable[[Path, str, Path], None]]:
    out: dict[str, Callable[[Path, str, Path], None]] = {
        "rows-fp32": lambda o, u, t: rows(o, u, t, "rows-fp32", pb.WIRE_DTYPE_FP32, 2),
        "rows-fp16": lambda o, u, t: rows(o, u, t, "rows-fp16", pb.WIRE_DTYPE_FP16, 1),
        "rows-bf16": lambda o, u, t: rows(o, u, t, "rows-bf16", pb.WIRE_DTYPE_BF16, 1),
        "rows-int8": lambda o, u, t: rows(o, u, t, "rows-int8", pb.WIRE_DTYPE_INT8, 1),
        "packed-int8": lambda o, u, t: packed(o, u, t, "packed-int8", pb.WIRE_DTYPE_PACKED_INT8),
        "packed-int4": lambda o, u, t: packed(o, u, t, "packed-int4", pb.WIRE_DTYPE_PACKED_INT4),
        "packed-fp16": lambda o, u, t: packed(o, u, t, "packed-fp16", pb.WIRE_DTYPE_PACKED_FP16),
        "packed-int8-column-shards": column_shards,
        "ids": ids,
        "topk": topk,
        "mc-rows": lambda o, u, t: mc(o, u, t, "mc-rows", pb.FORM_ROWS),
        "mc-ids": lambda o, u, t: mc(o, u, t, "mc-ids", pb.FORM_IDS),
        "generation-diff": gendiff,
        "rollback": rollback,
        "resumed-stream": resumed,
        "overload-retry": overload,
        "dense": dense,
    }
    for name, (forge, why) in _HOSTILE_MC.items():
        out[name] = functools.partial(hostile_mc, name=name, forge=forge, why=why)
    for name, (forge, why, dtype) in _HOSTILE_ROWS.items():
        out[name] = functools.partial(hostile_rows, name=name, forge=forge, why=why, dtype=dtype)
    return out


# The hostile vectors: name -> (forge, why[, wire dtype]); each must be refused.
_HOSTILE_MC: dict[str, tuple[Forge, str]] = {
    "hostile-mc-duplicate": (forge_dup, "one raw id held by two slots of the window"),
    "hostile-mc-evicted-held": (forge_evicted_held, "a raw id both evicted and held by a slot"),
    "hostile-mc-negative": (forge_negative, "a negative raw id"),
}
_HOSTILE_ROWS: dict[str, tuple[Forge, str, int]] = {
    "hostile-truncated": (
        forge_truncated,
        "a stream that ends (OK) without its trailer",
        pb.WIRE_DTYPE_FP32,
    ),
    "hostile-shape": (
        forge_shape,
        "a delta whose table has another shape than the one held",
        pb.WIRE_DTYPE_FP32,
    ),
    "hostile-short-values": (
        forge_short_values,
        "a row chunk whose values are 4 bytes short of count x width",
        pb.WIRE_DTYPE_FP32,
    ),
    "hostile-row-out-of-range": (
        forge_row_out_of_range,
        "a row id past its table's num_rows",
        pb.WIRE_DTYPE_FP32,
    ),
    "hostile-packed-row-bytes": (
        forge_row_bytes,
        "a packed int8 slice whose row_bytes is not its dtype's and dim's",
        pb.WIRE_DTYPE_PACKED_INT8,
    ),
}


def record(out: Path, only: list[str] | None = None) -> list[str]:
    """Record the vectors (all, or ``only``) into ``out``; their names."""
    todo = scenarios()
    names = only or list(todo)
    unknown = [n for n in names if n not in todo]
    if unknown:
        raise SystemExit(f"record_vectors: unknown vector(s) {unknown}; known: {sorted(todo)}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deltad-vectors-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        server.start()
        try:
            import redis as redis_lib

            for n in names:  # each vector on an empty Redis (release states are per model)
                client = redis_lib.Redis.from_url(server.url)
                keys = list(client.scan_iter(count=1000))
                if keys:
                    client.unlink(*keys)
                client.close()
                todo[n](out, server.url, Path(tmp))
        finally:
            server.stop(kill=True)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--only", nargs="*", default=None, help="vector names (default: all)")
    args = p.parse_args(argv)
    names = record(args.out, args.only)
    total = sum(f.stat().st_size for n in names for f in (args.out / n).rglob("*") if f.is_file())
    print(f"recorded {len(names)} vectors into {args.out} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
