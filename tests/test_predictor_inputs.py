"""`deltad consume`'s inputs are checked before it consumes: --init-tables must be tables of
the model the sidecars serve (names, rows / slots x dim, a floating dtype; every table with
--resume), a file that is not tables is one line, and --json-log is a path in an existing
directory, as --final-tables is. Each mistake: one stderr line, exit 2, nothing written."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from deltad.reference.consumers.predictor import (
    SyncLoop,
    SyncLoopConfig,
    check_init_tables,
    load_tables,
)
from serverkit import server_config
from spoolkit import ZchWriter, child_env

from deltad.commands.status import check_sidecars
from deltad.config import ConsumerConfig
from deltad.errors import ConfigError, ConsumerError
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis

pytestmark = pytest.mark.timeout(180)

#: the model: a managed-collision table (slots x dim) beside an ordinary one, on two ranks
MC = {"zch": (64, 8)}
PLAIN = {"t0": (40, 4)}


def _cli(*args: str) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "deltad.commands.main", "consume", *args],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    return out.returncode, out.stderr


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def sidecars(tmp_path: Path, redis_server: EmbeddedRedis) -> Iterator[list[str]]:
    """Two real sidecars (ranks 0 and 1 of model 'm') over one spool, on the real Redis."""
    for rank in (0, 1):
        ZchWriter(tmp_path / "spool", mc=MC, tables=PLAIN, rank=rank, world_size=2)
    servers = [
        SidecarServer(server_config(tmp_path / "spool", redis_server.url, rank=r)).start()
        for r in (0, 1)
    ]
    try:
        yield [f"127.0.0.1:{s.port}" for s in servers]
    finally:
        for s in servers:
            s.stop(0)


def test_init_tables_of_another_shape_are_refused_before_consuming(
    tmp_path: Path, sidecars: list[str]
) -> None:
    """The outside review's case: --resume from a file whose t0 is 5x2 claimed the head step
    and wrote those tables; now one line naming t0 and the shapes, exit 2, no --final-tables.
    The consumer's own --final-tables (a managed-collision table among them) still resume."""
    base = ["--consumer", "c1", "--model", "m", "--sidecar", sidecars[0], "--sidecar",
            sidecars[1], "--pulls", "1", "--discovery-timeout", "30"]  # fmt: skip
    good, out = tmp_path / "good.pt", tmp_path / "out.pt"
    code, err = _cli(*base, "--final-tables", str(good))
    assert code == 0, err
    assert {n: tuple(t.shape) for n, t in torch.load(good, weights_only=True).items()} == {
        **MC,
        **PLAIN,
    }
    wrong = tmp_path / "wrong.pt"
    torch.save({"t0": torch.zeros(5, 2)}, wrong)
    code, err = _cli(*base, "--init-tables", str(wrong), "--resume", "--final-tables", str(out))
    assert code == 2, err
    line = _one_line(err)
    assert f"--init-tables {wrong}: table 't0' is 5x2, model 'm' has 40x4" in line, err
    assert not out.exists()
    code, err = _cli(*base, "--init-tables", str(good), "--resume", "--final-tables", str(out))
    assert code == 0, err
    final = torch.load(out, weights_only=True)
    for n, t in torch.load(good, weights_only=True).items():
        assert torch.equal(final[n], t), n


def test_init_tables_are_checked_against_every_table_the_sidecars_describe(
    tmp_path: Path, sidecars: list[str], redis_server: EmbeddedRedis
) -> None:
    """Against the Status of real sidecars: a table the model lacks, a managed-collision
    table with other slots, an integer table, and (with --resume only) a missing table; the
    same check in SyncLoop.run for sidecars found in Redis, before anything is written."""
    statuses = check_sidecars(tuple(sidecars), "m", deadline_s=30)
    ok = {"zch": torch.zeros(64, 8), "t0": torch.zeros(40, 4, dtype=torch.float16)}
    check_init_tables(ok, statuses, model="m", resume=True)
    check_init_tables({"t0": torch.zeros(40, 4)}, statuses, model="m", resume=False)
    for tables, resume, message in (
        ({**ok, "dense.w": torch.zeros(3, 3)}, False, "table 'dense.w' is not a table of model"),
        ({**ok, "zch": torch.zeros(32, 8)}, False, "table 'zch' is 32x8, model 'm' has 64x8 (slots"),
        ({**ok, "t0": torch.zeros(40, 4, dtype=torch.int64)}, False, "table 't0' has dtype torch.int64"),
        ({"t0": torch.zeros(40, 4)}, True, "table 'zch' of model 'm' is missing"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            check_init_tables(tables, statuses, model="m", resume=resume)
        assert message in str(e.value) and "\n" not in str(e.value), (message, e.value)

    wrong = tmp_path / "wrong.pt"
    torch.save({"t0": torch.zeros(5, 2)}, wrong)
    loop = SyncLoop(
        SyncLoopConfig(
            consumer=ConsumerConfig(
                consumer="c2", model="m", redis_url=redis_server.url, resume=True
            ),
            pulls=1,
            init_tables=wrong,
            final_tables=tmp_path / "out.pt",
            json_log=str(tmp_path / "log.jsonl"),
        )
    )
    with pytest.raises(ConfigError, match="table 't0' is 5x2, model 'm' has 40x4"):
        loop.run()
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "log.jsonl").exists()


def test_init_tables_that_are_not_a_torch_file_are_one_line(
    tmp_path: Path, sidecars: list[str]
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('not tables')\n")
    code, err = _cli(
        "--consumer", "c3", "--model", "m", "--sidecar", sidecars[0], "--sidecar", sidecars[1],
        "--pulls", "1", "--init-tables", str(probe), "--resume",
    )  # fmt: skip
    assert code == 2, err
    line = _one_line(err)
    assert f"cannot load tables from {probe}: not a torch.save file of tensors" in line, err
    assert "Traceback" not in err and "weights_only" not in err
    for name, data in (
        ("empty.pt", b""),
        ("int.pt", pickle.dumps(3, protocol=4)),
        ("zip.pt", b"PK\x03\x04garbage"),
        ("object.pt", pickle.dumps({"a": object})),
    ):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConsumerError, match="cannot load tables from") as e:
            load_tables(tmp_path / name)
        assert "\n" not in str(e.value), (name, e.value)


def test_a_json_log_in_a_missing_directory_is_refused_as_final_tables_is(tmp_path: Path) -> None:
    """--json-log used to create the missing directory where --final-tables refuses it."""
    missing = tmp_path / "nonexistent-dir"
    code, err = _cli(
        "--consumer", "c4", "--sidecar", "127.0.0.1:1", "--discovery-timeout", "1",
        "--json-log", str(missing / "x.jsonl"),
    )  # fmt: skip
    assert code == 2, err
    assert f"--json-log {missing / 'x.jsonl'}: not a writable file path" in _one_line(err)
    assert not missing.exists()
