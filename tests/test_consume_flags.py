"""`deltad consume` refuses a flag its form would ignore (--k / --fraction without --form
topk, a serving-model flag without --serve-dtype): one stderr line naming the flag and what it
goes with, exit 2, before anything connects; the combinations the demo, the benchmarks and
the compose file use still pass. A signal while it waits for the sidecars ends the wait at
once and says so: SIGINT exit 130, SIGTERM (a clean stop, nothing pulled) exit 0."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from deltad.reference.consumers import cli as consume_cli
from serverkit import redis_server
from spoolkit import child_env, wait_for

from deltad.commands import main as cli
from deltad.demo import SERVING, TABLES
from deltad.demo.rollout import CANARY_PRED, MAIN_PRED
from deltad.errors import ConfigError
from deltad.store import EmbeddedRedis

__all__ = ["redis_server"]

pytestmark = pytest.mark.timeout(120)


def _consume_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["consume"]


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A listening TCP socket nobody accepts on: a connection attempt shows in its backlog."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        yield s, f"127.0.0.1:{s.getsockname()[1]}"


TOPK = [("--k", "5"), ("--fraction", "0.5")]
SERVING_FLAGS = [
    ("--tables", "2"), ("--rows", "100"), ("--seq-rows", "100"), ("--dim", "8"),
    ("--consistency", "window"), ("--chunk-rows", "64"), ("--serve-batch-size", "8"),
    ("--serve-interval", "0.01"), ("--seed", "1"), ("--zch-slots", "0"),
    ("--zch-raw-ids", "10"), ("--zch-policy", "lfu"), ("--final-state", "state.pt"),
]  # fmt: skip


@pytest.mark.parametrize("form", [None, "rows", "ids"])
@pytest.mark.parametrize(("flag", "value"), TOPK)
def test_a_topk_flag_without_form_topk_is_one_line_and_exit_2_before_connecting(
    capsys: pytest.CaptureFixture[str],
    listener: tuple[socket.socket, str],
    form: str | None,
    flag: str,
    value: str,
) -> None:
    sock, endpoint = listener
    argv = ["consume", "--consumer", "c", "--sidecar", endpoint, "--discovery-timeout", "1"]
    argv += [flag, value]
    argv += ["--form", form] if form else []
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{flag} goes with --form topk (--form {form or 'rows'} ignores it)" in err[0], err
    with pytest.raises(BlockingIOError):  # nothing connected to the sidecar
        sock.accept()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--serve-dtype", "int8"], "--form ids carries no values to serve"),
        (["--serve-dtype", "int4", "--zch-slots", "8"], "--form ids carries no values to serve"),
        (["--final-tables", "t.pt"], "--form ids applies no values: --final-tables"),
    ],
)
def test_form_ids_with_a_serving_model_or_tables_is_one_line_and_exit_2_before_connecting(
    capsys: pytest.CaptureFixture[str],
    listener: tuple[socket.socket, str],
    tmp_path: Path,
    extra: list[str],
    message: str,
) -> None:
    """Review 3 (stop 34) #1: `--serve-dtype int8 --form ids` served and saved a model that
    never got a row (exit 0); the ids form carries no values, so it is refused, as is
    writing tables it never filled."""
    sock, endpoint = listener
    extra = [str(tmp_path / x) if x.endswith(".pt") else x for x in extra]
    argv = ["consume", "--consumer", "c", "--sidecar", endpoint, "--discovery-timeout", "1"]
    assert cli.main([*argv, "--form", "ids", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    with pytest.raises(BlockingIOError):
        sock.accept()


@pytest.mark.parametrize(("flag", "value"), SERVING_FLAGS)
def test_a_serving_flag_without_serve_dtype_is_one_line_and_exit_2_before_connecting(
    capsys: pytest.CaptureFixture[str],
    listener: tuple[socket.socket, str],
    tmp_path: Path,
    flag: str,
    value: str,
) -> None:
    sock, endpoint = listener
    if flag == "--final-state":
        value = str(tmp_path / value)
    argv = ["consume", "--consumer", "c", "--sidecar", endpoint, "--discovery-timeout", "1"]
    argv += ["--form", "topk", "--k", "3"]
    assert cli.main([*argv, flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{flag} needs --serve-dtype" in err[0], err
    with pytest.raises(BlockingIOError):
        sock.accept()


def test_every_serving_flag_is_checked() -> None:
    """A flag added to the serving-model group is refused without --serve-dtype too."""
    (group,) = [g for g in _consume_parser()._action_groups if g.title == "serving model"]
    dests = {a.dest for a in group._group_actions} - {"serve_dtype"}
    assert dests == set(consume_cli.SERVING_ONLY)
    assert {f for f, _ in SERVING_FLAGS} == {
        a.option_strings[0] for a in group._group_actions if a.dest != "serve_dtype"
    }


#: the consume argv tails of deltad/demo/loop.py, deltad/demo/rollout.py, bench/live.py,
#: bench/fidelity.py and docker/compose.yaml
USED = [
    ["--form", "rows", "--dtype", "fp32"],
    ["--form", "topk", "--fraction", "0.1", "--dtype", "int8"],
    ["--form", "rows", "--serve-dtype", "int8", "--tables", TABLES, "--rows", "20000",
     "--dim", "16", "--serve-interval", "0.01", "--final-state", f"{SERVING}-state.pt"],
    ["--form", "rows"],
    ["--form", "rows", "--dtype", "int8"],
    ["--form", "topk", "--k", "16"],
    ["--form", "topk", "--k", "16", "--dtype", "int8"],
    ["--form", "topk", "--fraction", "0.25", "--dtype", "int8"],
    ["--form", "topk", "--k", "5", "--fraction", "0.5"],
    ["--serve-dtype", "int8", "--dim", "6"],
    ["--serve-dtype", "int8", "--consistency", "window", "--final-state", "s.pt", "--seed", "3"],
    [],
]  # fmt: skip


@pytest.mark.parametrize("tail", USED)
def test_the_combinations_in_use_pass(tail: list[str]) -> None:
    assert CANARY_PRED and MAIN_PRED  # (the rollout demo's predictors use the first two)
    args = _consume_parser().parse_args(["--consumer", "c", "--sidecar", "127.0.0.1:1", *tail])
    consume_cli.check_form_flags(args)
    # a default is never taken for a given flag: the same flags, only defaults, pass too
    defaults = _consume_parser().parse_args(["--consumer", "c", "--sidecar", "127.0.0.1:1"])
    consume_cli.check_form_flags(defaults)


def test_check_form_flags_names_the_flag_as_typed() -> None:
    args = _consume_parser().parse_args(["--consumer", "c", "--form", "ids", "--fraction", "1"])
    with pytest.raises(ConfigError, match=r"^--fraction goes with --form topk \(--form ids"):
        consume_cli.check_form_flags(args)


# ---- a signal while waiting for the sidecars ----------------------------------------------


def _start(*extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "consume", "--consumer", "c", "--model", "m",
         "--pulls", "1", "--discovery-timeout", "60", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip


def _signal_and_wait(proc: subprocess.Popen[str], sig: signal.Signals) -> tuple[int, str, float]:
    """Send ``sig``; the exit code, stderr and the seconds the process took to exit."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err, time.monotonic() - t0


