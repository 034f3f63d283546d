"""deltad.knobs: tunables default in the module, the environment overrides them at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deltad import knobs
from deltad.errors import ConfigError


def _import_knobs(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from deltad import knobs; print(knobs.WRITER_NICE, knobs.REUSE_COPY_BUFFERS)"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_environment_overrides_a_knob_and_a_bad_value_is_refused() -> None:
    ok = _import_knobs({"DELTAD_KNOB_WRITER_NICE": "3", "DELTAD_KNOB_REUSE_COPY_BUFFERS": "off"})
    assert ok.returncode == 0 and ok.stdout.split() == ["3", "False"]
    bad = _import_knobs({"DELTAD_KNOB_WRITER_NICE": "20"})
    assert bad.returncode != 0 and "DELTAD_KNOB_WRITER_NICE" in bad.stderr
    assert "ConfigError" in bad.stderr


def test_override_sets_knobs_for_a_block_and_checks_them() -> None:
    before = knobs.MAX_PENDING_FOLDS
    with knobs.override(MAX_PENDING_FOLDS=before + 5):
        assert before + 5 == knobs.MAX_PENDING_FOLDS
    assert before == knobs.MAX_PENDING_FOLDS
    with pytest.raises(ConfigError, match="unknown knobs"), knobs.override(NO_SUCH_KNOB=1):
        pass
    with pytest.raises(ConfigError, match="out of range"), knobs.override(MAX_PENDING_FOLDS=0):
        pass
    assert before == knobs.MAX_PENDING_FOLDS


def test_every_knob_is_documented() -> None:
    assert knobs.__doc__ is not None
    for name in knobs.NAMES:
        assert f"``{name}``" in knobs.__doc__, name
