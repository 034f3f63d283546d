"""Predictors cold-start without the trainer: with the trainer's sidecars down, a predictor
starting from the archive serves the archived state at once (held where the fleet is held:
the release state is archived with every manifest), and joins the log when a sidecar answers
again: only the rows it lacks, or that rank's full tables if the log moved to another
generation. A real sidecar, Redis and a shared-file-system archive."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from serverkit import MODEL, SpoolWriter, server_config, wait_for
from spoolkit import child_env
from test_rollback import Release

from deltad.config import ConsumerConfig, PullOptions
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.consume.coldstart import ColdStartUnavailable, cold_start, resumed
from deltad.serve.archive.fetch import read_manifest
from deltad.serve.archive.layout import ArchiveManifest
from deltad.serve.archive.opening import open_store
from deltad.serve.edge.app import SidecarServer

pytestmark = pytest.mark.timeout(120)


def _archived(url: str) -> ArchiveManifest | None:
    store = open_store(url)
    try:
        return read_manifest(store, MODEL, 0)
    finally:
        store.close()


def _release(url: str) -> str:
    """The release state archived with rank 0's manifest ("" if none)."""
    m = _archived(url)
    return str(m.extra.get("release", "")) if m is not None else ""


def _sidecar(spool: SpoolWriter, redis_url: str, url: str, port: int = 0) -> SidecarServer:
    cfg = server_config(
        spool.layout.root, redis_url, archive_url=url, listen=f"127.0.0.1:{port}",
        grace_period_s=0.2,
    )  # fmt: skip
    return SidecarServer(cfg).start()


def _archived_at(url: str, seq: int) -> None:
    wait_for(lambda: (m := _archived(url)) is not None and m.head.seq == seq, 20, f"seq {seq}")


def _equal(tables: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> bool:
    return tables.keys() == truth.keys() and all(torch.equal(tables[t], truth[t]) for t in truth)


def _config(port: int, url: str) -> ConsumerConfig:
    return ConsumerConfig(
        "cold", model=MODEL, sidecars=(f"127.0.0.1:{port}",), pull=PullOptions(dense=False),
        bootstrap_from=url, max_retries=1, backoff_initial_s=0.05, backoff_max_s=0.2,
    )  # fmt: skip


def test_a_predictor_starts_from_the_store_with_the_sidecar_down_and_joins_the_log_later(
    tmp_path: Path, redis_url: str
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    url = f"file://{tmp_path / 'mount'}"
    srv = _sidecar(spool, redis_url, url)
    port = srv.port
    for _ in range(3):
        spool.delta()
    _archived_at(url, 3)
    srv.stop(0)  # the trainer's node is down: its sidecar does not answer

    cfg = _config(port, url)
    applier = TensorDictApplier()
    state = cold_start(cfg, applier)
    assert state.pending == (0,) and (state.generation, state.step) == (1, spool.step)
    assert state.release_cap is None  # everything released
    assert _equal(applier.tables(), spool.truth)  # served from the store alone

    for _ in range(2):  # the trainer comes back and publishes before its sidecar is up
        spool.delta()
    srv = _sidecar(spool, redis_url, url, port)
    try:
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == 5, 10, "seq 5")
        with DeltaConsumer(resumed(cfg, state)) as c:
            r = c.sync(applier)
            (d,) = r.deltas
            assert not d.resync and (d.from_seq, d.to_seq) == (3, 5)  # only the tail
            assert _equal(applier.tables(), spool.truth)
            spool.delta()
            wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == 6, 10, "6")
            r = c.sync(applier)  # the state was told once: the cursor goes on from there
            (d,) = r.deltas
            assert not d.resync and (d.from_seq, d.to_seq) == (5, 6)
            assert _equal(applier.tables(), spool.truth)
    finally:
        srv.stop(0)


