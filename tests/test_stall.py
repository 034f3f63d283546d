"""A GetDelta stream is bounded by the wait for its next message, not by its length: a
bootstrap that takes longer than ``rpc_deadline_s`` completes (before, every attempt was cut
at that deadline and the predictor never got its tables); a stream that stops moving is
cancelled within about ``rpc_deadline_s`` and the pull says why. Real sidecars (in-process and
a `deltad serve` process stopped with SIGSTOP), real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from serverkit import SpoolWriter, resumed
from spoolkit import child_env, read_serving_line, stop_process
from test_client import assert_tables, wait_head

from deltad.config import ConsumerConfig, ServerConfig
from deltad.consume.appliers import TensorDictApplier, _TensorStage
from deltad.consume.client import DeltaConsumer
from deltad.consume.window import ShardUpdate
from deltad.serve.edge.app import SidecarServer
from deltad.serve.windows.request import MIN_CHUNK_BYTES

pytestmark = pytest.mark.timeout(120)


class _SlowStage(_TensorStage):
    """A predictor that takes ``delay`` s to write each chunk of a resync (a busy model)."""

    def __init__(self, applier: SlowApplier) -> None:
        super().__init__(applier)
        self._slow = applier

    def _write(self, update: ShardUpdate) -> int:
        self._slow.writes += 1
        hook = self._slow.hooks.get(self._slow.writes)
        if hook is not None:
            hook()
        time.sleep(self._slow.delays.get(self._slow.writes, self._slow.delay))
        return super()._write(update)


class SlowApplier(TensorDictApplier):
    def __init__(
        self,
        delay: float,
        delays: dict[int, float] | None = None,
        hooks: dict[int, Callable[[], object]] | None = None,
    ) -> None:
        super().__init__()
        self.delay = delay
        self.delays = delays or {}  # write number -> its delay
        self.hooks = hooks or {}  # write number -> called before it
        self.writes = 0

    def stage(self) -> _TensorStage:
        return _SlowStage(self)


def _writer(root: Path, rows: int) -> SpoolWriter:
    w = SpoolWriter(root, tables={"t0": (rows, 8)})
    w.delta(n=10)
    return w


def _trainer_spool(root: Path, rows: int) -> dict[str, torch.Tensor]:
    return {"t0": _writer(root, rows).truth["t0"].clone()}


def full_stream_writes(srv: SidecarServer) -> int:
    """How many chunks a whole bootstrap of ``srv``'s window stages (one stream, no stall)."""
    with consumer("counter", srv, 30.0) as c:
        applier = SlowApplier(delay=0.0)
        r = c.sync(applier)
        assert r.resync and not r.missing, r.missing
        return applier.writes


def _sidecar(spool: Path, redis_url: str) -> SidecarServer:
    cfg = ServerConfig(
        spool_dir=spool, model="m", listen="127.0.0.1:0", redis_url=redis_url,
        poll_interval_s=0.02, grace_period_s=0.5, chunk_bytes=MIN_CHUNK_BYTES,
    )  # fmt: skip
    return SidecarServer(cfg).start()


def consumer(
    name: str,
    srv: SidecarServer,
    rpc_deadline_s: float,
    stream_deadline_s: float = 3600.0,
    max_retries: int = 2,
) -> DeltaConsumer:
    cfg = ConsumerConfig(
        consumer=name, model="m", sidecars=(srv.endpoint,), rpc_deadline_s=rpc_deadline_s,
        stream_deadline_s=stream_deadline_s, max_retries=max_retries, backoff_initial_s=0.05,
        heartbeat_interval_s=0.5,
    )  # fmt: skip
    return DeltaConsumer(cfg)


def test_a_bootstrap_longer_than_the_rpc_deadline_completes(tmp_path: Path, redis_url: str) -> None:
    truth = _trainer_spool(tmp_path, 20_000)  # 800 kB in 64 kB chunks: 13 of them
    srv = _sidecar(tmp_path, redis_url)
    try:
        with consumer("slow", srv, 0.6) as c:
            wait_head(c, [10])
            applier = SlowApplier(delay=0.15)  # ~2 s of stream, each message within 0.15 s
            t0 = time.monotonic()
            r = c.sync(applier)
            took = time.monotonic() - t0
            assert r.resync and not r.missing, r.missing
            assert applier.writes >= 10 and took > 0.6 * 2  # (longer than the old deadline)
            assert_tables(applier, truth)
    finally:
        srv.stop(0.5)


