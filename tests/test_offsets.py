"""The Redis offset store on a real redis-server: commits, leases, pins, restarts, outages."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from serverkit import redis_server

from deltad.errors import OffsetStoreError
from deltad.serve.state.offsets import CommitRejected, OffsetStore, PendingPull
from deltad.store import EmbeddedRedis

__all__ = ["redis_server"]


def _pull(store: OffsetStore, consumer: str, pid: str, seq: int, gen: int = 1) -> None:
    store.record_pull(consumer, 0, PendingPull(pid, gen, seq, seq * 10, "", 0))


def _commit(store: OffsetStore, consumer: str, pid: str, seq: int, gen: int = 1) -> int:
    return store.commit(consumer, 0, pull_id=pid, generation=gen, seq=seq, step=seq * 10).seq


def test_commit_rules(redis_server: EmbeddedRedis) -> None:
    s = OffsetStore.from_url(redis_server.url, "m")
    with pytest.raises(CommitRejected) as e:
        _commit(s, "c", "p0", 0)
    assert e.value.reason == "no_consumer"
    _pull(s, "c", "p1", 3)
    assert _commit(s, "c", "p1", 3) == 3
    assert _commit(s, "c", "p1", 3) == 3  # idempotent re-commit
    _pull(s, "c", "p2", 5)
    with pytest.raises(CommitRejected) as e:
        _commit(s, "c", "p2", 6)  # not what was issued
    assert e.value.reason == "mismatch"
    _pull(s, "c", "p3", 2)  # a pull behind the committed cursor (e.g. a confused server)
    with pytest.raises(CommitRejected) as e:
        _commit(s, "c", "p3", 2)
    assert e.value.reason == "behind"
    _pull(s, "c", "p4", 9, gen=0)
    with pytest.raises(CommitRejected) as e:
        _commit(s, "c", "p4", 9, gen=0)
    assert e.value.reason == "old_generation"
    with pytest.raises(CommitRejected) as e:
        _commit(s, "c", "p2", 5)  # superseded by p4
    assert e.value.reason == "unknown_pull"
    # a huge (time-based) generation compares exactly, beyond float precision
    big = 1_700_000_000_000_000_001
    _pull(s, "c", "p5", 0, gen=big)
    assert _commit(s, "c", "p5", 0, gen=big) == 0
    _pull(s, "c", "p6", 7, gen=big - 1)
    with pytest.raises(CommitRejected):
        _commit(s, "c", "p6", 7, gen=big - 1)
    cur = s.get_cursor("c", 0)
    assert cur is not None and (cur.generation, cur.seq, cur.pull_id) == (big, 0, "p5")


def test_leases_and_pins(redis_server: EmbeddedRedis) -> None:
    s = OffsetStore.from_url(redis_server.url, "m")
    assert s.heartbeat("x", 1.0) is None
    s.register("live", 30.0)
    s.register("dying", 0.2)
    for c, seq in (("live", 4), ("dying", 1)):
        _pull(s, c, f"p-{c}", seq)
        _commit(s, c, f"p-{c}", seq)
    _pull(s, "live", "next", 6)
    assert s.pins(0, 1) == [1, 4, 6]
    assert s.pins(0, 2) == []  # other generation
    time.sleep(0.3)
    assert s.pins(0, 1) == [4, 6]  # an expired lease pins nothing
    assert s.lease_remaining(["dying"]) == {"dying": 0.0}
    assert s.heartbeat("dying", 1.0) == pytest.approx(0.2)  # renewed with its own TTL
    assert s.consumers() == ["dying", "live"]
    s.register_rank(0, "host:1", 7)
    assert s.ranks()[0]["endpoint"] == "host:1" and s.ranks()[0]["generation"] == 7


def test_redis_restart_keeps_cursors_and_outage_is_bounded(tmp_path: Path) -> None:
    r = EmbeddedRedis(tmp_path / "r")
    r.start()
    s = OffsetStore.from_url(r.url, "m", attempts=3, backoff_s=0.05)
    _pull(s, "c", "p", 11)
    _commit(s, "c", "p", 11)
    r.stop(kill=True)
    t0 = time.monotonic()
    with pytest.raises(OffsetStoreError, match="unavailable during get_cursor"):
        s.get_cursor("c", 0)
    assert time.monotonic() - t0 < 10
    r2 = EmbeddedRedis(tmp_path / "r")  # same socket and password: the same URL
    r2.start()
    try:
        cur = s.get_cursor("c", 0)  # same client reconnects; the AOF kept the commit
        assert cur is not None and cur.seq == 11
    finally:
        r2.stop()


def test_a_refusing_redis_is_a_clear_error_not_a_crash(tmp_path: Path) -> None:
    """Redis answers but refuses (here: out of memory): OffsetStoreError with Redis' reason
    at once (the handlers turn it into UNAVAILABLE), no retries, nothing written."""
    r = EmbeddedRedis(tmp_path / "r", admin_commands=True)  # CONFIG, to fake an OOM
    r.start()
    try:
        s = OffsetStore.from_url(r.url, "m", attempts=3, backoff_s=5.0)
        _pull(s, "c", "p", 1)
        _commit(s, "c", "p", 1)
        s.client.config_set("maxmemory-policy", "noeviction")
        s.client.config_set("maxmemory", 1)
        t0 = time.monotonic()
        with pytest.raises(OffsetStoreError, match=r"refused record_pull: .*maxmemory"):
            _pull(s, "c", "q", 2)
        assert time.monotonic() - t0 < 4.0  # not retried (a retry would wait 5 s first)
        s.client.config_set("maxmemory", 0)
        cur = s.get_cursor("c", 0)
        assert cur is not None and cur.seq == 1
    finally:
        r.stop()


def test_forget_idle_drops_every_rank_of_a_silent_consumer(redis_server: EmbeddedRedis) -> None:
    s = OffsetStore.from_url(redis_server.url, "m")
    for c in ("gone", "alive", "recent"):
        s.register(c, 0.2 if c != "alive" else 60.0)
        for rank in (0, 1):
            s.record_pull(c, rank, PendingPull("p1", 1, 3, 30, "", 0))
            s.commit(c, rank, pull_id="p1", generation=1, seq=3, step=30)
        s.record_pull(c, 1, PendingPull("p2", 1, 4, 40, "", 0))  # pending on rank 1
    time.sleep(1.0)  # "gone" and "recent" leases expire; "alive" holds its lease
    s.heartbeat("recent", 0.2)  # heard of now, lease renewed ...
    time.sleep(1.0)  # ... and expired again: "recent" silent ~1 s, "gone" ~2 s
    assert s.forget_idle(2, idle_s=5.0) == []
    assert s.forget_idle(2, idle_s=1.5) == ["gone"]
    assert s.consumers() == ["alive", "recent"]
    for rank in (0, 1):
        assert s.get_cursor("gone", rank) is None
        assert s.pending_pulls(["gone"], rank)["gone"] is None
        assert s.get_cursor("alive", rank) is not None
    assert not s.client.hexists(s.keys.lease_ttl(), "gone")
    assert not s.client.hexists(s.keys.seen(), "gone")
    # a live lease is never forgotten, however long ago it was last heard of
    assert s.forget_idle(2, idle_s=0.0) == ["recent"]
    assert s.consumers() == ["alive"]
    # the forgotten consumer comes back as new: no cursor to commit against
    with pytest.raises(CommitRejected) as e:
        _commit(s, "gone", "p1", 3)
    assert e.value.reason == "no_consumer"


def test_forget_idle_starts_the_clock_of_a_consumer_never_seen(
    redis_server: EmbeddedRedis,
) -> None:
    s = OffsetStore.from_url(redis_server.url, "m")
    _pull(s, "old", "p1", 1)
    s.client.hdel(s.keys.seen(), "old")  # as written before ``seen`` existed
    assert s.forget_idle(1, idle_s=0.0) == []  # no time known: the clock starts now
    assert s.client.hexists(s.keys.seen(), "old")
    time.sleep(0.05)
    assert s.forget_idle(1, idle_s=0.01) == ["old"]


def test_records_deltad_did_not_write_touch_only_their_consumer(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 11: one cursor hash with ``seq abc`` broke ListConsumers and ``deltad status``
    for every credential, and retention logged a traceback every second. A record deltad did
    not write is taken as none: its consumer is served from the base (and its commit writes a
    good record), everyone else as before, one warning per record."""
    import redis
    from serverkit import Client, SpoolWriter, server_config
    from spoolkit import wait_for

    from deltad.keys import RedisKeys
    from deltad.serve.edge.app import SidecarServer
    from deltad.v1 import delta_pb2 as pb

    spool = SpoolWriter(tmp_path / "spool")
    for _ in range(3):
        spool.delta()
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    r = redis.Redis.from_url(redis_server.url)
    keys = RedisKeys("m")
    try:
        for name in ("good", "victim", "pulled", "ttl"):
            c.commit(c.pull(name, max_step=10))  # at seq 1
        hostile = {
            keys.cursor("victim", 0): {"seq": "abc"},
            keys.pull("pulled", 0): {"pull_id": "../../x", "seq": "2", "step": "x"},
        }
        for key, fields in hostile.items():
            r.hset(key, mapping=fields)
        r.hset(keys.lease_ttl(), "ttl", "-5")
        r.hset(keys.seen(), "ttl", "yesterday")
        # names no consumer can have, with live leases (review 13: they were listed, exported,
        # counted in the fleet's lag and could forge lines of `deltad status`)
        forged = ("bad name\nx", "evil\x1b[31mRED\x1b[0m\rgood")
        for name in forged:
            r.sadd(keys.consumers(), name)
            r.set(keys.lease(name), 30000, px=60000)
        r.hset(keys.ranks(), "not-a-rank", "{")
        r.hset(keys.ranks(), "9999999", '{"endpoint": "x"}')
        caplog.set_level("WARNING")
        for _ in range(3):  # listing, retention's pins and forgetting all go on
            answer = c.stub.ListConsumers(pb.ListConsumersRequest(), timeout=10)
            listed = {i.consumer: i for i in answer.consumers}
            assert listed["good"].cursor.seq == 1 and listed["victim"].cursor.seq == -1
            assert not set(forged) & set(listed)
            assert srv.store.pins(0, 1) == [1]  # good, pulled and ttl at 1; victim: none
            assert srv.store.forget_idle(1, 3600) == []
            srv.retention.run_once()
        assert 9999999 not in srv.store.ranks() and 0 in srv.store.ranks()
        assert forged[0] not in srv.store.consumers()
        assert any("no consumer names deltad takes" in m for m in caplog.messages)
        warned = [m for m in caplog.messages if "in Redis is malformed" in m]
        assert len(warned) == 2, warned  # victim's cursor, pulled's pull: once each
        # the victim is served from the base and its commit writes a good cursor again
        d = c.pull("victim")
        assert d.resync and d.cursor.seq == 3
        c.commit(d)
        assert srv.store.get_cursor("victim", 0).seq == 3  # type: ignore[union-attr]
        # a cursor bad in a field the old commit script did not read (step), of a consumer
        # pinned below it: served from the base up to its pin, and its commit is taken
        # (review 12: the script compared against it and answered "behind", forever)
        from deltad.serve import rollout as ro
        from deltad.serve.state.release import RolloutStore

        c.commit(c.pull("capped"))  # at seq 3
        r.hset(keys.cursor("capped", 0), mapping={"step": "abc", "updated_unix": "nan"})
        state = RolloutStore(r, "m").update(
            lambda s: ro.pin(s, group="capped", step=10, head_step=None)
        )
        wait_for(lambda: srv.rollout.state().version >= state.version, 10)
        d = c.pull("capped")
        assert d.resync and d.cursor.seq == 1
        c.commit(d)
        assert srv.store.get_cursor("capped", 0).seq == 1  # type: ignore[union-attr]
        # the one with a bad pull record pulls and commits on; a bad lease TTL renews by default
        c.commit(c.pull("pulled"))
        assert srv.store.get_cursor("pulled", 0).seq == 3  # type: ignore[union-attr]
        assert srv.store.heartbeat("ttl", 7.0) == pytest.approx(7.0)
        assert c.pull("good").cursor.seq == 3
    finally:
        c.close()
        srv.stop(0)


