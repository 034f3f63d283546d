"""GetDeltaRequest.holding (a cold start's zero-byte handshake) against a real sidecar: a pull
that names a state the log holds gets the window from it (no rows when nothing is newer; the
rows after it otherwise), and its cursor commits; a state the log cannot serve from is refused
with FAILED_PRECONDITION and nothing recorded."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from serverkit import Client, SpoolWriter, client, sidecar, spool, wait_for  # noqa: F401
from test_rollback import Release

from deltad import wire
from deltad.consume.sidecars import refusal
from deltad.serve.edge.app import SidecarServer
from deltad.v1 import delta_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def _held(sp: SpoolWriter, seq: int) -> pb.HeldState:
    return pb.HeldState(generation=sp.generation, seq=seq, step=10 * seq)  # (its steps)


def _served(srv: SidecarServer, seq: int) -> None:
    wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq, 10)


def test_a_named_held_state_gets_an_empty_window_at_it_whose_cursor_commits(
    spool: SpoolWriter,  # noqa: F811
    sidecar: SidecarServer,  # noqa: F811
    client: Client,  # noqa: F811
) -> None:
    for _ in range(3):
        spool.delta()
    head = spool.seq
    _served(sidecar, head)
    # the state at seq 2, pulled up to its own step: no rows, the cursor at it
    d = client.pull("cold", holding=_held(spool, 2), max_step=20, from_base=True)
    assert not d.resync and d.rows == 0 and (d.from_seq, d.to_seq) == (2, 2)
    assert client.commit(d).committed
    # the next pull is the tail after it: seq 3 only
    nxt = client.pull("cold")
    assert not nxt.resync and (nxt.from_seq, nxt.to_seq) == (2, head) and nxt.rows > 0
    # held state named without max_step: the rows after it, up to the head
    d2 = client.pull("other", holding=_held(spool, 1))
    assert not d2.resync and (d2.from_seq, d2.to_seq) == (1, head) and d2.rows > 0


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("generation", "generation 7 is not the served 1"),
        ("seq", "seq 9 is not a state this log holds"),
        ("step", "not 12345"),
        ("past", "has committed past it"),
    ],
)
def test_a_held_state_the_log_cannot_serve_from_is_refused(
    spool: SpoolWriter,  # noqa: F811
    sidecar: SidecarServer,  # noqa: F811
    client: Client,  # noqa: F811
    what: str,
    says: str,
) -> None:
    for _ in range(3):
        spool.delta()
    _served(sidecar, spool.seq)
    held = _held(spool, 2)
    if what == "generation":
        held.generation = 7
    elif what == "seq":
        held.seq = 9
    elif what == "step":
        held.step = 12345
    else:  # the consumer committed the head already
        client.commit(client.pull("c-past"))
    with pytest.raises(grpc.RpcError) as e:
        client.pull("c-past" if what == "past" else f"c-{what}", holding=held)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert says in (e.value.details() or ""), e.value.details()
    # (what a client acts on: the kind of refusal, not the message's words)
    assert refusal(e.value) == wire.REFUSED_HELD_STATE


def test_a_held_state_past_the_release_cap_is_refused(
    tmp_path: Path,
    redis_url: str,
) -> None:
    """A cold start must not serve a predictor a step the fleet is not released to."""
    from serverkit import server_config

    sp = SpoolWriter(tmp_path / "spool")
    for _ in range(3):
        sp.delta()
    release = Release(redis_url)
    srv = SidecarServer(server_config(tmp_path / "spool", redis_url, grace_period_s=0.2)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        release.watch(srv)
        _served(srv, sp.seq)
        from dataclasses import replace

        release.change(lambda st: replace(st, release_step=10, held=True))
        with pytest.raises(grpc.RpcError) as e:
            c.pull("cold", holding=_held(sp, 3))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "past the consumer's release cap" in (e.value.details() or "")
        assert refusal(e.value) == wire.REFUSED_HELD_STATE
        d = c.pull("cold", holding=_held(sp, 1))  # the released state itself is fine
        assert not d.resync and d.to_seq == 1
    finally:
        c.close()
        srv.stop(0)


def test_a_relay_answers_a_named_held_state_as_its_upstream_does(
    tmp_path: Path,
    redis_url: str,
) -> None:
    """Through a relay (the cold start of a predictor behind one): a pull naming a state the
    relay's log holds gets an empty window at it, its commit holds and the next pull is the
    tail; a state the relay's log does not hold is refused with FAILED_PRECONDITION."""
    from serverkit import server_config
    from test_relay import db, start_relay

    sp = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_url, grace_period_s=0.2)).start()
    relay = start_relay(srv.endpoint, tmp_path / "relay", 0, db(redis_url, 1))
    c = Client(relay.endpoint)
    try:
        for _ in range(3):  # followed one by one: the relay's log holds each state
            sp.delta()
            _served(relay.server, sp.seq)
        head = sp.seq
        d = c.pull("cold", holding=_held(sp, 2), max_step=20, from_base=True)
        assert not d.resync and d.rows == 0 and (d.from_seq, d.to_seq) == (2, 2)
        assert c.commit(d).committed
        nxt = c.pull("cold")
        assert not nxt.resync and (nxt.from_seq, nxt.to_seq) == (2, head) and nxt.rows > 0
        held = _held(sp, 2)
        held.seq = 9
        with pytest.raises(grpc.RpcError) as e:
            c.pull("cold-2", holding=held)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "seq 9 is not a state this log holds" in (e.value.details() or "")
    finally:
        c.close()
        relay.stop(0)
        srv.stop(0)