def test_a_stream_cut_at_the_stream_deadline_is_resumed_where_it_broke(
    tmp_path: Path, redis_url: str
) -> None:
    """Each message within ``rpc_deadline_s`` but the stream longer than
    ``stream_deadline_s`` (``deltad consume --stream-deadline``): the stream is cut there,
    and the retry goes on where it broke (GetDeltaRequest.resume); the bootstrap completes
    bit-equal, no chunk staged twice, even with no retries to spare (an attempt that brought
    messages does not use one up)."""
    truth = _trainer_spool(tmp_path, 20_000)
    srv = _sidecar(tmp_path, redis_url)
    try:
        whole = full_stream_writes(srv)
        assert whole >= 10
        with consumer("bounded", srv, 0.6, stream_deadline_s=1.0, max_retries=0) as c:
            applier = SlowApplier(delay=0.15)  # ~2 s of stream: cut at least once
            r = c.sync(applier)
            assert r.resync and not r.missing, r.missing
            assert_tables(applier, truth)
            assert applier.writes == whole  # every chunk staged once
        streams, skipped = resumed(srv)
        assert streams >= 1 and skipped >= 3, (streams, skipped)
    finally:
        srv.stop(0.5)


def test_a_predictor_stuck_on_a_chunk_gets_a_stall_and_the_stream_resumes(
    tmp_path: Path, redis_url: str
) -> None:
    """A chunk that takes the predictor 2 s (rpc_deadline_s 0.5): the stream is cancelled
    as stalled, and the retry continues after the chunks already staged, in the same pull."""
    truth = _trainer_spool(tmp_path, 20_000)
    srv = _sidecar(tmp_path, redis_url)
    try:
        whole = full_stream_writes(srv)
        with consumer("stuck", srv, 0.5) as c:
            applier = SlowApplier(delay=0.0, delays={3: 2.0})  # the third write takes 2 s
            r = c.sync(applier)
            assert r.resync and not r.missing, r.missing
            assert_tables(applier, truth)
            assert applier.writes == whole
        assert resumed(srv) == (1, 3)  # the three chunks staged were not sent again
    finally:
        srv.stop(0.5)


def test_a_stream_that_cannot_be_resumed_spoils_the_pull_and_the_next_heals(
    tmp_path: Path, redis_url: str
) -> None:
    """The trainer restarts (a new generation) while the predictor is stuck on a chunk: the
    broken window is not served any more, so the retry cannot continue it; the pull says
    why and installs nothing, and the next pull bootstraps the new generation bit-equal."""
    w = _writer(tmp_path, 20_000)
    srv = _sidecar(tmp_path, redis_url)
    try:
        with consumer("restarted", srv, 0.5) as c:
            wait_head(c, [10])
            applier = SlowApplier(
                delay=0.0, delays={3: 2.0}, hooks={3: lambda: w.start_generation(2, 100)}
            )
            r = c.sync(applier)
            assert not r.deltas and 0 in r.missing, r.missing
            why = r.missing[0]
            assert "broke after staging rows" in why and "stalled" in why, why
            assert "no message for 0.5 s" in why, why
            assert "generation 2" in why and "from its start" in why, why
            assert applier.tables() == {}  # nothing of the broken stream was installed
            r = c.sync(applier)  # the next pull starts over and heals
            assert r.resync and not r.missing and r.deltas[0].generation == 2
            assert_tables(applier, {"t0": w.truth["t0"]})
        assert resumed(srv) == (0, 0)
    finally:
        srv.stop(0.5)


