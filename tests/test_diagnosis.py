"""Diagnosis that says what is wrong, soon (issue 37, item 5): a hung offset store (a real
redis-server stopped with SIGSTOP, not dead) turns readiness NOT_SERVING within a bound, and
every call that needs it answers UNAVAILABLE naming it before the caller's deadline; the CLI
names what did not answer; /metrics exports no ``*_created`` series and ends the worst lag's
name in its unit; quantize_model() without torchrec is the install hint. Real sidecars and
Redis servers."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from serverkit import SpoolWriter, server_config
from spoolkit import child_env, wait_for

from deltad.commands.healthcheck import LIVENESS_SERVICE, check
from deltad.errors import ConfigError
from deltad.needs import install_hint
from deltad.serve.edge.app import SidecarServer
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

#: Readiness must turn NOT_SERVING within this of the store hanging (the probe's two misses
#: of 1 s each take ~2.5 s; the rest is room for a loaded machine). A correctness bound.
NOT_SERVING_BOUND_S = 5.0


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """``deltad ARGV`` in this process (no sidecar runs in it): its exit code and its stderr
    lines."""
    from deltad.commands.main import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        rc = main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return rc, capsys.readouterr().err.strip().splitlines()


def _command(argv: list[str]) -> tuple[int, list[str]]:
    """``deltad ARGV`` as a process of its own: its exit code and its stderr lines."""
    p = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", *argv],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )  # fmt: skip
    return p.returncode, p.stderr.strip().splitlines()


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The process ``pid`` stopped (SIGSTOP: alive, answering nothing) inside the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def embedded_sidecar(tmp_path: Path) -> Iterator[SidecarServer]:
    """A sidecar with its own embedded redis-server (stopping the shared one would harm the
    tests after this one)."""
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", None, metrics_port=0)).start()
    try:
        yield srv
    finally:
        srv.stop(0)


def _store_pid(srv: SidecarServer) -> int:
    assert srv._embedded is not None
    pid = srv._embedded.pid()
    assert pid is not None
    return pid


def test_a_hung_offset_store_turns_readiness_not_serving_within_the_bound(
    embedded_sidecar: SidecarServer,
) -> None:
    srv = embedded_sidecar
    ep = srv.endpoint
    assert check(ep, timeout_s=5.0) == "SERVING"
    with _stopped(_store_pid(srv)):
        t0 = time.monotonic()
        wait_for(lambda: check(ep, timeout_s=5.0) == "NOT_SERVING", 30, "NOT_SERVING")
        took = time.monotonic() - t0
        assert took <= NOT_SERVING_BOUND_S, f"readiness took {took:.1f} s"
        assert check(ep, service=LIVENESS_SERVICE, timeout_s=5.0) == "SERVING"  # alive
        with grpc.insecure_channel(ep) as ch:
            stub = pb_grpc.DeltaServiceStub(ch)
            reason = stub.Status(pb.StatusRequest(), timeout=10).health_reason
            assert "the offset store at unix://" in reason and "did not answer in 1 s" in reason
            assert "password=***" in reason and str(srv.config.spool_dir) not in reason
            # a call that needs the store: UNAVAILABLE naming it, long before its deadline
            t1 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.ListConsumers(pb.ListConsumersRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "the offset store at unix://" in str(e.value.details())
            assert "did not answer in 2 s" in str(e.value.details())
            assert time.monotonic() - t1 < 10
    wait_for(lambda: check(ep, timeout_s=5.0) == "SERVING", 30, "SERVING again")
    assert srv._embedded is not None and srv._embedded.restarts == 0  # hung is not dead


@pytest.mark.slow  # (two commands as processes of their own: ~3 s each on a loaded machine)
def test_the_commands_name_the_offset_store_that_did_not_answer(
    embedded_sidecar: SidecarServer,
) -> None:
    """`deltad status` and `deltad rollout` with the store hung: one line each naming it, no
    bare DEADLINE_EXCEEDED (as processes of their own, as an operator runs them)."""
    ep = embedded_sidecar.endpoint
    with _stopped(_store_pid(embedded_sidecar)):
        wait_for(lambda: check(ep, timeout_s=5.0) == "NOT_SERVING", 30, "NOT_SERVING")
        rc, err = _command(["status", "--target", ep])
        assert rc == 2 and len(err) == 1, err
        assert "UNAVAILABLE: the offset store at unix://" in err[0], err
        assert "did not answer in 2 s" in err[0] and "DEADLINE_EXCEEDED" not in err[0], err
        rc, err = _command(["rollout", "pin", "--group", "canary-*", "--step", "0", "--target", ep])  # fmt: skip
        assert rc == 2 and len(err) == 1, err
        assert "the offset store at unix://" in err[0] and "did not answer in 2 s" in err[0], err


def test_a_call_made_as_the_store_hangs_answers_before_the_callers_deadline(
    embedded_sidecar: SidecarServer,
) -> None:
    """Before the probe has seen the hang, a call retries the store only while an answer can
    still reach its caller: UNAVAILABLE naming the store, never the caller's own
    DEADLINE_EXCEEDED (3 s: one 2 s attempt fits, a second does not)."""
    srv = embedded_sidecar
    with grpc.insecure_channel(srv.endpoint) as ch:
        stub = pb_grpc.DeltaServiceStub(ch)
        stub.ListConsumers(pb.ListConsumersRequest(), timeout=10)  # (connected, answering)
        with _stopped(_store_pid(srv)):
            with pytest.raises(grpc.RpcError) as e:
                stub.ListConsumers(pb.ListConsumersRequest(), timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "did not answer in 2 s" in str(e.value.details())


def test_a_sidecar_that_does_not_answer_is_named_with_the_time_waited(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A listening socket that never answers (as a stopped sidecar): the command says which
    sidecar did not answer in how long, not a bare DEADLINE_EXCEEDED."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        target = f"127.0.0.1:{s.getsockname()[1]}"
        for argv in (["status"], ["rollout", "status"]):
            rc, err = _cli([*argv, "--target", target, "--timeout", "1"], capsys)
            assert rc == 2 and len(err) == 1, err
            assert f"the sidecar at {target} did not answer in 1 s" in err[0], err


def test_metrics_export_no_created_series_and_the_worst_lag_ends_in_its_unit(
    embedded_sidecar: SidecarServer,
) -> None:
    port = embedded_sidecar.metrics_port
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    names = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and ln[0] != "#"}
    assert "deltad_consumer_lag_max_seconds" in names
    assert "deltad_consumer_lag_seconds_max" not in text
    assert not [n for n in names if n.endswith("_created")], sorted(names)
    assert "deltad_rpc_requests_total" in text or "deltad_served_bytes_total" in names


def test_quantize_model_without_torchrec_is_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deltad import quantize_model

    monkeypatch.setitem(sys.modules, "torchrec", None)  # import torchrec fails, as uninstalled
    with pytest.raises(ConfigError) as e:
        quantize_model(torch.nn.Linear(2, 2), "int8")
    assert "quantize_model() needs torchrec" in str(e.value)
    assert install_hint("torchrec") in str(e.value)
