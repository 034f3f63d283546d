"""Scoped credentials at the edge: tokens bound to consumer globs and roles, mTLS identities,
duplicate headers, SIGHUP reload, refusal of files that would turn auth off, and the
consumer limit. Real sidecars, real Redis, real TLS (openssl)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from serverkit import MODEL, Client, SpoolWriter, redis_server, server_config, wait_for
from spoolkit import child_env, read_serving_line, stop_process

from deltad.consume import decode
from deltad.errors import ConfigError
from deltad.keys import RedisKeys
from deltad.serve.edge.app import SidecarServer
from deltad.serve.edge.auth import parse_tokens
from deltad.serve.state.offsets import OffsetStore
from deltad.store import EmbeddedRedis
from deltad.types import Role
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]

TOKENS = """\
# token       consumers           roles
alice-tok     alice,alice-*       consume   # alice's predictors
ops-tok       *                   consume,admin
"""


def _code(fn: object) -> grpc.StatusCode:
    assert callable(fn)
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()  # type: ignore[no-any-return]


def _serve(tmp_path: Path, url: str, text: str = TOKENS, **kw: object) -> SidecarServer:
    f = tmp_path / "tokens"
    f.write_text(text)
    return SidecarServer(server_config(tmp_path / "spool", url, tokens_file=f, **kw)).start()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no usable line"),
        ("# only a comment\n\n   \n", "no usable line"),
        ("s3cret\n", "old one-token-per-line"),
        ("tok alice\n", "expected 'TOKEN CONSUMERS ROLES'"),
        ("tok alice consume,root\n", "roles must be"),
        ("tok al/ice consume\n", "invalid consumer pattern"),
        ("tok a consume\ntok b consume\n", "repeats the one on line 1"),
        ("mtls: a consume\n", "subject CN"),
    ],
)
def test_a_tokens_file_that_would_weaken_auth_is_refused(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_tokens(text)


def test_tokens_file_lines_bind_globs_and_roles() -> None:
    creds = parse_tokens(TOKENS + "mtls:pred-3 pred-[0-9] consume # a cert\n")
    alice = creds.for_token("alice-tok")
    assert alice is not None and alice.roles == {Role.CONSUME} and not alice.admin
    assert alice.covers("alice") and alice.covers("alice-2") and not alice.covers("bob")
    assert not alice.covers("alicebob")
    ops = creds.for_token("ops-tok")
    assert ops is not None and ops.admin and ops.covers("anyone")
    assert creds.for_token("consume") is None and creds.for_token("#") is None
    pred = creds.for_identity("pred-3")
    assert pred is not None and pred.covers("pred-7") and not pred.covers("pred-10")


def test_a_token_acts_only_for_its_consumers_and_nothing_changes_out_of_scope(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    srv = _serve(tmp_path, redis_server.url)
    target = f"127.0.0.1:{srv.port}"
    alice, ops = Client(target, "alice-tok"), Client(target, "ops-tok")
    store = OffsetStore.from_url(redis_server.url, MODEL)
    try:
        bob = ops.pull("bob")  # bob is at seq 0, then a delta is published
        ops.commit(bob)
        spool.delta()
        wait_for(lambda: srv.log.snapshot().head.seq == 1, what="delta indexed")  # type: ignore[union-attr]
        before = (store.get_cursor("bob", 0), store.pending_pulls(["bob"], 0)["bob"])
        lease_before = store.lease_remaining(["bob"])["bob"]

        # GetDelta with auto-commit, Commit, Register with a 1 ms lease, Heartbeat: all as bob
        assert (
            _code(lambda: alice.pull("bob", auto_commit=True)) == grpc.StatusCode.PERMISSION_DENIED
        )
        cursor = pb.Cursor(consumer="bob", rank=0, generation=1, seq=1, step=10, pull_id="x")
        commit = pb.CommitRequest(consumer="bob", cursor=cursor)
        assert _code(lambda: alice.stub.Commit(commit, metadata=alice.md, timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        reg = pb.RegisterRequest(consumer="bob", lease_ttl_seconds=0.001)
        assert _code(lambda: alice.stub.Register(reg, metadata=alice.md, timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        hb = pb.HeartbeatRequest(consumer="bob")
        assert _code(lambda: alice.stub.Heartbeat(hb, metadata=alice.md, timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert (store.get_cursor("bob", 0), store.pending_pulls(["bob"], 0)["bob"]) == before
        assert store.lease_remaining(["bob"])["bob"] >= lease_before - 1.0

        # in scope: alice's own names; Status for any role
        assert alice.pull("alice-2").rows == 1500
        alice.stub.Status(pb.StatusRequest(), metadata=alice.md, timeout=5)
        # ListConsumers: a consume token sees its own consumers, admin sees every one
        seen = alice.stub.ListConsumers(pb.ListConsumersRequest(), metadata=alice.md, timeout=5)
        assert [c.consumer for c in seen.consumers] == ["alice-2"]
        seen = ops.stub.ListConsumers(pb.ListConsumersRequest(), metadata=ops.md, timeout=5)
        assert [c.consumer for c in seen.consumers] == ["alice-2", "bob"]
        assert srv.gate.denied >= 4

        # Forget is admin-only: a consume token may not forget even its own consumer
        forget = pb.ForgetRequest(consumer="alice-2")
        assert _code(lambda: alice.stub.Forget(forget, metadata=alice.md, timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert (
            store.get_cursor("alice-2", 0) is not None
            or store.pending_pulls(["alice-2"], 0)["alice-2"] is not None
        )
        # the admin forgets bob: his cursor, pull, lease and membership are gone on every rank
        done = ops.stub.Forget(pb.ForgetRequest(consumer="bob"), metadata=ops.md, timeout=5)
        assert done.forgotten
        assert store.get_cursor("bob", 0) is None
        assert store.pending_pulls(["bob"], 0)["bob"] is None
        assert "bob" not in store.consumers()
        again = ops.stub.Forget(pb.ForgetRequest(consumer="bob"), metadata=ops.md, timeout=5)
        assert not again.forgotten
        bad = pb.ForgetRequest(consumer="../etc")
        assert _code(lambda: ops.stub.Forget(bad, metadata=ops.md, timeout=5)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        # bob comes back as a new consumer: the full tables again
        assert ops.pull("bob").rows == 1500
    finally:
        alice.close()
        ops.close()
        store.client.close()
        srv.stop(0)


def test_more_than_one_authorization_header_is_refused(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    srv = _serve(tmp_path, redis_server.url)
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        for md in (
            [("authorization", "Bearer ops-tok"), ("authorization", "Bearer wrong")],
            [("authorization", "Bearer ops-tok"), ("authorization", "Bearer ops-tok")],
            [("authorization", "Bearer wrong"), ("authorization", "Bearer ops-tok")],
        ):
            req = pb.GetDeltaRequest(consumer="x")
            assert _code(
                lambda req=req, md=md: decode.pull(c.channel, req, timeout=5, metadata=md)
            ) == (grpc.StatusCode.UNAUTHENTICATED)
        for md in ([], [("authorization", "ops-tok")], [("authorization", "Bearer alice")]):
            assert (
                _code(lambda md=md: c.stub.Status(pb.StatusRequest(), metadata=md, timeout=5))
                == grpc.StatusCode.UNAUTHENTICATED
            )
        assert (
            c.stub.Status(
                pb.StatusRequest(), metadata=[("authorization", "Bearer ops-tok")], timeout=5
            ).model
            == MODEL
        )
    finally:
        c.close()
        srv.stop(0)


def test_max_consumers_refuses_new_names_and_stores_nothing_for_them(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url, max_consumers=2))
    srv.start()
    c = Client(f"127.0.0.1:{srv.port}")
    r = redis.Redis.from_url(redis_server.url)
    try:
        c.pull("a")
        c.stub.Register(pb.RegisterRequest(consumer="b"), timeout=5)
        keys_before = sorted(r.keys("*"))
        owed_before = sorted(p.name for p in (tmp_path / "spool").rglob("*"))
        assert (
            _code(lambda: c.stub.Register(pb.RegisterRequest(consumer="c"), timeout=5))
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert _code(lambda: c.pull("d")) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sorted(r.keys("*")) == keys_before  # nothing persisted for c or d
        assert sorted(p.name for p in (tmp_path / "spool").rglob("*")) == owed_before
        assert sorted(x.decode() for x in r.smembers(RedisKeys(MODEL).consumers())) == ["a", "b"]
        assert c.pull("a").rows == c.pull("b").rows == 1500  # known names are still served
    finally:
        r.close()
        c.close()
        srv.stop(0)


def test_a_forgotten_consumer_frees_its_place_under_max_consumers(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    cfg = server_config(
        tmp_path / "spool", redis_server.url, max_consumers=1, forget_after_s=0.05,
        forget_interval_s=3600.0,
    )  # fmt: skip
    srv = SidecarServer(cfg).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        c.pull("a")  # admitted (and cached: no Redis round trip on its next pulls)
        c.stub.Register(pb.RegisterRequest(consumer="a", lease_ttl_seconds=0.05), timeout=5)
        reg_b = pb.RegisterRequest(consumer="b")
        assert _code(lambda: c.stub.Register(reg_b, timeout=5)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        time.sleep(0.3)  # a's lease expires, and it stays silent past forget_after
        assert srv.forget_idle() == ["a"]
        c.stub.Register(reg_b, timeout=5)
        assert _code(lambda: c.pull("a")) == grpc.StatusCode.RESOURCE_EXHAUSTED  # not cached
    finally:
        c.close()
        srv.stop(0)


def _serve_cli(spool: Path, url: str, tokens: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(spool), "--model", MODEL,
         "--listen", "127.0.0.1:0", "--redis-url", url, "--tokens-file", str(tokens),
         "--grace-period", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip


@pytest.mark.slow  # subprocesses that import torch
def test_serve_refuses_to_start_on_a_file_without_usable_lines(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    for text in ("# nobody yet\n", "s3cret\nother\n"):
        (tmp_path / "tokens").write_text(text)
        proc = _serve_cli(tmp_path / "spool", redis_server.url, tmp_path / "tokens")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, out
        lines = out.strip().splitlines()
        assert len(lines) == 1 and "tokens" in lines[0], out
    env = {**child_env(), "DELTAD_TOKENS": "a,b"}
    proc = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path / "spool")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "DELTAD_TOKENS" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_sighup_reloads_the_tokens_file_and_keeps_the_old_one_if_the_new_is_bad(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    tokens = tmp_path / "tokens"
    tokens.write_text("old-tok * consume\n")
    proc = _serve_cli(tmp_path / "spool", redis_server.url, tokens)
    try:
        target = read_serving_line(proc, 60)
        old, new = Client(target, "old-tok"), Client(target, "new-tok")

        def works(c: Client) -> bool:
            try:
                c.stub.Status(pb.StatusRequest(), metadata=c.md, timeout=5)
                return True
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                return False

        assert works(old) and not works(new)
        tmp = tmp_path / "tokens.tmp"
        tmp.write_text("new-tok * consume\n")
        os.replace(tmp, tokens)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: works(new), 10, "new token accepted")
        assert not works(old)
        tokens.write_text("just-a-token\n")  # invalid: the sidecar keeps new-tok
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert works(new) and proc.poll() is None
        old.close()
        new.close()
    finally:
        stop_process(proc)


def test_mtls_identity_binds_like_a_token(
    tmp_path: Path, redis_server: EmbeddedRedis, pki: Path
) -> None:
    d = pki / "a"
    SpoolWriter(tmp_path / "spool")
    srv = _serve(
        tmp_path,
        redis_server.url,
        "mtls:pred-1 pred-1,pred-1-* consume\nops-tok * consume,admin\n",
        tls_cert=d / "server.pem",
        tls_key=d / "server.key",
        tls_client_ca=d / "ca.pem",
        listen="localhost:0",
    )
    ca = (d / "ca.pem").read_bytes()
    target = f"localhost:{srv.port}"

    def channel(name: str) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(d / f"{name}.key").read_bytes(),
            certificate_chain=(d / f"{name}.pem").read_bytes(),
        )
        return grpc.secure_channel(target, creds)

    pred, stranger = channel("pred-1"), channel("stranger")
    try:
        ids = pb.FORM_IDS
        assert decode.pull(pred, pb.GetDeltaRequest(consumer="pred-1", form=ids), timeout=10).rows
        bad = pb.GetDeltaRequest(consumer="pred-2", form=ids)
        assert _code(lambda: decode.pull(pred, bad, timeout=10)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        mine = pb.GetDeltaRequest(consumer="stranger", form=ids)
        assert _code(lambda: decode.pull(stranger, mine, timeout=10)) == (
            grpc.StatusCode.UNAUTHENTICATED  # a valid certificate, but not in the tokens file
        )
        md = [("authorization", "Bearer ops-tok")]  # a token beside the certificate wins
        assert decode.pull(stranger, mine, timeout=10, metadata=md).rows
    finally:
        pred.close()
        stranger.close()
        srv.stop(0)


def test_status_shows_a_consume_credential_its_own_caps_and_no_other_groups(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """The release state's pins and canary groups name other consumers: Status shows them to
    admin and relay credentials only; a consume credential asking for another consumer's cap
    is refused, its own is answered."""
    spool = SpoolWriter(tmp_path / "spool")
    spool.delta()
    srv = _serve(tmp_path, redis_server.url, TOKENS + "relay-tok  relay-*  relay\n")
    try:
        ops = Client(f"127.0.0.1:{srv.port}", "ops-tok")
        md = ops.md
        ops.stub.Rollout(pb.RolloutRequest(action=pb.ROLLOUT_PIN, group="bob-*", step=10),
                         metadata=md, timeout=10)  # fmt: skip
        ops.stub.Rollout(pb.RolloutRequest(action=pb.ROLLOUT_CANARY, group="carol-*"),
                         metadata=md, timeout=10)  # fmt: skip
        for token, full in (("ops-tok", True), ("relay-tok", True), ("alice-tok", False)):
            c = Client(f"127.0.0.1:{srv.port}", token)
            state = json.loads(c.stub.Status(pb.StatusRequest(), metadata=c.md).rollout_state)
            assert (state["pins"] == [["bob-*", 10]]) == full, (token, state)
            assert (state["canary"] == ["carol-*"]) == full, (token, state)
            assert state.get("redacted", False) != full
            assert state["version"] == 2  # (what it does see is the state as it is)
            c.channel.close()
        alice = Client(f"127.0.0.1:{srv.port}", "alice-tok")
        own = alice.stub.Status(pb.StatusRequest(consumer="alice-1"), metadata=alice.md)
        assert own.cap_step == -1  # (no pin or canary of alice: the head is released)
        assert (
            _code(lambda: alice.stub.Status(pb.StatusRequest(consumer="bob-1"), metadata=alice.md))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        bob = ops.stub.Status(pb.StatusRequest(consumer="bob-1"), metadata=md)
        assert bob.cap_step == 10  # (admin: anyone's)
        alice.channel.close()
        ops.channel.close()
    finally:
        srv.stop(0)