@pytest.mark.slow
def test_a_sidecar_that_stops_sending_is_given_up_within_the_stall_bound(
    tmp_path: Path, redis_url: str
) -> None:
    """`deltad serve` stopped (SIGSTOP) in the middle of a 40 MB bootstrap: the consumer's
    overall deadline is an hour, yet the pull returns a few rpc_deadline_s later, saying the
    stream stalled; continued (SIGCONT), the next pull brings the tables bit-equal. (The
    StalledStream's code is DEADLINE_EXCEEDED: retried like one.)"""
    truth = _trainer_spool(tmp_path, 1_000_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path), "--model", "m",
         "--listen", "127.0.0.1:0", "--redis-url", redis_url, "--chunk-bytes",
         str(256 * 1024)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        start_new_session=True,
    )  # fmt: skip
    resumed = threading.Event()
    try:
        endpoint = read_serving_line(proc, 60.0)
        cfg = ConsumerConfig(
            consumer="stopped", model="m", sidecars=(endpoint,), rpc_deadline_s=1.0,
            max_retries=1, backoff_initial_s=0.05, heartbeat_interval_s=0.5,
        )  # fmt: skip
        with DeltaConsumer(cfg) as c:
            wait_head(c, [10])
            applier = SlowApplier(delay=0.02)  # 160 chunks: ~3 s of stream

            def stop_then_resume() -> None:
                while applier.writes < 20:
                    time.sleep(0.005)
                os.kill(proc.pid, signal.SIGSTOP)
                resumed.wait(30.0)
                os.kill(proc.pid, signal.SIGCONT)

            t = threading.Thread(target=stop_then_resume, daemon=True)
            t.start()
            t0 = time.monotonic()
            r = c.sync(applier)
            took = time.monotonic() - t0
            resumed.set()
            t.join(10.0)
            assert not r.deltas and "stalled" in r.missing.get(0, ""), r.missing
            assert took < 20.0, took  # (the sidecar stayed stopped for up to 30 s)
            assert applier.tables() == {}
            applier.delay = 0.0
            r = c.sync(applier)
            assert r.resync and not r.missing, r.missing
            assert_tables(applier, truth)
    finally:
        resumed.set()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop_process(proc)


def test_a_forked_child_starts_its_own_watchdog() -> None:
    """A child forked while the watchdog runs (e.g. a predictor's worker processes) starts its
    own at its first watched stream, instead of counting on a thread it does not have."""
    from deltad.consume import stall

    dog = stall._WATCHDOG
    held = stall._Watched(None, 1e9)
    dog.add(held)
    try:
        assert dog._thread is not None and dog._thread.is_alive()
        pid = os.fork()
        if pid == 0:  # the child: nothing watched, no thread; a new stream starts one
            ok = dog._thread is None and not dog._watched
            dog.add(stall._Watched(None, 1e9))
            ok = ok and dog._thread is not None and dog._thread.is_alive()
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 10.0  # (a child stuck on the parent's lock: killed)
        done, status = os.waitpid(pid, os.WNOHANG)
        while not done and time.monotonic() < deadline:
            time.sleep(0.02)
            done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done and os.waitstatus_to_exitcode(status) == 0, "the child's watchdog"
    finally:
        dog.remove(held)


def test_a_predictor_busy_longer_than_the_pings_keeps_its_stream(
    tmp_path: Path, redis_url: str
) -> None:
    """Keepalive pings both ways (``knobs.KEEPALIVE_S``, ``SERVER_KEEPALIVE_S``) with a 1 s
    answer bound (``PING_TIMEOUT_S``), and a predictor that stops reading its bootstrap for 4 s
    (a chunk that takes that long to stage): the pings are answered by gRPC on both sides
    whether or not the application reads, so the stream is neither closed nor resumed."""
    from deltad import knobs

    # 48 MB: far more than gRPC's flow-control windows and the socket buffers hold, so the
    # sidecar is blocked on the predictor for the whole pause
    truth = _trainer_spool(tmp_path, 1_500_000)
    with knobs.override(KEEPALIVE_S=1.0, SERVER_KEEPALIVE_S=1.0, PING_TIMEOUT_S=1.0):
        srv = _sidecar(tmp_path, redis_url)
        try:
            with consumer("busy", srv, 10.0) as c:
                wait_head(c, [10])
                applier = SlowApplier(delay=0.0, delays={2: 4.0})
                r = c.sync(applier)
                assert r.resync and not r.missing, r.missing
                assert_tables(applier, truth)
                assert resumed(srv) == (0.0, 0.0)  # one stream, never broken
        finally:
            srv.stop(0.5)