def _check(sig: signal.Signals, code: int, err: str, took: float) -> None:
    last = err.strip().splitlines()[-1]
    assert "answered within" not in err and "registered in redis" not in err, err
    assert took < 10, (took, err)  # at once, not at the end of --discovery-timeout
    if sig == signal.SIGINT:
        assert code == 130, err
        assert last.startswith("deltad consume: interrupted while waiting for the sidecars ("), err
    else:
        assert code == 0, err
        assert last.startswith(
            "deltad consume: stopped by SIGTERM while waiting for the sidecars ("
        ), err
        assert last.endswith("s): nothing pulled, committed or written"), err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_waiting_for_a_static_sidecar_says_so(sig: signal.Signals) -> None:
    """--sidecar on a closed port: the wait logs once what it waits for; the signal then."""
    proc = _start("--sidecar", "127.0.0.1:1")
    assert proc.stderr is not None
    line = proc.stderr.readline()  # the wait's first line: it is waiting now
    assert "waiting up to 60s for the sidecar of rank 0 at 127.0.0.1:1" in line, line
    time.sleep(1.5)  # in the probes' sleep and their RPCs alike
    code, err, took = _signal_and_wait(proc, sig)
    _check(sig, code, line + err, took)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_waiting_for_sidecars_in_redis_says_so(
    sig: signal.Signals,
    redis_server: EmbeddedRedis,
) -> None:
    """--redis-url with no sidecar registered: the wait polls Redis until the signal."""
    client = redis.Redis.from_url(redis_server.url)
    before = len(client.client_list())
    proc = _start("--redis-url", redis_server.url)
    try:
        # it is waiting once it has connected to Redis (discovery's first registry read)
        wait_for(lambda: len(client.client_list()) > before, 60.0, "consume connected to redis")
        time.sleep(1.0)
        code, err, took = _signal_and_wait(proc, sig)
    finally:
        client.close()
    _check(sig, code, err, took)
