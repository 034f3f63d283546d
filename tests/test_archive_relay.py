"""A relay that follows the archive instead of an upstream sidecar (`deltad serve
--upstream-archive`), against a real SeaweedFS: its predictors get the trainer's log with the
trainer's cursors, bit-equal; a hold archived with the log holds them; the trainer's sidecar
going away leaves them served; a trainer restart reaches them as a new generation; a relay
restarted on an empty spool comes back without sending its predictors back."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from s3kit import Seaweed, archive_url, s3_env, seaweed  # noqa: F401
from serverkit import MODEL, SpoolWriter, server_config, wait_for
from spoolkit import child_env
from test_relay import db, equal, predictor, status
from test_rollback import Release

from deltad.config import ArchiveFollowConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.archived import ArchiveRelayServer

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("s3_env")]


def _relay(
    root: Path, redis_url: str, url: str, endpoint: str, port: int = 0
) -> ArchiveRelayServer:
    cfg = server_config(root, db(redis_url, 1), grace_period_s=0.2, listen=f"127.0.0.1:{port}")
    follow = ArchiveFollowConfig(url, endpoint=endpoint, poll_interval_s=0.05, fsync=False)
    return ArchiveRelayServer(cfg, follow).start()


def _head(endpoint: str) -> tuple[int, int, int]:
    st = status(endpoint)
    return st.generation, st.head_seq, st.head_step


def test_a_relay_following_the_archive_serves_the_trainers_log_and_holds_with_the_fleet(
    tmp_path: Path,
    redis_url: str,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    url = archive_url()
    release = Release(redis_url)
    side = SidecarServer(
        server_config(
            tmp_path / "spool", redis_url, archive_url=url, archive_endpoint=seaweed.endpoint,
            grace_period_s=0.2,
        )
    ).start()  # fmt: skip
    release.watch(side)
    relay: ArchiveRelayServer | None = None
    try:
        for _ in range(3):
            spool.delta()
        relay = _relay(tmp_path / "relay", redis_url, url, seaweed.endpoint)
        wait_for(lambda: _head(relay.endpoint) == (1, 3, 30), 30, "the relay at the head")
        assert status(relay.endpoint).upstream == url
        applier = TensorDictApplier()
        with predictor("p", [relay.endpoint], dense=False) as c:
            r = c.sync(applier)
            assert r.deltas[0].resync and equal(applier, spool.truth)
            for _ in range(2):
                spool.delta()
            wait_for(lambda: _head(relay.endpoint)[1] == 5, 30, "seq 5 at the relay")
            r = c.sync(applier)
            (d,) = r.deltas
            assert not d.resync and (d.from_seq, d.to_seq) == (3, 5)  # the trainer's seqs
            assert equal(applier, spool.truth)
            at_50 = {t: v.clone() for t, v in spool.truth.items()}

            # a hold reaches the relay through the archive: nothing past it is served
            release.change(lambda st: replace(st, release_step=50, held=True))
            for _ in range(2):
                spool.delta()
            wait_for(lambda: _head(relay.endpoint)[1] == 7, 30, "seq 7 at the relay")
            wait_for(lambda: status(relay.endpoint).cap_step == 50, 30, "the hold at the relay")
            r = c.sync(applier)
            assert r.step == 50 and all(d.to_step == 50 for d in r.deltas)
            assert equal(applier, at_50)
            release.release()
            wait_for(lambda: status(relay.endpoint).cap_step < 0, 30, "the release at the relay")
            r = c.sync(applier)
            (d,) = r.deltas
            assert not d.resync and (d.from_seq, d.to_seq) == (5, 7)
            assert equal(applier, spool.truth)

            # the trainer's sidecar goes away: the relay serves what the archive holds
            side.stop(0)
            fresh = TensorDictApplier()
            with predictor("q", [relay.endpoint], dense=False) as q:
                q.sync(fresh)
            assert equal(fresh, spool.truth)

            # the trainer restarts (a new generation) and its sidecar comes back
            spool.start_generation(2, start_step=spool.step)
            spool.delta()
            side = SidecarServer(
                server_config(
                    tmp_path / "spool", redis_url, archive_url=url,
                    archive_endpoint=seaweed.endpoint, grace_period_s=0.2,
                )
            ).start()  # fmt: skip
            wait_for(lambda: _head(relay.endpoint)[:2] == (2, 1), 30, "generation 2 at the relay")
            r = c.sync(applier)
            assert r.deltas and r.deltas[0].generation == 2
            assert equal(applier, spool.truth)
    finally:
        if relay is not None:
            relay.stop(0)
        side.stop(0)


def test_a_relay_on_an_empty_spool_follows_the_archive_again_without_a_resync(
    tmp_path: Path,
    redis_url: str,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    url = archive_url()
    side = SidecarServer(
        server_config(tmp_path / "spool", redis_url, archive_url=url,
                      archive_endpoint=seaweed.endpoint)
    ).start()  # fmt: skip
    try:
        for _ in range(3):
            spool.delta()
        relay = _relay(tmp_path / "relay", redis_url, url, seaweed.endpoint)
        port = relay.port
        applier = TensorDictApplier()
        with predictor("p", [relay.endpoint], dense=False) as c:
            try:
                wait_for(lambda: _head(relay.endpoint)[1] == 3, 30, "the relay at seq 3")
                c.sync(applier)
            finally:
                relay.stop(0)
            shutil.rmtree(tmp_path / "relay")  # a new node for the relay
            spool.delta()
            relay = _relay(tmp_path / "relay", redis_url, url, seaweed.endpoint, port)
            try:
                wait_for(lambda: _head(relay.endpoint)[1] == 4, 30, "the relay at seq 4")
                r = c.sync(applier)
                (d,) = r.deltas
                # its cursor (in the relay's Redis) names the trainer's seqs: still valid
                assert not d.resync and (d.from_seq, d.to_seq) == (3, 4)
                assert equal(applier, spool.truth)
            finally:
                relay.stop(0)
    finally:
        side.stop(0)


def test_deltad_serve_upstream_archive_refuses_bad_flags(tmp_path: Path) -> None:
    def serve(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deltad.commands.main", "serve", "--spool",
             str(tmp_path / "s"), "--model", MODEL, *flags],
            capture_output=True, text=True, env=child_env(), timeout=60,
        )  # fmt: skip

    got = serve("--upstream-archive", "http://bucket/x")
    assert got.returncode == 2 and "give s3://BUCKET/PREFIX or file:///PATH" in got.stderr
    got = serve("--upstream-archive", "s3://b/p", "--upstream", "127.0.0.1:1")
    assert got.returncode == 2 and "a relay follows one of them" in got.stderr
    got = serve("--upstream-archive", "s3://b/p", "--archive", "s3://b/q")
    assert got.returncode == 2 and "does not write it" in got.stderr


def test_a_relay_whose_store_fails_says_it_lost_its_upstream_until_the_store_is_whole(
    tmp_path: Path, redis_url: str
) -> None:
    """Rounds that fail (here the store serves a corrupted manifest: a shared file system
    archive) for 10 s make the relay say it lost its upstream, in Status, in every window
    (a predictor behind it is not caught up) and in `deltad_upstream_lost`; once the store
    is whole again it says nothing."""
    spool = SpoolWriter(tmp_path / "spool")
    url = f"file://{tmp_path / 'mount'}"
    side = SidecarServer(server_config(tmp_path / "spool", redis_url, archive_url=url)).start()
    try:
        spool.delta()
        manifest = tmp_path / "mount" / MODEL / "rank-00000" / "manifest.json"
        wait_for(lambda: b'"seq":1,' in (manifest.read_bytes() if manifest.exists() else b""),
                 20, "seq 1 archived")  # fmt: skip
    finally:
        side.stop(0)  # (nothing moves the manifest any more)
    cfg = server_config(tmp_path / "relay", db(redis_url, 1), metrics_port=0)
    relay = ArchiveRelayServer(cfg, ArchiveFollowConfig(url, poll_interval_s=0.05, fsync=False))
    relay.start()
    try:
        wait_for(lambda: _head(relay.endpoint)[1] == 1, 20, "the relay at seq 1")
        labels = {"model": MODEL, "rank": "0"}
        lost = relay.server.metrics.registry.get_sample_value
        assert lost("deltad_upstream_lost", labels) == 0.0
        good = manifest.read_bytes()
        manifest.write_bytes(b"{not a manifest")
        wait_for(lambda: status(relay.endpoint).upstream_lost, 30, "the relay lost")
        assert lost("deltad_upstream_lost", labels) == 1.0
        assert "relay lost its archive" in status(relay.endpoint).upstream_lost
        with predictor("p", [relay.endpoint], dense=False) as c:
            r = c.pull()
            assert r.upstream_lost and not r.caught_up
        manifest.write_bytes(good)
        wait_for(lambda: not status(relay.endpoint).upstream_lost, 30, "the store whole again")
        assert lost("deltad_upstream_lost", labels) == 0.0
    finally:
        relay.stop(0)
