"""The C++ predictor (``clients/cpp/``, ``deltad-predictor-cpp``) against real sidecars: it loads a
TorchScript artifact written by :mod:`deltad.consume.export`, bootstraps from deltad alone, follows,
answers forwards while it applies, and ends bit-exact with torchrec's quantization of the
trainer's final model (tables, managed-collision lookup buffers, dense weights, forward). A
window it cannot apply leaves it serving what it holds; bad input is one line and exit 2.

Skipped only where the binary was not built (``scripts/build_cpp.sh``) and
``DELTAD_REQUIRE_CPP`` is unset."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from spoolkit import ROOT, ZchWriter, wait_for
from torch import nn

from deltad.config import ServerConfig
from deltad.consume.export import artifact_state, export_torchscript, manifest_path
from deltad.mch import lookup_buffers
from deltad.serve.edge.app import SidecarServer
from deltad.types import EMPTY_RAW_ID, SegmentKind

BIN = ROOT / "build" / "cpp" / "deltad-predictor-cpp"
REQUIRED = os.environ.get("DELTAD_REQUIRE_CPP", "") not in ("", "0")


def _built_for() -> str | None:
    """The torch the binary was built against (scripts/build_cpp.sh notes it); None: none."""
    try:
        return (BIN.parent / "torch-version.txt").read_text().strip()
    except OSError:
        return None


pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not BIN.exists() and not REQUIRED,
        reason="deltad-predictor-cpp not built (scripts/build_cpp.sh)",
    ),
    pytest.mark.skipif(
        BIN.exists() and not REQUIRED and _built_for() != torch.__version__,
        reason=f"deltad-predictor-cpp was built against torch {_built_for()}, not this one",
    ),
]


@pytest.fixture(scope="module", autouse=True)
def _fbgemm_ops() -> None:
    """The artifacts' forwards need fbgemm's ops in this process too."""
    import fbgemm_gpu  # noqa: F401


@contextlib.contextmanager
def sidecar_servers(
    spool: Path, redis_url: str, world: int, model: str = "m", **kw: Any
) -> Iterator[list[SidecarServer]]:
    """One sidecar per rank of ``spool`` (``kw``: more :class:`ServerConfig` fields)."""
    servers: list[SidecarServer] = []
    kw.setdefault("listen", "127.0.0.1:0")
    try:
        for rank in range(world):
            cfg = ServerConfig(
                spool_dir=spool, model=model, rank=rank, redis_url=redis_url,
                poll_interval_s=0.02, grace_period_s=0.5, **kw,
            )  # fmt: skip
            servers.append(SidecarServer(cfg).start())
        yield servers
    finally:
        for s in servers:
            s.stop(0.5)


@contextlib.contextmanager
def sidecars(
    spool: Path, redis_url: str, world: int, model: str = "m", **kw: Any
) -> Iterator[list[str]]:
    """:func:`sidecar_servers`' endpoints."""
    with sidecar_servers(spool, redis_url, world, model, **kw) as servers:
        yield [s.endpoint for s in servers]


