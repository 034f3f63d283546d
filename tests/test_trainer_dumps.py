"""The reference trainer's rollout flags, checked before a run: ``--dump-steps`` needs
``--dump-dir``; ``--inject-nan-step`` needs the plain loop (the run itself is in
test_rollback_slow.py and the bad-update demo)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltad.reference.trainer import cli
from deltad.reference.trainer.train import TrainConfig

from deltad.errors import ConfigError
from deltad.types import TrainLoop


def test_dump_and_bad_step_flags_are_checked_before_training(tmp_path: Path) -> None:
    ok = {"spool_dir": tmp_path, "publish_every_steps": 1}
    cfg = TrainConfig(**ok, dump_steps=(60, 30, 30), dump_dir=tmp_path)  # type: ignore[arg-type]
    assert cfg.dump_steps == (30, 60)
    with pytest.raises(ConfigError, match="--dump-steps needs --dump-dir"):
        TrainConfig(**ok, dump_steps=(30,))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="plain loop"):
        TrainConfig(**ok, inject_nan_step=5, loop=TrainLoop.PIPELINE_BASE)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=">= 0"):
        TrainConfig(**ok, inject_nan_step=-1)  # type: ignore[arg-type]
    assert cli.parse_steps("30, 60") == (30, 60) and cli.parse_steps("") == ()
    with pytest.raises(ConfigError, match="--dump-steps"):
        cli.parse_steps("30,sixty")
