"""`deltad demo` refuses what it cannot run before anything starts: one line on stderr, exit 2,
nothing created (a --workdir it cannot create or use, a previous run's work directory, flags
the fixed-shape bad-update scenario cannot honour). Each invocation is a real `deltad demo`
that must end before it imports torch or starts a child, so they are fast."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from spoolkit import child_env

from deltad.commands.main import build_parser
from deltad.demo import DEFAULTS, check_args
from deltad.demo.procs import WorkDir
from deltad.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def demo(*argv: str) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "demo", *argv, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    # refused before the first child (the embedded Redis, the trainer) starts
    assert time.monotonic() - t0 < 30, out.stderr
    return out


def refused(out: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a refusal (exit 2, no traceback, nothing on stdout)."""
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert out.stdout == ""
    assert lines[0].startswith("deltad demo: error: "), lines[0]
    return lines[0]


def test_a_workdir_it_cannot_create_is_one_line_and_exit_2() -> None:
    # (in /proc nobody, root included, can create a directory; deltad runs on Linux only)
    line = refused(demo("--duration", "5", "--workdir", "/proc/deltad-demo-forbidden"))
    assert line.startswith("deltad demo: error: --workdir /proc/deltad-demo-forbidden: "), line


def test_a_workdir_that_is_a_file_or_under_one_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    line = refused(demo("--duration", "5", "--workdir", str(afile)))
    assert f"--workdir {afile}: not a directory" in line, line
    line = refused(demo("--duration", "5", "--workdir", str(afile / "sub")))
    assert f"--workdir {afile / 'sub'}: " in line and "Not a directory" in line, line
    assert afile.read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_a_previous_runs_workdir_is_refused_an_empty_one_is_not(tmp_path: Path) -> None:
    """A kept work directory holds a spool and the Redis with the predictors' cursors: reused,
    the report would mix both runs. Refused, untouched; an empty or a new directory is the
    demo's (in process: the work directory alone, nothing started)."""
    work = tmp_path / "demo"
    for sub in ("spool", "logs", "redis"):
        (work / sub).mkdir(parents=True)
    (work / "trainer-result.json").write_text("{}")
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    line = refused(demo("--duration", "5", "--workdir", str(work)))
    assert f"--workdir {work}: not empty" in line, line
    assert "empty or a new directory" in line, line
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before
    for fresh in (tmp_path / "empty", tmp_path / "new" / "dir"):
        if fresh.name == "empty":
            fresh.mkdir()
        wd = WorkDir(fresh, keep=True)
        assert wd.path == fresh.resolve() and wd.logs.is_dir() and not wd.tmp
    with pytest.raises(ConfigError, match="not empty"):
        WorkDir(tmp_path / "empty", keep=True)  # now holds logs/: a second run is refused


@pytest.mark.parametrize(
    "flag",
    [
        ["--duration", "5"],
        ["--world-size", "3"],
        ["--publish-every", "1"],
        ["--topk-fraction", "0.3"],
    ],
)
def test_bad_update_refuses_each_flag_of_the_shape_it_fixes(
    tmp_path: Path, flag: list[str]
) -> None:
    work = tmp_path / "demo"
    line = refused(demo("--scenario", "bad-update", *flag, "--workdir", str(work)))
    assert line.startswith("deltad demo: error: --scenario bad-update has a fixed shape"), line
    assert f"does not take {flag[0]};" in line, line
    assert not work.exists()  # refused before the work directory is made


def test_bad_update_names_every_refused_flag_in_one_line(tmp_path: Path) -> None:
    line = refused(
        demo("--scenario", "bad-update", "--duration", "5", "--world-size", "4",
             "--publish-every", "0.2", "--topk-fraction", "0.1", "--workdir", str(tmp_path / "w"))
    )  # fmt: skip
    assert "does not take --duration, --world-size, --publish-every, --topk-fraction;" in line


def test_flags_left_out_or_matching_the_fixed_shape_pass_and_get_their_defaults() -> None:
    """In process: the check is on what the user gave (argparse's None), so bad-update takes
    its own rows, dim, intervals, and --world-size 2 (what it runs); the default scenario
    gets every default, or the value given."""
    parser = build_parser()
    args = parser.parse_args(
        ["demo", "--scenario", "bad-update", "--rows", "500", "--dim", "8",
         "--pull-interval", "0.2", "--settle-timeout", "30", "--world-size", "2"]
    )  # fmt: skip
    check_args(args)
    assert (args.world_size, args.duration, args.publish_every) == (2, 60.0, 0.5)
    args = parser.parse_args(["demo", "--duration", "7", "--world-size", "3"])
    check_args(args)
    assert (args.duration, args.world_size) == (7.0, 3)
    assert (args.publish_every, args.topk_fraction) == (
        DEFAULTS["publish_every"],
        DEFAULTS["topk_fraction"],
    )


def test_help_says_bad_update_has_a_fixed_shape_and_what_it_refuses() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "fixed shape (2 ranks, 40 steps" in text, text
    # (argparse wraps --topk-fraction after its hyphen)
    assert "refuses --duration, --world-size, --publish-every and --topk-" in text, text
    assert "seconds of training (default: 60;" in text, text
    assert "a new or an empty directory" in text, text


def test_archive_flags_the_demo_cannot_honour_are_one_line_and_exit_2() -> None:
    line = refused(demo("--scenario", "bad-update", "--archive"))
    assert "--archive goes with the default scenario, not --scenario bad-update" in line, line
    line = refused(demo("--duration", "5", "--archive-endpoint", "http://127.0.0.1:1"))
    assert "--archive-endpoint needs --archive" in line, line