class Predictor:
    """A running deltad-predictor-cpp: its JSON lines and stderr, read as they come."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            [str(BIN), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream: Any, json_lines: bool) -> None:
        for line in stream:
            if json_lines:
                self.lines.append(json.loads(line))
            else:
                self.errors.append(line.rstrip("\n"))

    def pulls(self) -> list[dict[str, Any]]:
        return [x for x in self.lines if x.get("event") == "pull"]

    def applied(self) -> bool:
        """A window was applied."""
        return any(x["applied"] for x in self.pulls())

    def caught_up(self, step: int) -> bool:
        """The last pull applied nothing new at ``step``, owing nothing."""
        p = self.pulls()
        ok = [x for x in p if x["step"] == step and x["owed"] == 0]
        return bool(ok) and ok[-1]["rows"] == 0 and ok[-1] is p[-1]

    def stop(self, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout_s)
        for t in self._threads:
            t.join(timeout=5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def run_bad(*argv: str) -> tuple[int, list[str]]:
    """Run the binary to its end (bounded); (exit code, stderr lines)."""
    proc = subprocess.run(
        [str(BIN), *argv], capture_output=True, text=True, timeout=120, check=False
    )
    return proc.returncode, [x for x in proc.stderr.splitlines() if x.strip()]


# --- a small managed-collision model over a ZchWriter spool ------------------------------------

ZCH_SLOTS, ZCH_DIM, T0_ROWS, T0_DIM = 64, 8, 40, 4


class SmallModel(nn.Module):
    """ZchWriter's tables: ``t0`` (40 x 4, pooled) and the managed-collision ``zch`` (64 x 8)."""

    def __init__(self, slots: int = ZCH_SLOTS, rows: int = T0_ROWS) -> None:
        super().__init__()
        from deltad.reference.trainer.zch import mc_module
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        cfg = EmbeddingBagConfig(
            name="t0", embedding_dim=T0_DIM, num_embeddings=rows, feature_names=["f_t0"]
        )
        self.ebc = EmbeddingBagCollection(tables=[cfg])
        self.zch = mc_module("ebc", "zch", "f_zch", slots=slots, raw_ids=1 << 40, dim=ZCH_DIM)
        self.scale = nn.Parameter(torch.ones(T0_DIM + ZCH_DIM))

    def forward(
        self, values: torch.Tensor, lengths: torch.Tensor, zvalues: torch.Tensor,
        zlengths: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        from torchrec import KeyedJaggedTensor

        a = self.ebc(KeyedJaggedTensor(keys=["f_t0"], values=values, lengths=lengths))["f_t0"]
        z = KeyedJaggedTensor(keys=["f_zch"], values=zvalues, lengths=zlengths)
        b = self.zch(z)[0]["f_zch"]
        return torch.cat([a, b], dim=1) * self.scale


def small_artifact(
    path: Path, raw: torch.Tensor, slots: int = ZCH_SLOTS, rows: int = T0_ROWS
) -> Path:
    """The small model quantized (int8), exported, with a batch of raw ids ``raw`` held."""
    from deltad.consume.quant import quantize_model

    torch.manual_seed(0)
    q = quantize_model(SmallModel(slots, rows).eval(), "int8")
    n = raw.numel()
    inputs = (
        torch.arange(n, dtype=torch.int64) % T0_ROWS, torch.ones(n, dtype=torch.int64),
        raw.to(torch.int64), torch.ones(n, dtype=torch.int64),
    )  # fmt: skip
    export_torchscript(q, path, example_inputs=inputs)
    return path


def truth_state(*ws: ZchWriter) -> dict[str, torch.Tensor]:
    """The rows and lookup buffers a predictor of the spool of ``ws`` (one writer per rank)
    must hold: their truth, each rank's rows from its writer, packed as torchrec packs int8
    rows (fbgemm), and the MCH buffers of their slot map."""
    from deltad.consume.quant import pack_rows
    from deltad.types import ServeDtype

    truth = {t: v.clone() for t, v in ws[0].truth.items()}
    raw = ws[0].raw["zch"].clone()
    for w in ws[1:]:
        for t in truth:
            lo, hi = w.rows(t)
            truth[t][lo:hi] = w.truth[t][lo:hi]
        lo, hi = w.rows("zch")
        raw[lo:hi] = w.raw["zch"][lo:hi]

    def rows(t: str) -> torch.Tensor:
        return pack_rows(truth[t], ServeDtype.INT8, 16 * ((truth[t].shape[1] + 4 + 15) // 16))

    sorted_raw, mapping = lookup_buffers(raw, 0)
    return {
        "table.t0": rows("t0"),
        "table.zch": rows("zch"),
        "sorted": sorted_raw,
        "mapping": mapping,
    }


def predictor_args(endpoints: list[str], artifact: Path, name: str, *extra: str) -> list[str]:
    return [
        "--sidecars", ",".join(endpoints), "--model", "m", "--consumer", name,
        "--artifact", str(artifact), "--long-poll", "0.5", "--interval", "0.05",
        "--rpc-deadline", "5", "--max-retries", "2", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, redis_url: str) -> None:
    w = ZchWriter(
        tmp_path / "spool", mc={"zch": (ZCH_SLOTS, ZCH_DIM)}, tables={"t0": (T0_ROWS, T0_DIM)}
    )
    w.delta(n=3)
    good = small_artifact(tmp_path / "small.pt", w.raw["zch"][:8])
    other = small_artifact(tmp_path / "other.pt", w.raw["zch"][:8], slots=ZCH_SLOTS * 2)
    with sidecars(tmp_path / "spool", redis_url, 1) as eps:
        cases = {
            "unreachable": (predictor_args(["127.0.0.1:1"], good, "c1"), "no answer"),
            "wrong model": (
                [
                    *predictor_args(eps, good, "c2")[:3],
                    "other",
                    *predictor_args(eps, good, "c2")[4:],
                ],
                "serves model 'm', not 'other'",
            ),
            "missing artifact": (predictor_args(eps, tmp_path / "none.pt", "c3"), "not found"),
            "mismatched artifact": (
                predictor_args(eps, other, "c4"),
                "artifact does not match the sidecars' tables",
            ),
            "bad flag": (predictor_args(eps, good, "c5", "--pulls", "x"), "--pulls"),
            "bad allocator bound": (
                predictor_args(eps, good, "c6", "--malloc-keep-mb", "-1"),
                "--malloc-keep-mb",
            ),
        }
        for what, (argv, expect) in cases.items():
            rc, err = run_bad(*argv)
            assert rc == 2, (what, rc, err)
            assert len(err) == 1 and expect in err[0], (what, err)
            assert err[0].startswith("deltad-predictor-cpp: error: "), err


@pytest.mark.parametrize("wire", ["packed-int8", pytest.param("fp32", marks=pytest.mark.slow)])
def test_follows_a_managed_collision_table_and_survives_a_hostile_window(
    tmp_path: Path, redis_url: str, wire: str
) -> None:
    """Bootstrap and follow two ranks (rows packed in the table's layout, fp32 rows it packs
    as torchrec does); a window whose identities are impossible is refused whole: the
    predictor keeps serving what it held, asks for a rebase with backoff, and once the
    trainer's log is sane again ends bit-exact with it. The hostile case is the one no
    sidecar can see (each rank's log is consistent; sidecars quarantine the rest): rank 1
    gives one of its slots a raw id a slot of rank 0 holds."""
    spool = tmp_path / "spool"
    mc, plain = {"zch": (ZCH_SLOTS, ZCH_DIM)}, {"t0": (T0_ROWS, T0_DIM)}
    w0 = ZchWriter(spool, mc=mc, tables=plain, rank=0, world_size=2, seed=0)
    w1 = ZchWriter(spool, mc=mc, tables=plain, rank=1, world_size=2, seed=1)
    w1.next_raw = 20_000_000  # (the ranks admit raw ids of their own)

    def both(**kw: Any) -> None:
        w0.delta(**kw)
        w1.delta(**kw)

    for _ in range(3):
        both(n=4)
    art = small_artifact(tmp_path / "small.pt", torch.cat([w0.raw["zch"][:16], torch.tensor([5])]))
    state = tmp_path / "final.pt"
    with sidecars(spool, redis_url, 2) as eps:
        p = Predictor(
            *predictor_args(eps, art, "cpp-mc", "--final-state", str(state), "--wire-dtype", wire)
        )
        try:
            wait_for(lambda: p.caught_up(w0.step), 60, "bootstrap")
            for _ in range(3):
                both(n=4)
            wait_for(lambda: p.caught_up(w0.step), 60, "following")
            held = forwards(p)
            # hostile: rank 1's slot 40 takes a raw id a slot of rank 0 holds
            stolen = next(int(r) for r in w0.raw["zch"][:32] if int(r) != EMPTY_RAW_ID)
            w1.raw["zch"][40] = stolen
            w1._write(
                {"zch": torch.tensor([40])},
                {"zch": torch.empty(0, dtype=torch.int64)},
                SegmentKind.DELTA,
            )
            wait_for(lambda: len([x for x in p.pulls() if "error" in x]) >= 2, 60, "refusals")
            assert p.proc.poll() is None
            refused = [x for x in p.pulls() if "error" in x]
            assert all("held by two slots" in x["error"] for x in refused), refused
            assert any("window not applied" in e for e in p.errors)
            wait_for(lambda: forwards(p) > held, 30, "forwards while refusing")
            # the trainer's log is sane again: slot 40 gets a raw id of its own
            w0.delta()
            w1.delta(admit={"zch": {40: 99_000_001}})
            wait_for(lambda: p.caught_up(w0.step), 60, "recovery")
        finally:
            rc = p.stop() if p.proc.poll() is None else p.proc.returncode
        assert rc == 0, p.errors
    got = load_state(state)
    want = truth_state(w0, w1)
    man = json.loads(manifest_path(art).read_text())
    zch = next(t for t in man["tables"] if t["name"] == "zch")
    assert torch.equal(got["table.t0"], want["table.t0"])
    assert torch.equal(got["table.zch"], want["table.zch"])
    assert torch.equal(got[f"attr.{zch['mc']['sorted_raw_ids']}"], want["sorted"])
    assert torch.equal(got[f"attr.{zch['mc']['mapping']}"], want["mapping"])
    summary = [x for x in p.lines if x["event"] == "summary"][-1]
    assert summary["refused"] >= 2 and summary["forward_error"] is None
    assert summary["forward_p99_idle_ms"] > 0  # (latencies are recorded; compared in bench/)
    # the forward it answered is the artifact's with those weights (loaded in Python)
    ref = torch.jit.load(str(art))
    ex = [getattr(ref, name) for name in man["examples"]]
    m = artifact_state_into(ref, man, got)
    with torch.inference_mode():
        assert torch.equal(m(*ex), got["forward"])


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """A --final-state file (torch::jit::pickle_save of a dict of tensors)."""
    from torch.jit._pickle import restore_type_tag

    with torch.serialization.safe_globals([restore_type_tag]):
        out: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return out


def forwards(p: Predictor) -> int:
    return max((x.get("forwards", 0) for x in p.lines), default=0)


def artifact_state_into(m: Any, man: dict[str, Any], state: dict[str, torch.Tensor]) -> Any:
    """``m`` (a loaded artifact) with ``state`` (a --final-state) written into it."""

    def attr(name: str) -> torch.Tensor:
        obj: Any = m
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    with torch.no_grad():
        for t in man["tables"]:
            host = attr(man["tbes"][t["tbe"]]["weights_host"])
            n, rb = t["num_rows"], t["row_bytes"]
            host[t["offset"] : t["offset"] + n * rb].copy_(state[f"table.{t['name']}"].view(-1))
        for key, value in state.items():
            if key.startswith("attr."):
                attr(key[5:]).copy_(value)
    return m


@pytest.mark.slow
def test_mtls_and_a_token(tmp_path: Path, redis_url: str, pki: Path) -> None:
    """Against a sidecar that requires a client certificate and a bearer token: with both the
    predictor bootstraps bit-exact; without the token, or without the certificate, it says so
    in one line and exits 2."""
    w = ZchWriter(
        tmp_path / "spool", mc={"zch": (ZCH_SLOTS, ZCH_DIM)}, tables={"t0": (T0_ROWS, T0_DIM)}
    )
    w.delta(n=3)
    art = small_artifact(tmp_path / "small.pt", w.raw["zch"][:8])
    a = pki / "a"
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    state = tmp_path / "final.pt"
    tls = ["--tls-ca", str(a / "ca.pem"), "--tls-cert", str(a / "client.pem")]
    tls += ["--tls-key", str(a / "client.key")]
    with sidecars(
        tmp_path / "spool", redis_url, 1, listen="localhost:0", tls_cert=a / "server.pem",
        tls_key=a / "server.key", tls_client_ca=a / "ca.pem", tokens=("s3cret",),
    ) as eps:  # fmt: skip
        p = Predictor(
            *predictor_args(eps, art, "cpp-tls", "--final-state", str(state)),
            *tls, "--token-file", str(token),
        )  # fmt: skip
        try:
            wait_for(lambda: p.caught_up(w.step), 60, "bootstrap over mTLS")
        finally:
            rc = p.stop() if p.proc.poll() is None else p.proc.returncode
        assert rc == 0, p.errors
        got, want = load_state(state), truth_state(w)
        assert torch.equal(got["table.zch"], want["table.zch"])
        assert torch.equal(got["table.t0"], want["table.t0"])
        rc, err = run_bad(*predictor_args(eps, art, "cpp-tls2"), *tls)
        assert rc == 2 and len(err) == 1 and "UNAUTHENTICATED" in err[0], err
        rc, err = run_bad(
            *predictor_args(eps, art, "cpp-tls3"), "--tls-ca", str(a / "ca.pem"),
            "--token-file", str(token),
        )  # fmt: skip
        assert rc == 2 and len(err) == 1 and "no answer" in err[0], err


@pytest.mark.slow
def test_a_bootstrap_over_a_link_that_keeps_dropping_resumes(
    tmp_path: Path, redis_url: str
) -> None:
    """The predictor reaches its sidecar through a link cut every 300 kB during a ~1.5 MB
    bootstrap, with 2 retries: started over at each cut it would never finish; resuming each
    broken stream where it broke (GetDeltaRequest.resume), it does, bit-exact."""
    from bench.netproxy import DroppingProxy
    from deltad.serve.windows.request import MIN_CHUNK_BYTES

    slots, rows = 20_000, 40_000
    w = ZchWriter(tmp_path / "spool", mc={"zch": (slots, ZCH_DIM)}, tables={"t0": (rows, T0_DIM)})
    art = small_artifact(tmp_path / "big.pt", w.raw["zch"][:8], slots=slots, rows=rows)
    state = tmp_path / "final.pt"
    with (
        sidecars(tmp_path / "spool", redis_url, 1, chunk_bytes=MIN_CHUNK_BYTES) as eps,
        DroppingProxy(eps[0], drop_after=300_000, drops=1000) as link,
    ):
        p = Predictor(*predictor_args([link.endpoint], art, "cpp-far", "--final-state", str(state)))
        try:
            wait_for(functools.partial(p.caught_up, w.step), 120, "a bootstrap through cuts")
        finally:
            rc = p.stop() if p.proc.poll() is None else p.proc.returncode
        assert rc == 0, p.errors
        assert link.cut > 3, link.cut  # more cuts than 1 + max_retries attempts
    got, want = load_state(state), truth_state(w)
    for key in ("table.t0", "table.zch"):
        assert torch.equal(got[key], want[key]), key


# --- the reference trainer, its sidecars and the reference model exported -----------------------

TABLES = {"t0": 120, "t1": 90}
SEQ_ROWS = 80
DIM = 16
ZCH_REF_SLOTS = 48  # (raw ids 20x that: the trainer evicts all along)


def serving_config(dtype: str = "int8") -> Any:
    from deltad.reference.consumers.serving import ServingConfig

    return ServingConfig(
        dtype=dtype, tables=TABLES, seq_rows=SEQ_ROWS, dim=DIM, zch_slots=ZCH_REF_SLOTS
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "sharding", "wire", "seeds", "extra", "kill", "serve"),
    [
        (1, {}, "fp32", (3, 4), (), False, "int8"),
        (1, {}, "fp32", (5,), ("--form", "topk", "--k", "7"), False, "int8"),
        (2, {"t0": "tw", "t1": "rw", "seq": "rw"}, "packed-int8", (3,), (), True, "int8"),
        # t1 column-wise over both ranks: its column slices travel as fp32 and are merged in
        # the applier's float shadow, each row packed once every column of it is known
        (2, {"t0": "rw", "t1": "cw", "seq": "rw"}, "packed-int8", (6,), (), False, "int8"),
        # an fp32 serving model (torchrec's fp32 TBE), column slices written as they come
        (2, {"t0": "tw", "t1": "cw", "seq": "rw"}, "fp32", (7,), (), False, "fp32"),
    ],
    ids=["ws1-fp32-restart", "ws1-topk", "ws2-packed-kill9", "ws2-cw-packed", "ws2-fp32-serving"],
)
def test_cpp_predictor_follows_the_reference_trainer_bit_exact(
    tmp_path: Path,
    redis_url: str,
    world_size: int,
    sharding: dict[str, str],
    wire: str,
    seeds: tuple[int, ...],
    extra: tuple[str, ...],
    kill: bool,
    serve: str,
) -> None:
    """A C++ predictor started before the trainer's first segment follows a real multi-rank
    trainer (its managed-collision table admitting and evicting all along) while answering
    forwards, and ends bit-exact with the trainer's final model quantized by torchrec (int8;
    fp32 in one case):
    every table's bytes, the MC lookup buffers, the dense weights and the forward. With two
    seeds the trainer restarts (a new generation, other weights) and the predictor follows it
    there too. Top-k: rows are owed, then paid. ``kill``: the predictor is killed (-9) while the
    trainer trains and a new one of the same name takes over (it bootstraps again)."""
    from deltad.reference.trainer.train import TrainConfig, run_training

    from deltad.consume.export import export_reference

    cfg = serving_config(serve)
    art = tmp_path / "model.pt"
    export_reference(cfg, art)  # the model code's weights: every one comes from deltad
    spool = tmp_path / "spool"
    spool.mkdir()
    state = tmp_path / "final-state.pt"

    def train(seed: int) -> Any:
        return TrainConfig(
            spool_dir=spool, model="m", world_size=world_size, tables=TABLES, seq_rows=SEQ_ROWS,
            dim=DIM, sharding=sharding, steps=8, publish_every_steps=2, batch_size=32,
            final_model=tmp_path / "final.pt", seed=seed, progress=False, fsync=False,
            zch_slots=ZCH_REF_SLOTS,
        )  # fmt: skip

    def start(eps: list[str]) -> Predictor:
        args = predictor_args(eps, art, "cpp-ref", "--final-state", str(state))
        return Predictor(*args, "--wire-dtype", wire, "--chunk-rows", "64", *extra)

    killed: list[Predictor] = []
    with sidecars(spool, redis_url, world_size) as eps:
        p = start(eps)
        try:
            for seed in seeds:
                if kill:
                    done: list[int] = []
                    trainer = threading.Thread(
                        target=lambda s=seed, d=done: d.append(run_training(train(s)).steps)
                    )
                    trainer.start()
                    wait_for(p.applied, 120, "an apply")
                    p.kill()  # kill -9 mid-training; a new predictor of the same name follows
                    killed.append(p)
                    p = start(eps)
                    trainer.join(timeout=300)
                    steps = done[0]
                else:
                    steps = run_training(train(seed)).steps
                wait_for(functools.partial(p.caught_up, steps), 120, f"the step {steps}")
                assert p.proc.poll() is None
        finally:
            rc = p.stop() if p.proc.poll() is None else p.proc.returncode
        assert rc == 0, p.errors
    assert all(k.proc.returncode == -signal.SIGKILL for k in killed)
    pulls = p.pulls()
    assert any(x["resync"] for x in pulls) and sum(x["rows"] for x in pulls) > 0
    assert sum(x["dense_bytes"] for x in pulls) > 0  # the dense state came from the publisher
    assert sum(x["evicted"] for x in pulls) > 0  # the MC table evicted raw ids on the way
    assert len([x for x in pulls if x["applied"]]) >= 2  # a bootstrap, then deltas
    assert not [x for x in pulls if "error" in x], p.errors
    if "topk" in extra:  # rows were owed, then paid
        assert any(x["owed"] > 0 for x in pulls) and pulls[-1]["owed"] == 0
    if len(seeds) > 1:  # the restart: a new generation, as a generation diff or a resync
        news = [x for x in pulls if x["applied"] and (x["resync"] or x["generation_diff"])]
        assert len(news) >= 2, pulls
    summary = [x for x in p.lines if x["event"] == "summary"][-1]
    assert summary["forwards"] > 0 and summary["forward_error"] is None
    assert_serves(state, cfg, tmp_path / "final.pt", tmp_path / "reference.pt")


def assert_serves(state: Path, cfg: Any, weights: Path, scratch: Path) -> None:
    """The C++ predictor's state file ``state`` is bit-equal to torchrec's quantization of the
    trainer's model ``weights`` (a ``--final-model`` or a ``--dump-steps`` dump): every table's
    bytes, the MC lookup buffers, the dense weights and the forward on the fixed batch."""
    from deltad.consume.export import export_reference, reference_serving

    model_state = torch.load(weights, weights_only=True)
    export_reference(cfg, scratch, model_state)
    got, want = load_state(state), artifact_state(scratch)
    assert set(got) == set(want) | {"forward"}
    assert any("_mch_sorted_raw_ids" in k for k in got) and any("over." in k for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs"
    model, inputs = reference_serving(cfg, model_state)  # torchrec's quantization, in Python
    with torch.inference_mode():
        expected = model(*inputs)
    assert torch.equal(got["forward"], expected)


@pytest.mark.slow
def test_cpp_predictor_through_relays_rolls_back_and_is_released_bit_exact(
    tmp_path: Path, redis_url: str
) -> None:
    """A C++ predictor behind relays (one per rank, each mirroring its sidecar) follows a
    2-rank trainer (mixed sharding, MC table evicting, packed-int8 wire) to its last step; the
    fleet is rolled back to step 8 and then released. At each point its state (SIGUSR1) is
    bit-equal to torchrec's quantization of the trainer's model there: the final model, the
    trainer's own dump at step 8, the final model again; in place (no resync after the first)."""
    from deltad.reference.trainer.train import TrainConfig, run_training
    from test_rollback import Release, relay_of

    from deltad.consume.export import export_reference

    cfg = serving_config()
    art = tmp_path / "model.pt"
    export_reference(cfg, art)
    spool = tmp_path / "spool"
    spool.mkdir()
    state = tmp_path / "state.pt"
    steps, dump = 12, 8
    release = Release(redis_url)
    relays: list[Any] = []
    window = {"restore_window_steps": 100, "merge_min_segments": 2, "retention_interval_s": 0.05}
    with sidecar_servers(spool, redis_url, 2, **window) as servers:
        try:
            for r, srv in enumerate(servers):
                release.watch(srv)
                relays.append(relay_of(srv.endpoint, tmp_path / f"relay{r}", r, redis_url, release))
            eps = [x.endpoint for x in relays]
            p = Predictor(
                *predictor_args(eps, art, "cpp-relayed", "--final-state", str(state)),
                "--wire-dtype", "packed-int8", "--chunk-rows", "64",
            )  # fmt: skip
            train = TrainConfig(
                spool_dir=spool, model="m", world_size=2, tables=TABLES, seq_rows=SEQ_ROWS,
                dim=DIM, sharding={"t0": "cw", "t1": "rw", "seq": "rw"}, steps=steps,
                publish_every_steps=2, batch_size=32, final_model=tmp_path / "final.pt", seed=3,
                progress=False, fsync=False, zch_slots=ZCH_REF_SLOTS, dump_steps=(dump,),
                dump_dir=tmp_path / "dumps",
            )  # fmt: skip
            try:
                assert run_training(train).steps == steps

                def checked(step: int, weights: Path) -> None:
                    wait_for(functools.partial(p.caught_up, step), 120, f"the step {step}")
                    asked = len([x for x in p.lines if x["event"] == "state"])
                    p.proc.send_signal(signal.SIGUSR1)
                    wait_for(
                        lambda: len([x for x in p.lines if x["event"] == "state"]) > asked,
                        60, "the state written",
                    )  # fmt: skip
                    line = [x for x in p.lines if x["event"] == "state"][-1]
                    assert line["step"] == step and "error" not in line, line
                    assert_serves(state, cfg, weights, tmp_path / f"reference-{step}.pt")

                checked(steps, tmp_path / "final.pt")
                n = len(p.pulls())
                release.rollback(dump)
                checked(dump, tmp_path / "dumps" / f"model-step-{dump}.pt")
                back = [x for x in p.pulls()[n:] if x["rollback_to"] == dump]
                assert back and back[0]["applied"] and not back[0]["resync"], p.pulls()[n:]
                assert back[0]["dense_step"] == dump  # the dense state at 8 came with it
                n = len(p.pulls())
                release.release()
                checked(steps, tmp_path / "final.pt")
                assert not [x for x in p.pulls()[n:] if x["resync"]]
                assert p.proc.poll() is None
            finally:
                rc = p.stop() if p.proc.poll() is None else p.proc.returncode
            assert rc == 0, p.errors
        finally:
            for x in relays:
                x.stop(0.5)
    pulls = p.pulls()
    assert not [x for x in pulls if "error" in x], p.errors
    assert sum(x["evicted"] for x in pulls) > 0  # the MC table evicted raw ids on the way


@pytest.mark.slow
def test_cpp_predictor_starts_from_the_archive_through_relays_with_the_trainer_gone(
    tmp_path: Path, redis_url: str
) -> None:
    """The C++ client's cold start from the store: a 2-rank trainer (mixed sharding, an MC
    table evicting) ran with archiving sidecars, and its node is gone (sidecars stopped). A
    relay per rank follows the archive (`deltad serve --upstream-archive`); a C++ predictor
    behind them serves a state bit-equal to torchrec's quantization of the trainer's final
    model, dense state included, having reached no trainer sidecar."""
    from deltad.reference.trainer.train import TrainConfig, run_training
    from test_relay import db

    from deltad.config import ArchiveFollowConfig
    from deltad.consume.export import export_reference
    from deltad.serve.archive.fetch import read_manifest
    from deltad.serve.archive.opening import open_store
    from deltad.serve.relay.archived import ArchiveRelayServer

    cfg = serving_config()
    art = tmp_path / "model.pt"
    export_reference(cfg, art)
    spool = tmp_path / "spool"
    spool.mkdir()
    state = tmp_path / "state.pt"
    url = f"file://{tmp_path / 'archive'}"
    steps = 8
    with sidecar_servers(spool, redis_url, 2, archive_url=url):
        train = TrainConfig(
            spool_dir=spool, model="m", world_size=2, tables=TABLES, seq_rows=SEQ_ROWS,
            dim=DIM, sharding={"t0": "cw", "t1": "rw", "seq": "rw"}, steps=steps,
            publish_every_steps=2, batch_size=32, final_model=tmp_path / "final.pt", seed=5,
            progress=False, fsync=False, zch_slots=ZCH_REF_SLOTS,
        )  # fmt: skip
        assert run_training(train).steps == steps
        store = open_store(url)
        try:
            wait_for(
                lambda: all(
                    (m := read_manifest(store, "m", r)) is not None and m.head.step == steps
                    for r in range(2)
                ),
                60,
                "both ranks archived at the last step",
            )
        finally:
            store.close()
    relays: list[ArchiveRelayServer] = []
    try:
        for r in range(2):
            sc = ServerConfig(
                spool_dir=tmp_path / f"relay{r}", model="m", rank=r,
                redis_url=db(redis_url, 1 + r), listen="127.0.0.1:0", poll_interval_s=0.02,
                grace_period_s=0.5,
            )  # fmt: skip
            follow = ArchiveFollowConfig(url, poll_interval_s=0.05, fsync=False)
            relays.append(ArchiveRelayServer(sc, follow).start())
        eps = [x.endpoint for x in relays]
        p = Predictor(
            *predictor_args(eps, art, "cpp-from-store", "--final-state", str(state)),
            "--wire-dtype", "packed-int8",
        )  # fmt: skip
        try:
            wait_for(functools.partial(p.caught_up, steps), 120, f"the step {steps}")
        finally:
            rc = p.stop() if p.proc.poll() is None else p.proc.returncode
        assert rc == 0, p.errors
        assert_serves(state, cfg, tmp_path / "final.pt", tmp_path / "reference.pt")
    finally:
        for x in relays:
            x.stop(0.5)
    assert not [x for x in p.pulls() if "error" in x], p.errors
