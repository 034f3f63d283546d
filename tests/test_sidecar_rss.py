"""The sidecar's memory near its log (issue 22 item 4): a retention merge no longer leaves the
merged segment in the heap (malloc keeps freed heap memory in the sidecar: deltad.perf), and
the scrape-time memory gauges add up to the process's RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.common import RSS_PARTS, free_port, metric_sums
from bench.datagen import write_spool
from deltad.segment.format import read_segment
from deltad.segment.spool import SpoolLayout
from deltad.serve.index.log import SegmentLog
from deltad.serve.index.merge import merge_entries, merge_plan
from deltad.serve.memory import MemoryBaseline, heap_free_bytes, rss_bytes


def test_a_merge_written_shard_by_shard_equals_the_merge_in_memory(tmp_path: Path) -> None:
    write_spool(tmp_path, model="m", tables=3, rows_per_table=500, dim=8, deltas=5)
    log = SegmentLog(SpoolLayout(tmp_path, "m"), 0)
    log.refresh()
    snap = log.snapshot()
    assert snap is not None and len(snap.entries) == 6
    shards, values_of = merge_plan(snap.entries)
    want = merge_entries(snap.entries)
    assert [s.key for s in shards] == list(want)
    for i, s in enumerate(shards):
        assert s.values.device.type == "meta"
        assert torch.equal(s.ids, want[s.key].ids)
        assert torch.equal(values_of(i), want[s.key].values)
    # the retention path: the file written from the plan reads back as the merge
    from deltad.segment.format import write_segment
    from deltad.types import SegmentKind

    path = tmp_path / "merged.seg"
    write_segment(
        path, model="m", generation=1, rank=0, world_size=1, seq=5, first_seq=0, step=5,
        kind=SegmentKind.BASE, shards=shards, values_of=values_of, fsync=False,
    )  # fmt: skip
    back = {c.key: c for c in read_segment(path).shards}
    for k, c in want.items():
        assert torch.equal(back[k].ids, c.ids) and torch.equal(back[k].values, c.values)


def test_the_memory_baseline_reads_this_process() -> None:
    base = MemoryBaseline()
    assert base.runtime() == pytest.approx(rss_bytes(), rel=0.2) and base.anon > 10 << 20
    assert heap_free_bytes() >= 0 and base.heap_free_growth() >= 0


_HELD = (
    "deltad_log_bytes",
    "deltad_run_cache_bytes",
    "deltad_window_cache_bytes",
    "deltad_packed_cache_bytes",
    "deltad_owed_bytes",
    "deltad_spill_resident_bytes",
    "deltad_spool_resident_bytes",
)


def _held(gauges: dict[str, float]) -> float:
    """The bytes the sidecar's caches, log and mapped files hold (each has its gauge)."""
    return sum(gauges.get(name, 0.0) for name in _HELD)