def test_two_deployments_under_one_model_name_in_one_redis_are_told(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 11: two sidecars of different trainers under the same --model (the default is
    "model") on one Redis silently shared every consumer's state, and the registry flipped
    between them. Each now says so once the other wrote the rank's entry since it did; a
    sidecar that restarts on a new address (the old entry just stale) is no conflict."""
    from serverkit import SpoolWriter, server_config

    from deltad.serve.edge.app import SidecarServer

    SpoolWriter(tmp_path / "a")
    SpoolWriter(tmp_path / "b")
    a = SidecarServer(server_config(tmp_path / "a", redis_server.url)).start()
    caplog.set_level("WARNING")
    try:
        a.upkeep.register_endpoint()  # alone: nothing to say
        assert a.metrics.registry_conflicts._value.get() == 0  # type: ignore[attr-defined]
        b = SidecarServer(server_config(tmp_path / "b", redis_server.url)).start()
        try:
            assert b.metrics.registry_conflicts._value.get() == 0  # type: ignore[attr-defined]
            a.upkeep.register_endpoint()  # b wrote since a did
            b.upkeep.register_endpoint()  # and a since b did
            for s in (a, b):
                assert s.metrics.registry_conflicts._value.get() == 1  # type: ignore[attr-defined]
            said = [m for m in caplog.messages if "registers model 'm' rank 0 in this" in m]
            assert len(said) == 2 and b.endpoint in said[0] and a.endpoint in said[1], said
        finally:
            b.stop(0)
    finally:
        a.stop(0)


def test_status_writes_no_control_character_to_the_terminal() -> None:
    """Review 13: names and reasons that come from Redis could carry CR and ANSI sequences
    that overwrite lines of `deltad status` on a terminal; they are shown escaped."""
    from deltad.commands import status
    from deltad.v1 import delta_pb2 as pb

    st = pb.StatusResponse(model="m", head_seq=-1, health_reason="down\x1b[2J\rfine")
    listed = pb.ListConsumersResponse(
        consumers=[pb.ConsumerInfo(consumer="a\x1b[31m\rb", cursor=pb.Cursor(seq=1))]
    )
    text = status.render(st, listed)
    assert "\x1b" not in text and "\r" not in text
    assert "a\\x1b[31m\\rb" in text and "down\\x1b[2J\\rfine" in text
