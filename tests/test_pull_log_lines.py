"""At ``-v`` (INFO for deltad's loggers) the sidecar logs one line per pull and per commit
and the consumer library one line per pull, each with consumer, rank, window, rows, bytes and
ms; nothing is logged twice. A real sidecar on port 0 and a real DeltaConsumer."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from serverkit import SpoolWriter, server_config, wait_for

from deltad.config import ConsumerConfig
from deltad.consume.client import DeltaConsumer
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis

pytestmark = pytest.mark.timeout(60)


def _lines(caplog: pytest.LogCaptureFixture, logger: str, prefix: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and r.levelno == logging.INFO and r.getMessage().startswith(prefix)
    ]


def test_one_line_per_pull_and_per_commit(
    tmp_path: Path, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    caplog.set_level(logging.INFO, logger="deltad")
    try:
        cfg = ConsumerConfig("pred", model="m", sidecars=(srv.endpoint,))
        with DeltaConsumer(cfg) as c:
            first = c.pull()
            c.commit(first)
            spool.delta(n=7)
            wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.seq == 1)
            second = c.pull()
            c.commit(second)
        served = _lines(caplog, "deltad.serve.windows.getdelta", "pull pred")
        assert len(served) == 2, served
        assert served[0].startswith("pull pred rank 0 seq -1..0 step 0 (resync: no cursor)")
        assert f"{first.rows} rows, " in served[0] and served[0].endswith(" ms")
        assert served[1].startswith("pull pred rank 0 seq 0..1 step 10 (cursor)")
        assert f"{second.rows} rows" in served[1]
        commits = _lines(caplog, "deltad.serve.edge.service", "commit pred")
        assert [m.split(":")[0] for m in commits] == [
            "commit pred rank 0 seq 0 step 0 (owed rows 0)",
            "commit pred rank 0 seq 1 step 10 (owed rows 0)",
        ]
        pulled = _lines(caplog, "deltad.consume.client", "pull pred")
        assert len(pulled) == 2, pulled
        assert pulled[1].startswith("pull pred step 10: rank 0 seq 0..1: ")
        assert f"{second.rows} rows, {second.bytes} bytes" in pulled[1]
        # nothing else at INFO from the library per pull (per-rank and commit lines: DEBUG)
        assert not _lines(caplog, "deltad.consume.sidecars", "")
    finally:
        srv.stop(0)
