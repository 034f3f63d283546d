"""Every numeric flag and environment variable is range-checked by one checker
(deltad.config.check_number): nan, inf, negative and huge values are refused with a
ConfigError naming the flag (one line, exit 2 from `deltad`; test_cli_errors runs a few as
subprocesses). Walks every subcommand's parser, so a new flag without a range fails here."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from deltad import knobs
from deltad.commands.main import build_parser, check_flags
from deltad.config import (
    ConsumerConfig,
    PullOptions,
    Range,
    RelayConfig,
    ServerConfig,
    check_number,
)
from deltad.errors import ConfigError
from deltad.serve import cli as serve_cli

#: What each subcommand needs besides the flag under test.
REQUIRED = {
    "consume": ["--consumer", "c", "--sidecar", "127.0.0.1:1"],
    "serve": ["--spool", "/nonexistent-spool"],
    "rollout": ["status"],
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _numeric(sp: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in sp._actions
        if a.type in (int, float) or isinstance(a.default, serve_cli.EnvValue)
    ]


def _bad_values(a: argparse.Action, rng: Range) -> list[str]:
    """nan, inf, just below the range and far above it, as the flag's type spells them."""
    low = rng.lo if rng.lo_open else rng.lo - 1
    high = rng.hi * 4 + 1
    if a.type is int:
        return [str(math.floor(low)), str(int(high)), "1" + "0" * 40]
    return ["nan", "inf", "-inf", repr(low), repr(high), "1e308"]


def _cases() -> list[tuple[str, argparse.Action, Range]]:
    out = []
    for cmd, sp in _subparsers().items():
        ranges: dict[str, Range] = sp.get_default("_ranges") or {}
        for a in _numeric(sp):
            out.append((cmd, a, ranges.get(a.dest, Range(math.nan, math.nan))))
    return out


def test_every_numeric_flag_of_every_command_has_a_range_its_default_is_in() -> None:
    cases = _cases()
    assert len(cases) > 50  # the walk found the flags
    missing = [f"{cmd} {a.option_strings[0]}" for cmd, a, r in cases if math.isnan(r.lo)]
    assert not missing, missing
    for cmd, sp in _subparsers().items():
        args = sp.parse_args(REQUIRED.get(cmd, []))
        check_flags(args, sp.get_default("_ranges") or {})  # every default passes


@pytest.mark.parametrize(
    ("cmd", "action", "rng"),
    _cases(),
    ids=[f"{c}{a.option_strings[0]}" for c, a, _ in _cases()],
)
def test_a_numeric_flag_refuses_nan_inf_negative_and_huge_values(
    cmd: str, action: argparse.Action, rng: Range
) -> None:
    sp = _subparsers()[cmd]
    flag = action.option_strings[0]
    for bad in _bad_values(action, rng):
        try:
            args = sp.parse_args([*REQUIRED.get(cmd, []), flag, bad])
        except SystemExit as e:  # argparse itself refused it (int("nan")): exit 2
            assert e.code == 2
            continue
        with pytest.raises(ConfigError, match=f"^{flag} .*must be (a finite number|an integer)"):
            check_flags(args, sp.get_default("_ranges"))


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "1e30"])
def test_every_serve_environment_variable_is_range_checked(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DELTAD_<FLAG> values reach ServerConfig / RelayConfig unchecked by argparse: they are
    checked there, naming flag and variable."""
    sp = _subparsers()["serve"]
    dests = [a.dest for a in _numeric(sp)]
    for dest in dests:
        env = f"DELTAD_{dest.upper()}"
        monkeypatch.setenv(env, bad)
        fresh = _subparsers()["serve"]
        args = fresh.parse_args([*REQUIRED["serve"], "--upstream", "up:1"])
        with pytest.raises(ConfigError, match=env):
            serve_cli.build_config(args)
            serve_cli.build_relay_config(args)
        monkeypatch.delenv(env)


def test_stream_deadline_flags_reach_the_consumer_and_the_relay() -> None:
    """`deltad consume --stream-deadline` bounds the consumer's whole streams; `deltad serve
    --stream-deadline` the streams a sidecar serves and, on a relay, its mirror pulls."""
    from deltad.reference.consumers.cli import build_consumer_config

    sps = _subparsers()
    consume = [*REQUIRED["consume"], "--stream-deadline", "7200", "--rpc-deadline", "12"]
    cfg = build_consumer_config(sps["consume"].parse_args(consume))
    assert (cfg.stream_deadline_s, cfg.rpc_deadline_s) == (7200.0, 12.0)
    default = build_consumer_config(sps["consume"].parse_args(REQUIRED["consume"]))
    assert default.stream_deadline_s == ConsumerConfig("c").stream_deadline_s == 3600.0
    serve = [*REQUIRED["serve"], "--upstream", "up:1", "--stream-deadline", "7200"]
    args = sps["serve"].parse_args(serve)
    assert serve_cli.build_relay_config(args).stream_deadline_s == 7200.0
    assert serve_cli.build_config(args).stream_deadline_s == 7200.0
    default_args = sps["serve"].parse_args([*REQUIRED["serve"], "--upstream", "up:1"])
    assert serve_cli.build_relay_config(default_args).stream_deadline_s == 3600.0


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (ServerConfig, {"spool_dir": "/s", "lease_ttl_s": math.nan}),
        (ServerConfig, {"spool_dir": "/s", "poll_interval_s": math.inf}),
        (ServerConfig, {"spool_dir": "/s", "max_message_bytes": 1 << 40}),
        (ServerConfig, {"spool_dir": "/s", "window_cache_bytes": -1}),
        (RelayConfig, {"upstream": "h:1", "long_poll_s": math.nan}),
        (PullOptions, {"fraction": math.nan}),
        (ConsumerConfig, {"consumer": "c", "heartbeat_interval_s": math.inf}),
        (ConsumerConfig, {"consumer": "c", "rpc_deadline_s": math.nan}),
    ],
)
def test_config_objects_refuse_non_finite_and_out_of_range_numbers(
    cls: Any, kw: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError, match=r"must be (a finite number|an integer)"):
        cls(**kw)


def test_the_checker_refuses_bools_strings_and_non_finite_numbers() -> None:
    rng = Range(0, 10)
    for bad in (math.nan, math.inf, -math.inf, -1, 11, True, "3"):
        with pytest.raises(ConfigError, match="x must be a finite number in"):
            check_number("x", bad, rng)
    for ok in (0, 10, 5.5, None):
        check_number("x", ok, rng)
    with pytest.raises(ConfigError, match=r"\(0, 10\]"):
        check_number("x", 0, Range(0, 10, lo_open=True))


def test_float_knobs_must_be_finite() -> None:
    for name in ("COPY_POOL_HEADROOM", "STATUS_MAX_WAIT_S"):
        for bad in (math.nan, math.inf):
            with pytest.raises(ConfigError, match="out of range"), knobs.override(**{name: bad}):
                pass
