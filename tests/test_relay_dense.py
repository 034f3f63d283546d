"""Dense states through relays (issue 22 item 1): a relay mirrors its upstream's dense states
(``with_dense``) into its spool and re-serves them, byte-equal, at every level; a relay that
lacks one says so (``DeltaHeader.dense_missing`` -> ``PullResult.dense_missing``) and the pull
is not caught up. Real sidecars, relays, Redis and gRPC; the trainer is tests/serverkit's
SpoolWriter (the reference trainer through relays is in test_relay_dense_slow.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serverkit import Client, SpoolWriter, server_config, wait_for
from test_relay import db, predictor, start_relay, status

from deltad.segment.format import encode_dense, tensor_bytes, write_dense
from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer

pytestmark = pytest.mark.timeout(120)


def _write_dense(
    spool: SpoolWriter, tensors: dict[str, torch.Tensor], *, ahead: bool = False
) -> None:
    """A dense state for the SpoolWriter's last segment (seq, step), as rank 0 writes it;
    ``ahead``: for the segment the next ``delta()`` writes (before it, as the publisher does:
    a server never sees a segment before its dense state)."""
    seq, step = (spool.seq + 1, spool.step + 10) if ahead else (spool.seq, spool.step)
    data = encode_dense(
        model=spool.layout.model, generation=spool.generation, rank=0, seq=seq,
        step=step, tensors=tensors,
    )  # fmt: skip
    write_dense(spool.layout.dense_path(spool.generation, 0, seq), data, fsync=False)


def _state(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {
        "w": torch.randn(100_000, generator=g),  # 400 kB: several DenseChunks
        "bn.num_batches_tracked": torch.tensor(i),
        "mask": torch.rand(3, 5, generator=g) > 0.5,
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),
    }


def _bytes(state: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    return [(n, str(t.dtype), tuple(t.shape), bytes(tensor_bytes(t))) for n, t in state.items()]


def _at(endpoint: str, step: int, dense: int | None) -> bool:
    """The server's head is at ``step`` and its newest dense state at ``dense``."""
    s = status(endpoint)
    return s.head_step == step and (list(s.dense_steps) or [None])[-1] == dense


def test_relays_of_a_sidecar_with_dense_states_serve_them_byte_equal(
    tmp_path: Path, redis_url: str
) -> None:
    """sidecar -> relay -> relay: every level serves the dense states with their steps, the
    same bytes in the same order, to raw pulls and to an aligned DeltaConsumer."""
    root = tmp_path
    spool = SpoolWriter(root / "spool")
    _write_dense(spool, _state(0))
    spool.delta()
    _write_dense(spool, _state(10))
    side = SidecarServer(server_config(root / "spool", redis_url)).start()
    servers: list[SidecarServer | RelayServer] = [side]
    try:
        r1 = start_relay(side.endpoint, root / "relay-1", 0, db(redis_url, 1))
        servers.append(r1)
        r2 = start_relay(r1.endpoint, root / "relay-2", 0, db(redis_url, 2))
        servers.append(r2)
        levels = [side.endpoint, r1.endpoint, r2.endpoint]
        for e in levels:
            wait_for(lambda e=e: _at(e, 10, 10), 30, f"{e} at step 10 with its dense state")  # type: ignore[misc]
        for e in levels:
            c = Client(e)
            try:
                d = c.pull("raw", from_base=True, with_dense=True)
            finally:
                c.close()
            assert d.resync and (d.to_step, d.dense_step, d.dense_seq) == (10, 10, 1)
            assert d.dense_missing == ""
            assert _bytes(d.dense) == _bytes(_state(10))
        # a new dense state reaches the top of the tree and an aligned predictor with its step
        _write_dense(spool, _state(20), ahead=True)
        spool.delta()
        with predictor("p", [r2.endpoint]) as c:
            for e in levels:
                wait_for(lambda e=e: _at(e, 20, 20), 30, f"{e} at step 20")  # type: ignore[misc]
            r = c.pull()
            assert r.resync and (r.step, r.dense_step) == (20, 20)
            assert _bytes(r.dense) == _bytes(_state(20))
            assert r.dense_missing == {} and r.caught_up
            c.commit(r)
            spool.delta()  # step 30: rows only; the predictor holds the dense state of 20
            wait_for(lambda: _at(r2.endpoint, 30, 20), 30, "relay 2 at step 30")
            r = c.pull()
            assert (r.step, r.dense_step, r.dense_missing) == (20, None, {})
        # the relays hold the newest dense state of each pull, under the upstream's seqs
        assert list(status(side.endpoint).dense_steps) == [0, 10, 20]
        assert list(status(r2.endpoint).dense_steps) == [10, 20]
        for d in ("relay-1", "relay-2"):
            assert [s for s, _ in SpoolLayout(root / d, "m").dense_files(1, 0)] == [1, 2]
    finally:
        for s in reversed(servers):
            s.stop(0.2)


def test_a_relay_lacking_its_upstreams_dense_state_says_so_at_every_level(
    tmp_path: Path, redis_url: str
) -> None:
    """A relay whose dense files are gone serves the rows but says which dense state it
    lacks; the pull is not caught up. A relay of it passes the reason on."""
    root = tmp_path
    spool = SpoolWriter(root / "spool")
    spool.delta()
    _write_dense(spool, _state(10))
    side = SidecarServer(server_config(root / "spool", redis_url)).start()
    servers: list[SidecarServer | RelayServer] = [side]
    try:
        r1 = start_relay(side.endpoint, root / "relay-1", 0, db(redis_url, 1))
        servers.append(r1)
        wait_for(lambda: _at(r1.endpoint, 10, 10), 30, "relay 1 at step 10")
        # the relay loses its dense state while it is down (a running one writes back what
        # its spool loses): restarted, it never pulls it again
        r1.stop(0.2)
        servers.remove(r1)
        layout = SpoolLayout(root / "relay-1", "m")
        for _, p in layout.dense_files(1, 0):
            p.unlink()
        r1 = start_relay(side.endpoint, root / "relay-1", 0, db(redis_url, 1))
        servers.append(r1)
        wait_for(lambda: _at(r1.endpoint, 10, None), 30, "relay 1 without dense states")
        with predictor("p", [r1.endpoint]) as c:
            pulls = [c.pull()]
            # (the restarted relay learns its upstream's dense states at its first poll)
            wait_for(lambda: pulls[-1].dense_missing or pulls.append(c.pull()), 30, "the lack said")
            r = pulls[-1]
            assert r.step == 10 and r.step == r.head_step and r.missing == {}
            assert r.dense_step is None
            assert "holds no dense state of step 10" in r.dense_missing[0]
            assert not r.caught_up
        r2 = start_relay(r1.endpoint, root / "relay-2", 0, db(redis_url, 2))
        servers.append(r2)
        wait_for(lambda: status(r2.endpoint).head_step == 10, 30, "relay 2 at step 10")
        with predictor("q", [r2.endpoint]) as c:
            r = c.pull()
            assert r.step == 10 and r.dense_step is None and not r.caught_up
            why = r.dense_missing[0]
            assert why.startswith(f"upstream {r1.endpoint}: ") and "step 10" in why
        # a sidecar beside the trainer serves what the trainer wrote: nothing missing
        with predictor("s", [side.endpoint]) as c:
            r = c.pull()
            assert r.dense_step == 10 and r.dense_missing == {} and r.caught_up
    finally:
        for s in reversed(servers):
            s.stop(0.2)
