"""DeltaConsumer options: bearer token, TLS CA, auto-commit, bounded retries, lease heartbeats,
ids / top-k forms with a quantized wire dtype, and the TorchRec applier fed by a real pull."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis
import torch
from spoolkit import FakeTrainer, wait_for

from deltad.config import ConsumerConfig, PullOptions, ServerConfig
from deltad.consume.appliers import TensorDictApplier, TorchRecApplier
from deltad.consume.client import DeltaConsumer
from deltad.errors import ConsumerError, SidecarUnavailableError
from deltad.keys import RedisKeys
from deltad.serve.edge.app import SidecarServer
from deltad.types import Form, WireDtype

pytestmark = pytest.mark.timeout(120)


def _server(spool: Path, redis_url: str, rank: int = 0, **kw: object) -> SidecarServer:
    cfg = ServerConfig(
        spool_dir=spool,
        model="m",
        rank=rank,
        listen="127.0.0.1:0",
        redis_url=redis_url,
        poll_interval_s=0.02,
        grace_period_s=0.5,
        **kw,  # type: ignore[arg-type]
    )
    return SidecarServer(cfg).start()


def _config(name: str, endpoints: list[str], **kw: object) -> ConsumerConfig:
    opts: dict[str, object] = {"rpc_deadline_s": 5.0, "max_retries": 1, "backoff_initial_s": 0.05}
    opts.update(kw)
    return ConsumerConfig(consumer=name, model="m", sidecars=tuple(endpoints), **opts)  # type: ignore[arg-type]


def _ready(c: DeltaConsumer, step: int) -> None:
    wait_for(lambda: all(s.head_step == step for s in c.status()), 30.0, f"head at {step}")


def test_bearer_token_and_tls(tmp_path: Path, redis_url: str) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    server = _server(tmp_path / "spool", redis_url, tls_cert=cert, tls_key=key, tokens=("s3cret",))
    try:
        with DeltaConsumer(_config("tls", [server.endpoint], tls_ca=cert, token="s3cret")) as c:
            _ready(c, 0)
            applier = TensorDictApplier()
            assert c.sync(applier.apply).step == 0
            assert torch.equal(applier.tables()["t0"], ft.history[0]["t0"])
        with pytest.raises(ConsumerError, match="UNAUTHENTICATED"):
            DeltaConsumer(_config("tls", [server.endpoint], tls_ca=cert, token="wrong")).connect()
        with DeltaConsumer(_config("plain", [server.endpoint], token="s3cret")) as c:
            assert 0 in c.pull().missing  # plaintext to a TLS port: no answer, no rows
    finally:
        server.stop(0.5)


def test_unreachable_sidecar_fails_within_bounded_retries() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    cfg = _config("lonely", [f"127.0.0.1:{port}"], rpc_deadline_s=1.0, max_retries=2)
    t0 = time.monotonic()
    with DeltaConsumer(cfg) as c:  # connects: a down sidecar only delays its rank
        r = c.pull()
        assert not r.deltas and "3 attempts" in r.missing[0]
        with pytest.raises(SidecarUnavailableError, match="3 attempts"):
            c.status()
    assert time.monotonic() - t0 < 20


def test_auto_commit_and_heartbeats(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=1)
    ft.start(0)
    ft.step(5)
    server = _server(tmp_path, redis_url)
    store = redis.Redis.from_url(redis_url)
    keys = RedisKeys("m")
    try:
        cfg = _config(
            "auto",
            [server.endpoint],
            pull=PullOptions(auto_commit=True),
            lease_ttl_s=1.0,
            heartbeat_interval_s=0.2,
        )
        with DeltaConsumer(cfg) as c:
            _ready(c, 5)
            r = c.pull()
            assert r.rows > 0 and all(d.committed for d in r.deltas)
            assert store.hget(keys.cursor("auto", 0), "seq") == b"1"  # committed, no commit()
            # the lease (1 s TTL) outlives several TTLs thanks to the heartbeat thread
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert store.exists(keys.lease("auto"))
                time.sleep(0.1)
        wait_for(lambda: not store.exists(keys.lease("auto")), 10.0, "lease expiry after close")
    finally:
        store.close()
        server.stop(0.5)


def test_ids_and_int8_topk_forms(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=1, tables={"t0": (50, 8)})
    ft.start(0)
    ft.step(1, touch=10)
    server = _server(tmp_path, redis_url)
    try:
        with DeltaConsumer(_config("ids", [server.endpoint])) as c:
            _ready(c, 1)
        ids_cfg = _config("ids", [server.endpoint], pull=PullOptions(form=Form.IDS))
        with DeltaConsumer(ids_cfg) as c:
            base = c.pull()  # a new consumer starts at the base: every id, no values
            assert base.resync and base.rows == 50
            c.commit(base)
        topk = _config(
            "topk",
            [server.endpoint],
            pull=PullOptions(form=Form.TOPK, k=4, wire_dtype=WireDtype.INT8),
        )
        with DeltaConsumer(topk) as c:
            applier = TensorDictApplier()
            c.sync(applier.apply)  # base (complete, int8)
            ft.step(2, touch=10)
            _ready(c, 2)
            pulls = []
            for _ in range(10):  # k=4 of 10 changed rows per pull: converges in 3
                r = c.sync(applier.apply)
                pulls.append((r.rows, sum(s.owed for d in r.deltas for s in d.shards)))
                if pulls[-1] == (0, 0):
                    break
            assert pulls[0] == (4, 6) and pulls[-1] == (0, 0), pulls
            truth = ft.history[2]["t0"]
            bound = (truth.amax(dim=1) - truth.amin(dim=1)) / 510 * (1 + 1e-5) + 1e-6
            assert bool(((applier.tables()["t0"] - truth).abs().amax(dim=1) <= bound).all())
    finally:
        server.stop(0.5)


def test_torchrec_applier_from_a_real_pull(tmp_path: Path, redis_url: str) -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ft = FakeTrainer(tmp_path, world_size=2, tables={"t0": (30, 8), "t1": (20, 4)})
    ft.start(0)
    ft.step(3)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f{n}"])
            for n, (r, d) in ft.shapes.items()
        ]
    )
    servers = [_server(tmp_path, redis_url, rank=r) for r in range(2)]
    try:
        with DeltaConsumer(_config("ebc", [s.endpoint for s in servers])) as c:
            _ready(c, 3)
            c.sync(TorchRecApplier(ebc).apply)
        for n in ft.shapes:
            assert torch.equal(ebc.embedding_bags[n].weight.detach(), ft.history[3][n])
    finally:
        for s in servers:
            s.stop(0.5)
