"""Help texts (issue 23, item 5): every option of every command has help, prints its
default at most once (never a default that says nothing, never a secret from the
environment), and no command takes a secret on argv."""

from __future__ import annotations

import argparse

import pytest

from deltad.commands.main import HelpFormatter, build_parser
from deltad.needs import STACKS, installed_stack


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_has_help_and_states_its_default_once() -> None:
    fmt = HelpFormatter("deltad")
    problems = []
    for cmd, sp in _subparsers().items():
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            name = f"deltad {cmd} {(a.option_strings or [a.dest])[0]}"
            text = fmt._expand_help(a) if a.help else ""
            if not (a.help or "").strip():
                problems.append(f"{name}: no help")
            if text.count("default") > 1:
                problems.append(f"{name}: default twice: {text!r}")
            if "(default: None)" in text or "(default: False)" in text:
                problems.append(f"{name}: {text!r}")
    assert not problems, "\n".join(problems)


def test_no_command_takes_a_token_on_argv_or_prints_a_secret_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DELTAD_TOKEN", "s3cret-token")
    monkeypatch.setenv("DELTAD_REDIS_URL", "redis://:s3cret-pass@h:6379/0")
    for cmd, sp in _subparsers().items():
        assert "--token" not in sp._option_string_actions, cmd
        text = sp.format_help()
        assert "s3cret" not in text, cmd


def test_serve_dtype_offers_only_what_it_serves() -> None:
    (a,) = [a for a in _subparsers()["consume"]._actions if a.dest == "serve_dtype"]
    assert a.choices is not None and "bf16" not in a.choices


def test_log_json_error_lines_are_json_too(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import logging

    from deltad import output
    from deltad.commands.main import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        rc = main(["--log-json", "serve", "--spool", "/nonexistent", "--lease-ttl", "nan"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        output.use_json(False)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    record = json.loads(err[0])
    assert record["level"] == "ERROR" and "--lease-ttl must be" in record["msg"]


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--no-publish", "--steps", "1"],
        ["consume", "--consumer", "c", "--sidecar", "127.0.0.1:1", "--serve-dtype", "int8"],
    ],
)
def test_a_missing_torchrec_is_an_install_hint_not_a_traceback(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging
    import sys

    from deltad.commands.main import main

    monkeypatch.setitem(sys.modules, "torchrec", None)  # import torchrec fails, as uninstalled
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        rc = main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    torchrec = STACKS[installed_stack()][1]  # (the trio of the installed torch)
    assert "needs torchrec" in err[0] and f"pip install --no-deps torchrec=={torchrec}" in err[0]