@pytest.mark.slow
def test_after_a_base_forward_merge_the_sidecar_holds_its_log_and_the_gauges_add_up(
    tmp_path: Path,
) -> None:
    """4 x 150k x 64 base + 4 deltas: retention merges them into a new base at once (no
    consumer pins anything). Then the RSS beyond the runtime is the log (within 1.2x; before,
    the merged base stayed in the heap: ~2x), and runtime + log + caches + free heap is the
    RSS within 10 %."""
    write_spool(tmp_path, model="m", tables=4, rows_per_table=150_000, dim=64, deltas=4)
    rank_dir = next(tmp_path.rglob("seg-*")).parent
    metrics = free_port()
    env = {**os.environ, "DELTAD_SPOOL": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad", "serve", "--spool", str(tmp_path), "--model", "m",
         "--listen", f"127.0.0.1:{free_port()}", "--metrics-port", str(metrics),
         "--grace-period", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        g: dict[str, float] = {}
        while time.monotonic() < deadline:  # bounded: the merge is one round
            assert proc.poll() is None, "deltad serve exited"
            files = list(rank_dir.glob("seg-*"))
            try:
                g = metric_sums(metrics)
            except OSError:
                g = {}
            if len(files) == 1 and g.get("deltad_log_bytes", 0) > 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail("retention did not merge the log into one base")
        time.sleep(1.0)
        g = metric_sums(metrics)
        rss, log_bytes, runtime = (
            g["deltad_rss_bytes"],
            g["deltad_log_bytes"],
            g["deltad_runtime_bytes"],
        )
        assert log_bytes == 4 * 150_000 * (8 + 64 * 4)
        assert rss - runtime <= 1.2 * log_bytes, (rss, runtime, log_bytes)
        total = sum(g[k] for k in RSS_PARTS)
        assert abs(total - rss) <= 0.1 * rss, {k: g[k] for k in (*RSS_PARTS, "deltad_rss_bytes")}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_an_idle_sidecar_and_relay_hand_their_free_heap_back(tmp_path: Path) -> None:
    """A pull merges a window of 13 parts whole (temporaries of the window's size, freed into
    the heap malloc keeps); once no stream has run for ``IDLE_HEAP_TRIM_S`` the sidecar gives
    that heap back and pages out its libraries' code, once per idle spell: the free-heap
    gauge and the RSS drop, and the next pull is served as before. A relay (a sidecar mirroring its upstream's log) does the same for the pulls it
    serves (it mirrors the log compacted: its RSS is its runtime and log)."""
    from bench.throughput import client_pull

    write_spool(tmp_path / "up", model="m", tables=2, rows_per_table=200_000, dim=64, deltas=12)
    env = {
        **os.environ,
        "DELTAD_SPOOL": "",
        "DELTAD_KNOB_IDLE_HEAP_TRIM_S": "2",
        "DELTAD_KNOB_IDLE_HEAP_TRIM_MIN_BYTES": str(4 << 20),
    }
    procs = []

    def serve(spool: Path, *extra: str) -> tuple[str, int]:
        metrics, listen = free_port(), free_port()
        flags = ["--model", "m", "--window-cache-entries", "0", "--retention-interval", "3600"]
        # messages built ahead (whatever the cores here): more heap for the trim to hand back
        flags += ["--prefetch-messages", "3"]
        args = ["serve", "--spool", str(spool), "--listen", f"127.0.0.1:{listen}", *flags]
        args += ["--metrics-port", str(metrics), *extra]
        out = subprocess.DEVNULL
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "deltad", *args], env=env, stdout=out, stderr=out
            )
        )
        return f"127.0.0.1:{listen}", metrics

    def wait_log(metrics: int, nbytes: float) -> float:
        deadline, have = time.monotonic() + 90, 0.0
        while time.monotonic() < deadline and have < nbytes:
            assert all(p.poll() is None for p in procs), "deltad serve exited"
            try:
                have = metric_sums(metrics).get("deltad_log_bytes", 0.0)
            except OSError:
                pass
            time.sleep(0.2)
        assert have >= nbytes, (have, nbytes)
        return have

    def pull_then_trim(endpoint: str, metrics: int, consumer: str) -> dict:
        first = client_pull({}, endpoint, "m", f"{consumer}-1", "fp32")
        assert first["rows"] == 2 * 200_000
        g = metric_sums(metrics)  # right after the pull: its temporaries are free heap
        assert g["deltad_heap_free_bytes"] >= 12 << 20, g
        peak_rest = g["deltad_rss_bytes"] - _held(g)
        trims, page_outs = g["deltad_idle_heap_trims_total"], g["deltad_idle_page_outs_total"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # 2 s idle + a 2 s check interval
            g = metric_sums(metrics)
            if g["deltad_heap_free_bytes"] < 4 << 20:
                break
            time.sleep(0.5)
        assert g["deltad_heap_free_bytes"] < 4 << 20, g
        # what the trim hands back is heap: the RSS beyond what the gauged caches and files hold
        # (a run cache filled meanwhile is not the trim's to give back) drops by 8 MiB or more
        assert g["deltad_rss_bytes"] - _held(g) <= peak_rest - (8 << 20), (peak_rest, g)
        # once per idle spell: the heap handed back and the libraries' code paged out, and
        # not again while the spell lasts (the check runs every 2 s)
        time.sleep(4.5)
        g = metric_sums(metrics)
        assert g["deltad_idle_heap_trims_total"] == trims + 1, g
        assert g["deltad_idle_page_outs_total"] == page_outs + 1, g
        again = client_pull({}, endpoint, "m", f"{consumer}-2", "fp32")
        assert again["rows"] == first["rows"] and again["bytes"] == first["bytes"]
        return first

    try:
        up, up_metrics = serve(tmp_path / "up")
        wait_log(up_metrics, 1)
        relay, relay_metrics = serve(tmp_path / "relay", "--upstream", up)
        direct = pull_then_trim(up, up_metrics, "c")
        # The relay mirrors the upstream's log compacted (one base): its pulls merge nothing
        # whole, and once idle it holds its runtime and its log, its free heap handed back.
        wait_log(relay_metrics, 2 * 200_000 * (8 + 64 * 4))
        relayed = client_pull({}, relay, "m", "r-1", "fp32")
        assert relayed["rows"] == direct["rows"] and relayed["bytes"] == direct["bytes"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            g = metric_sums(relay_metrics)
            if g["deltad_heap_free_bytes"] < 4 << 20:
                break
            time.sleep(0.5)
        assert g["deltad_heap_free_bytes"] < 4 << 20, g
        assert g["deltad_idle_page_outs_total"] >= 1, g
        held = g["deltad_runtime_bytes"] + g["deltad_log_bytes"]
        assert g["deltad_rss_bytes"] <= 1.1 * held, g
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


_PAGE_OUT_CHILD = """
import json, mmap, sys
from deltad.perf import page_out_libraries

def resident():
    # Rss of each mapping of the test's files, by "path perms"
    out, key = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):  # a mapping's first line: range perms ... [path]
                key = None
                if len(head) >= 6 and head[5].startswith(sys.argv[1]):
                    key = head[5] + " " + head[1]
            elif key and head[0] == "Rss:":
                out[key] = int(head[1]) * 1024
    return out

maps = []
for name in ("libdeltadtest.so", "segment.bin"):
    with open(sys.argv[1] + "/" + name, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    sum(m[i] for i in range(0, len(m), 4096))  # every page resident
    maps.append(m)
before = resident()
advised = page_out_libraries()
print(json.dumps({"advised": advised, "before": before, "after": resident()}))
"""


def test_paging_out_gives_back_the_libraries_read_only_pages_and_nothing_else(
    tmp_path: Path,
) -> None:
    """``page_out_libraries`` gives back the resident pages of read-only mappings of ``*.so``
    files (a library's code and constants; here a file of this test's own: the kernel keeps
    pages another process maps too), and leaves alone a data file's mapping (a segment)."""
    for name in ("libdeltadtest.so", "segment.bin"):
        (tmp_path / name).write_bytes(os.urandom(8 << 20))
    child = subprocess.run(
        [sys.executable, "-c", _PAGE_OUT_CHILD, str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    out = json.loads(child.stdout.strip().splitlines()[-1])
    # (MADV_PAGEOUT needs Linux >= 5.4; these machines and CI run 6.x: no advice taken fails)
    assert out["advised"] > 0, out
    lib, seg = (f"{tmp_path}/{n}" for n in ("libdeltadtest.so r--p", "segment.bin r--p"))
    assert out["before"] == {lib: 8 << 20, seg: 8 << 20}, out
    assert out["after"] == {lib: 0, seg: 8 << 20}, out
