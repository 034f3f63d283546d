"""Every resident byte of a sidecar in a gauge (issue 41 item 1): after fp32, packed-int8 and
packed-int4 bootstraps, three packed-int8 row alignments pulled at once, with retention merging
the log and without (a spilled base read by the bootstraps), busy and idle, the memory gauges
add up to the process's VmRSS within 5 %; the pack-once store's gauge holds its rows and its
budget; the spill's pages are not left resident."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.common import RSS_PARTS, free_port, metric_sums
from bench.datagen import write_spool
from deltad import wire
from deltad.types import WireDtype

TABLES, ROWS, DIM = 4, 40_000, 64
LOG_BYTES = TABLES * ROWS * (8 + DIM * 4)


def _vmrss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _pull(endpoint: str, consumer: str, dtype: str, alignment: int = 0) -> int:
    """A fresh consumer's bootstrap (its whole window); the rows it got."""
    from bench.common import consumer_config
    from deltad.config import PullOptions
    from deltad.consume.client import DeltaConsumer

    pull = PullOptions(wire_dtype=WireDtype(dtype), row_alignment=alignment)
    c = DeltaConsumer(consumer_config(consumer, "m", endpoint, pull=pull)).connect()
    try:
        return int(c.pull().rows)
    finally:
        c.close()


def _check_sum(pid: int, metrics: int, what: str) -> dict[str, float]:
    """The gauges add up to VmRSS within 5 % (read twice: VmRSS beside one scrape)."""
    best: tuple[float, dict[str, float], int] | None = None
    for _ in range(3):  # (a scrape's own allocations move RSS by a few MB: take the closest)
        g = metric_sums(metrics)
        rss = _vmrss(pid)
        total = sum(g[k] for k in RSS_PARTS)
        off = abs(total - rss) / rss
        if best is None or off < best[0]:
            best = (off, g, rss)
        if off <= 0.05:
            break
        time.sleep(0.3)
    assert best is not None
    off, g, rss = best
    parts = {k.removeprefix("deltad_"): round(g[k] / 2**20, 1) for k in RSS_PARTS}
    assert off <= 0.05, f"{what}: gauges sum {sum(g[k] for k in RSS_PARTS) / rss:.3f} of VmRSS " + (
        f"{rss / 2**20:.0f} MiB: {parts}"
    )
    return g


@pytest.mark.slow
@pytest.mark.parametrize("retention", [True, False], ids=["retention", "no-retention"])
def test_the_memory_gauges_add_up_to_the_rss(tmp_path: Path, retention: bool) -> None:
    """A real sidecar (subprocess) over 4 x 40k x 64 (41 MB) and 4 heavy deltas. With retention
    the log is merged into one base first; without, a window cache smaller than the base makes
    bootstraps start from a spilled merged base (a mapped file). Fresh consumers bootstrap in
    fp32, packed-int8, packed-int4, then three packed-int8 alignments at once; after each, and
    idle after each (the free heap handed back), the gauges add up to VmRSS within 5 %."""
    spool = tmp_path / "spool"
    write_spool(
        spool, model="m", tables=TABLES, rows_per_table=ROWS, dim=DIM, deltas=4,
        delta_fraction=0.35,
    )  # fmt: skip
    rank_dir = next(spool.rglob("seg-*")).parent
    metrics, listen = free_port(), free_port()
    endpoint = f"127.0.0.1:{listen}"
    # a pack-once budget of the three alignments' base parts minus one shard's: the third
    # alignment must not push the store over it (nor keep what it evicts alive)
    row = wire.packed_row_bytes(DIM, WireDtype.PACKED_INT8, 16)
    packed_budget = 3 * TABLES * ROWS * row * 5 // 4
    args = [
        sys.executable, "-m", "deltad", "serve", "--spool", str(spool), "--model", "m",
        "--listen", endpoint, "--metrics-port", str(metrics), "--grace-period", "1",
        "--packed-cache-bytes", str(packed_budget),
    ]  # fmt: skip
    if retention:
        args += ["--retention-interval", "1"]
    else:  # the window cache smaller than the base: bootstraps from the spill
        args += ["--retention-interval", "86400", "--window-cache-bytes", str(LOG_BYTES // 4)]
    env = {
        **os.environ,
        "DELTAD_SPOOL": "",
        "DELTAD_KNOB_IDLE_HEAP_TRIM_S": "2",
        "DELTAD_KNOB_IDLE_HEAP_TRIM_MIN_BYTES": str(1 << 20),
    }
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # bounded: indexing (and one retention merge)
            assert proc.poll() is None, "deltad serve exited"
            try:
                g = metric_sums(metrics)
            except OSError:
                g = {}
            merged = not retention or len(list(rank_dir.glob("seg-*"))) == 1
            if merged and g.get("deltad_log_bytes", 0) > 0:
                break
            time.sleep(0.3)
        else:
            pytest.fail("the sidecar did not index (and merge) its log")
        time.sleep(1.0)
        _check_sum(proc.pid, metrics, "before any pull")

        def idle(what: str) -> dict[str, float]:
            time.sleep(5.0)  # 2 s idle + the check interval: the free heap is handed back
            return _check_sum(proc.pid, metrics, f"idle after {what}")

        seen_spill = 0.0
        for i, dtype in enumerate(("fp32", "packed-int8", "packed-int4")):
            assert _pull(endpoint, f"boot-{i}", dtype) == TABLES * ROWS
            g = _check_sum(proc.pid, metrics, f"after a {dtype} bootstrap")
            seen_spill = max(seen_spill, g["deltad_spill_bytes"])
            if dtype == "packed-int8":  # the store's rows are in its gauge
                assert g["deltad_packed_cache_bytes"] > 0, g
            idle(dtype)
        errors: list[BaseException] = []

        def aligned(a: int) -> None:
            try:
                _pull(endpoint, f"align-{a}", "packed-int8", a)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=aligned, args=(a,)) for a in (16, 32, 64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        assert not any(t.is_alive() for t in threads)
        g = _check_sum(proc.pid, metrics, "after three packed-int8 alignments at once")
        assert 0 < g["deltad_packed_cache_bytes"] <= packed_budget, g
        g = idle("three alignments")
        assert g["deltad_packed_cache_bytes"] <= packed_budget, g
        if not retention:  # bootstraps read a spilled base; its pages did not stay resident
            assert seen_spill > 0
            assert g["deltad_spill_resident_bytes"] <= 0.1 * g["deltad_spill_bytes"], g
    finally:
        proc.terminate()
        proc.wait(timeout=30)
