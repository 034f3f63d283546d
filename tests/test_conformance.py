"""Conformance vectors (docs/conformance.md): the Python client, replaying every recorded vector
through the replay server (deltad.conformance.replay, real gRPC), reaches exactly the state the
vector expects (tables bit-exact, packed rows byte-exact in a quantized TorchRec model, slot ->
raw id maps, dense tensors, committed cursors); a hostile vector is refused with nothing
applied or committed. And the vectors are what the current code records: a wire change that
alters them fails here, with the command that re-records them."""

from __future__ import annotations

import filecmp
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltad import wire
from deltad.config import ConsumerConfig, PullOptions
from deltad.conformance import reference as ref
from deltad.conformance import vectors as vf
from deltad.conformance.replay import ReplayServer
from deltad.consume.appliers import Applier, TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.errors import ConsumerError
from deltad.v1 import delta_pb2 as pb

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "tests" / "vectors"
ALL = vf.load_all(VECTORS)
#: the vectors also replayed into a quantized TorchRec model (QuantApplier): serving dtype
QUANT = {
    "rows-fp32": "int8",
    "packed-int8": "int8",
    "packed-int4": "int4",
    "packed-fp16": "fp16",
    "packed-int8-column-shards": "int8",
    "hostile-packed-row-bytes": "int8",
}


@pytest.fixture(scope="module")
def replay() -> Iterator[ReplayServer]:
    with ReplayServer(VECTORS) as srv:
        yield srv


def consumer(v: vf.Vector, srv: ReplayServer, **auth: Any) -> DeltaConsumer:
    req = v.manifest["request"]
    form = wire.form_from_pb(pb.Form.Value(req["form"]))
    dtype = wire.dtype_from_pb(pb.WireDtype.Value(req["dtype"]))
    opts = PullOptions(form=form, k=req["k"], wire_dtype=dtype, dense=req["with_dense"])
    return DeltaConsumer(
        ConsumerConfig(
            v.name,
            model=v.manifest["model"],
            sidecars=tuple(srv.endpoints[: v.world_size]),
            pull=opts,
            rpc_deadline_s=10.0,
            max_retries=3,
            backoff_initial_s=0.01,
            backoff_max_s=0.05,
            heartbeat_interval_s=5.0,
            reuse_buffers_bytes=0,
            **auth,
        )
    ).connect()


def quant_applier(v: vf.Vector, serve: str) -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from deltad.consume.quant import QuantApplier, quantize_model

    shapes = {e["name"]: e for e in v.manifest["expected"]["tables"]}
    first = v.manifest["pulls"][0]["ranks"]  # (shapes from the expected tables' rows)
    assert first
    dims = {}
    for name, e in shapes.items():
        rows = e["shape"][0]
        dims[name] = (rows, _dim_of(v, name))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"]
                    )
                    for n, (r, d) in dims.items()
                ],
                device=torch.device("cpu"),
            )

    torch.manual_seed(0)
    return QuantApplier(quantize_model(Model().eval(), serve))


def _dim_of(v: vf.Vector, table: str) -> int:
    h = pb.GetDeltaResponse.FromString(v.stream(v.ranks[0].pulls[0].stream)[0]).header
    return next(int(s.dim) for s in h.slices if s.table == table)


def held_tables(applier: Applier) -> dict[str, torch.Tensor]:
    """What the applier serves: float tables, or a quantized model's row bytes."""
    if isinstance(applier, TensorDictApplier):
        return {n: t.clone() for n, t in applier.tables().items()}
    return {n: t.rows.clone() for n, t in applier.quant_tables.items()}


def held_slots(applier: Applier) -> dict[str, torch.Tensor]:
    return {n: m.slot_raw.clone() for n, m in applier.slot_maps().items()}


def expected(v: vf.Vector, kind: str) -> dict[str, np.ndarray]:
    return {e["name"]: vf.read_array(v.root, e) for e in v.manifest["expected"][kind]}