def test_a_held_fleet_holds_a_predictor_started_from_the_store_without_its_sidecar(
    tmp_path: Path, redis_url: str
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    url = f"file://{tmp_path / 'mount'}"
    release = Release(redis_url)
    srv = _sidecar(spool, redis_url, url)
    port = srv.port
    release.watch(srv)
    spool.delta()  # step 10
    at_10 = {t: v.clone() for t, v in spool.truth.items()}
    for _ in range(2):
        spool.delta()
    _archived_at(url, 3)
    release.change(lambda st: replace(st, release_step=10, held=True))  # a bad update after 10
    wait_for(lambda: '"held":true' in _release(url), 20, "the hold in the archive")
    srv.stop(0)

    applier = TensorDictApplier()
    state = cold_start(_config(port, url), applier)
    assert state.release_cap == 10 and state.step == 10 and state.pending == (0,)
    assert _equal(applier.tables(), at_10)  # the held step, not the newest archived one
    # a canary group follows the head: a canary starting from the store gets it
    release.change(lambda st: replace(st, canary=("cold-canary*",)))
    srv = _sidecar(spool, redis_url, url, port)
    release.watch(srv)
    try:
        wait_for(lambda: "cold-canary" in _release(url), 20, "the canary group archived")
    finally:
        srv.stop(0)
    canary = TensorDictApplier()
    st2 = cold_start(replace(_config(port, url), consumer="cold-canary-1"), canary)
    assert st2.step == spool.step and _equal(canary.tables(), spool.truth)
    # released past a generation the archive does not hold: nothing to start from
    release.change(lambda st: replace(st, canary=(), release_step=10, release_generation=9))
    srv = _sidecar(spool, redis_url, url, port)
    release.watch(srv)
    try:
        wait_for(lambda: '"release_generation":9' in _release(url), 20, "generation 9")
    finally:
        srv.stop(0)
    with pytest.raises(ColdStartUnavailable, match="not released"):
        cold_start(_config(port, url), TensorDictApplier())


def test_a_sidecar_back_with_another_generation_sends_the_full_tables(
    tmp_path: Path, redis_url: str
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    url = f"file://{tmp_path / 'mount'}"
    srv = _sidecar(spool, redis_url, url)
    port = srv.port
    for _ in range(2):
        spool.delta()
    _archived_at(url, 2)
    srv.stop(0)
    cfg = _config(port, url)
    applier = TensorDictApplier()
    state = cold_start(cfg, applier)
    assert state.pending == (0,)
    spool.start_generation(2)  # the trainer restarted from scratch meanwhile
    spool.delta()
    srv = _sidecar(spool, redis_url, url, port)
    try:
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.generation == 2, 10, "gen 2")
        with DeltaConsumer(resumed(cfg, state)) as c:
            r = c.sync(applier)  # the held state is refused: nothing applied, nothing lost
            assert not r.deltas and "held state" in r.missing[0]
            r = c.sync(applier)
            (d,) = r.deltas
            assert d.resync and d.generation == 2
            assert _equal(applier.tables(), spool.truth)
    finally:
        srv.stop(0)


def test_deltad_consume_bootstrap_from_serves_the_store_with_the_sidecar_down(
    tmp_path: Path, redis_url: str
) -> None:
    """`deltad consume --bootstrap-from` with every sidecar down: no wait for them, the
    archived state is what the predictor holds, and the run ends 0 with it written."""
    spool = SpoolWriter(tmp_path / "spool")
    url = f"file://{tmp_path / 'mount'}"
    srv = _sidecar(spool, redis_url, url)
    port = srv.port
    for _ in range(3):
        spool.delta()
    _archived_at(url, 3)
    srv.stop(0)
    final = tmp_path / "final.pt"
    got = subprocess.run(
        [
            sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "cold",
            "--model", MODEL, "--sidecar", f"127.0.0.1:{port}", "--pulls", "1",
            "--bootstrap-from", url, "--final-tables", str(final), "--max-retries", "0",
            "--rpc-deadline", "2",
        ],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    out = got.stdout + got.stderr
    assert got.returncode == 0, out
    assert "the sidecars of ranks [0] do not answer: serving it" in out
    assert f"step {spool.step}" in out
    tables = torch.load(final, weights_only=True)
    assert _equal(tables, spool.truth)