def run(
    v: vf.Vector, srv: ReplayServer, applier: Applier, **auth: Any
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Replay ``v`` into ``applier`` as a predictor would; (pull results, dense state held)."""
    srv.replayer.reset(v.name)
    applier.strict_identities = bool(v.manifest["strict_identities"]) or applier.strict_identities
    results: list[Any] = []
    dense: dict[str, torch.Tensor] = {}
    with consumer(v, srv, **auth) as c:
        for i, want in enumerate(v.manifest["pulls"]):
            if want["outcome"] == "refused":
                before = (held_tables(applier), held_slots(applier))
                commits = [len(srv.replayer.commits(v.name, r)) for r in range(v.world_size)]
                refused = False
                res = c.pull(applier=applier)
                if res.deltas and not res.missing:
                    with pytest.raises(ConsumerError):
                        applier.apply(res.deltas)
                    refused = True
                else:  # a stream the client cannot decode: the rank is reported missing
                    refused = bool(res.missing) and not res.deltas
                assert refused, f"{v.name} pull {i}: not refused"
                after = (held_tables(applier), held_slots(applier))
                for a, b in zip(before, after, strict=True):
                    assert a.keys() == b.keys()
                    assert all(torch.equal(a[n], b[n]) for n in a), f"{v.name}: state changed"
                for r in range(v.world_size):
                    assert len(srv.replayer.commits(v.name, r)) == commits[r], (
                        "refused but committed"
                    )
                results.append(res)
                continue
            res = c.pull(applier=applier if want["outcome"] == "applied" else None)
            assert not res.missing, (v.name, i, res.missing)
            got = sorted(res.deltas, key=lambda d: d.rank)
            assert len(got) == len(want["ranks"])
            for d, w in zip(got, want["ranks"], strict=True):
                assert (d.rank, d.generation, d.resync, d.from_seq, d.to_seq, d.to_step) == (
                    w["rank"], w["generation"], w["resync"], w["from_seq"], w["to_seq"],
                    w["to_step"],
                ), (v.name, i)  # fmt: skip
                assert d.rows == w["rows"]
                assert d.generation_diff == w.get("diff_from_generation")
                assert d.rollback_to == w.get("rollback_to_step")
                if "owed" in w:
                    assert {s.shard.table: s.owed for s in d.shards if s.owed} == {
                        t: o for t, o in w["owed"].items() if o
                    }
                if "ids" in w:
                    ids: dict[str, list[int]] = {}
                    for s in d.shards:
                        ids.setdefault(s.shard.table, []).extend(s.ids.tolist())
                        if s.evicted_raw_ids is not None and s.evicted_raw_ids.numel():
                            assert s.evicted_raw_ids.tolist() == w["ids"][s.shard.table]["evicted"]
                        if s.admitted_raw_ids is not None and s.admitted_raw_ids.numel():
                            assert (
                                s.admitted_raw_ids.tolist() == w["ids"][s.shard.table]["admitted"]
                            )
                    assert ids == {t: e["ids"] for t, e in w["ids"].items()}
            if want["outcome"] == "applied":
                applier.apply(res.deltas)
                dense.update(res.dense)
            assert sorted(c.commit(res)) == [w["rank"] for w in want["ranks"]]
            results.append(res)
    return results, dense


def check_state(
    v: vf.Vector, srv: ReplayServer, applier: Applier, dense: dict[str, torch.Tensor]
) -> None:
    exp = v.manifest["expected"]
    tables = expected(v, "tables")
    held = held_tables(applier)
    if isinstance(applier, TensorDictApplier):
        assert held.keys() == tables.keys()
        for n, want in tables.items():
            assert np.array_equal(held[n].numpy().view(np.uint8), want.view(np.uint8)), n
    else:
        for n, want in tables.items():
            if want.dtype == np.uint8:  # packed rows as the vector carried them
                assert torch.equal(held[n], torch.from_numpy(want)), n
            else:  # float rows the applier packed: as torchrec quantizes them
                q = applier.quant_tables[n]
                assert torch.equal(held[n], q.pack(torch.from_numpy(want))), n
    slots = expected(v, "slots")
    assert {n: m.numpy().tolist() for n, m in held_slots(applier).items()} == {
        n: s.tolist() for n, s in slots.items()
    }
    want_dense = {e["name"]: e for e in exp["dense"]}
    assert dense.keys() == want_dense.keys()
    for n, e in want_dense.items():
        got = dense[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert vf.sha256(got) == e["sha256"], n
    for r, c in enumerate(exp["cursors"]):
        commits = srv.replayer.commits(v.name, r)
        assert commits, f"{v.name} rank {r}: nothing committed"
        last = commits[-1]
        assert {f: getattr(last, f) for f in c} == c, (v.name, r)


@pytest.mark.parametrize("name", sorted(ALL))
def test_the_python_client_reaches_each_vectors_state(name: str, replay: ReplayServer) -> None:
    """TensorDictApplier (packed vectors: a quantized model of the wire's layout) replaying
    ``name`` ends exactly in its expected state; hostile pulls are refused, nothing applied
    or committed."""
    v = ALL[name]
    packed = v.manifest["request"]["dtype"].startswith("WIRE_DTYPE_PACKED")
    applier: Applier = quant_applier(v, QUANT[name]) if packed else TensorDictApplier()
    _, dense = run(v, replay, applier)
    check_state(v, replay, applier, dense)
    if v.manifest["request"]["dtype"] == "WIRE_DTYPE_PACKED_INT4":
        log = replay.replayer.calls(v.name, "GetDelta")
        assert log and all(e["ok"] for e in log)


@pytest.mark.parametrize("name", ["rows-fp32"])
def test_the_quant_applier_reaches_the_torchrec_bytes_of_a_float_vector(
    name: str, replay: ReplayServer
) -> None:
    """fp32 rows of 2 ranks into an int8 quantized TorchRec model: its rows are torchrec's
    quantization of the expected tables."""
    v = ALL[name]
    applier = quant_applier(v, QUANT[name])
    _, dense = run(v, replay, applier)
    check_state(v, replay, applier, dense)


def test_the_replay_says_how_the_resumed_and_overloaded_vectors_were_served(
    replay: ReplayServer,
) -> None:
    """The resumed vector's first attempt was cut and the retry resumed (not restarted); the
    overloaded one was refused once with its retry-after hint, then served."""
    run(ALL["resumed-stream"], replay, TensorDictApplier())
    served = [e["served"] for e in replay.replayer.calls("resumed-stream", "GetDelta")]
    assert served[:2] == ["cut after 1", "resumed"], served
    run(ALL["overload-retry"], replay, TensorDictApplier())
    served = [e["served"] for e in replay.replayer.calls("overload-retry", "GetDelta")]
    assert served[-2:] == ["refused", "stream"], served


def test_the_reference_applier_agrees_with_every_vector() -> None:
    """The recorded streams, decoded and applied by deltad.conformance.reference (a second
    reading of the protocol), give each vector's expected state; hostile pulls are refused."""
    for v in ALL.values():
        state = ref.State()
        for k, want in enumerate(v.manifest["pulls"]):
            try:
                windows = [ref.decode(v.stream(rr.pulls[k].stream)) for rr in v.ranks]
                if want["outcome"] == "ids":
                    continue
                state = ref.apply(state, windows)
            except ref.Refused:
                assert want["outcome"] == "refused", (v.name, k)
            else:
                assert want["outcome"] != "refused", (v.name, k)
        for e in v.manifest["expected"]["tables"]:
            assert np.array_equal(state.tables[e["name"]], vf.read_array(v.root, e)), v.name
        for e in v.manifest["expected"]["slots"]:
            assert np.array_equal(state.slots[e["name"]], vf.read_array(v.root, e)), v.name


def test_the_vectors_are_what_the_current_code_records(tmp_path: Path) -> None:
    """Re-record every vector from real sidecars: the bytes equal the committed golden files."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import record_vectors

    record_vectors.record(tmp_path)
    cmd = f"cd {ROOT} && {record_vectors.RECORD_COMMAND}"
    differ: list[str] = []
    for name in ALL:
        cmp = filecmp.dircmp(VECTORS / name, tmp_path / name)
        stack = [cmp]
        while stack:
            d = stack.pop()
            differ += [f"{name}: {f}" for f in d.left_only + d.right_only + d.diff_files]
            stack += d.subdirs.values()
        for f in (tmp_path / name).rglob("*"):
            rel = f.relative_to(tmp_path / name)
            if f.is_file() and (VECTORS / name / rel).read_bytes() != f.read_bytes():
                differ.append(f"{name}/{rel}")
    new = sorted(p.name for p in tmp_path.iterdir() if p.name not in ALL)
    assert not differ and not new, (
        f"the wire changed: recorded vectors differ from tests/vectors ({sorted(set(differ))[:10]}"
        f"{', new: ' + str(new) if new else ''}). If the change is intended, re-record them "
        f"(`{cmd}`), review the diff, and tell the C++ client's owners."
    )


def test_the_replay_cli_prints_its_endpoints_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    """What the C++ client's tests run: `python -m deltad.conformance.replay --vectors DIR
    --port 0` prints one line with an endpoint per rank, answers as recorded, exits 0 on
    SIGTERM; a directory without vectors is one stderr line and exit 2."""
    import signal
    import subprocess

    import grpc

    from deltad.v1 import delta_pb2_grpc

    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "deltad.conformance.replay", "--vectors", str(VECTORS)]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", "--log", str(tmp_path / "calls.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:3] == ["replaying", str(len(ALL)), "vectors"] and line[3] == "on", line
        endpoints = line[4].split(",")
        assert len(endpoints) == max(v.world_size for v in ALL.values())
        with grpc.insecure_channel(endpoints[1]) as ch:
            st = delta_pb2_grpc.DeltaServiceStub(ch).Status(
                pb.StatusRequest(consumer="rows-fp32"), timeout=10
            )
            assert (st.model, st.rank, st.world_size) == ("m", 1, 2)
        with grpc.insecure_channel(endpoints[0]) as ch:
            stub = delta_pb2_grpc.DeltaServiceStub(ch)
            st = stub.Status(  # no consumer: the metadata names the vector
                pb.StatusRequest(), timeout=10, metadata=(("deltad-vector", "rows-fp16"),)
            )
            assert st.world_size == 1
            with pytest.raises(grpc.RpcError) as e:
                stub.Status(pb.StatusRequest(consumer="no-such-vector"), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert '"method": "Status"' in (tmp_path / "calls.jsonl").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    bad = subprocess.run(
        [*cmd[:-1], str(tmp_path / "none")], capture_output=True, text=True, env=env, timeout=60
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


def test_a_vector_replays_through_a_token_and_mtls_and_a_wrong_token_is_refused(
    pki: Path,
) -> None:
    """The replay server with ``--token`` and mTLS (what the C++ client's credential tests
    use): the Python client with the token, the CA and a client certificate reaches the
    vector's state; a wrong token is UNAUTHENTICATED, which the client does not retry."""
    v = ALL["rows-fp16"]
    a = pki / "a"
    srv = ReplayServer(
        VECTORS, host="localhost", token="s3cret", tls_cert=a / "server.pem",
        tls_key=a / "server.key", tls_client_ca=a / "ca.pem",
    )  # fmt: skip
    with srv:
        creds = {
            "token": "s3cret", "tls_ca": a / "ca.pem", "tls_cert": a / "client.pem",
            "tls_key": a / "client.key",
        }  # fmt: skip
        applier = TensorDictApplier()
        _, dense = run(v, srv, applier, **creds)
        check_state(v, srv, applier, dense)
        with pytest.raises(ConsumerError, match="UNAUTHENTICATED"):
            consumer(v, srv, **{**creds, "token": "wrong"})
        refused = srv.replayer.calls(v.name, "auth")
        assert refused and not any(e["ok"] for e in refused)


def test_a_long_poll_answers_at_once_when_the_next_pull_is_newer_and_is_held_at_the_end(
    replay: ReplayServer,
) -> None:
    """wait_for_new through the replay: after the base, the next recorded status is past what
    the client saw (True at once); after the last pull nothing is new: the Status is held for
    the wait and the answer is False."""
    import time

    v = ALL["rows-fp16"]
    replay.replayer.reset(v.name)
    applier = TensorDictApplier()
    with consumer(v, replay) as c:
        c.sync(applier)
        started = time.monotonic()
        assert c.wait_for_new(20.0)
        assert time.monotonic() - started < 10.0
        c.sync(applier)
        started = time.monotonic()
        assert not c.wait_for_new(0.6)
        assert time.monotonic() - started >= 0.5
    polls = [e for e in replay.replayer.calls(v.name, "Status") if e["wait_ms"]]
    assert [e["wait_ms"] for e in polls] == [20000, 600]
