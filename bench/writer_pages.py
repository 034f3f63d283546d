"""Benchmark: what a segment write costs the writer thread in CPU, by where its page-cache pages
come from (issue 41: the writer's share of the publisher's off-loop CPU).

``python -m bench.writer_pages [--mb 6] [--writes 40] [--rounds 2]`` writes ``--writes`` files of
``--mb`` MB each through the segment writer's checksumming path (``write`` + xxh3 + ``fsync``),
one every 0.1 s, as the publisher's writer does, in two ways, alternating:

* ``keep``: the files stay, as a spool's segments stay until the sidecar's retention merges
  them: every write takes page-cache pages the guest has not touched lately;
* ``dontneed``: ``posix_fadvise(DONTNEED)`` after each ``fsync``: the pages go back to the
  kernel at once and the next write takes the same ones again.

It prints the writer's CPU (``thread_time``) per MB, median of each way, and their ratio. On
these VMs the first touch of a guest page costs ~15 us (the host backs it again after the
guest's free-page reporting), so ``keep`` costs ~3x ``dontneed``: the figure measures the VM,
not deltad. A trainer on bare metal does not pay it. deltad keeps the pages (the sidecar reads
each segment right after it is written: dropping them would move the cost to the sidecar's
read, plus a disk read), and ``bench/README.md`` says so next to the off-loop figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _write(path: Path, payload: memoryview, dontneed: bool) -> float:
    from deltad.segment.writer import _ChecksumWriter

    c0 = time.thread_time()
    with open(path, "wb") as f:
        w = _ChecksumWriter(f)
        w.write(payload)
        f.flush()
        os.fsync(f.fileno())
        if dontneed:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return time.thread_time() - c0


def run(mb: int, writes: int, rounds: int, where: Path) -> dict[str, object]:
    """CPU seconds per MB of each way, per round; their medians and ratio."""
    payload = memoryview(os.urandom(mb * 1_000_000))
    per: dict[str, list[float]] = {"keep": [], "dontneed": []}
    for r in range(rounds):
        for way in ("keep", "dontneed"):
            with tempfile.TemporaryDirectory(dir=where) as d:
                cpu = []
                for i in range(writes):
                    cpu.append(_write(Path(d) / f"{r}-{i}", payload, way == "dontneed"))
                    time.sleep(0.1)
                per[way].append(statistics.median(cpu) / mb)
    keep, drop = statistics.median(per["keep"]), statistics.median(per["dontneed"])
    return {
        "mb_per_write": mb,
        "writes_per_round": writes,
        "cpu_ms_per_mb": {k: [round(v * 1e3, 3) for v in vs] for k, vs in per.items()},
        "median_cpu_ms_per_mb": {"keep": round(keep * 1e3, 3), "dontneed": round(drop * 1e3, 3)},
        "keep_over_dontneed": round(keep / drop, 2) if drop else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=6, help="MB per write (default 6)")
    p.add_argument("--writes", type=int, default=40, help="writes per way per round (default 40)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each way once (default 2)")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: the temp dir)")
    a = p.parse_args(argv)
    where = a.dir or Path(tempfile.gettempdir())
    print(json.dumps(run(a.mb, a.writes, a.rounds, where), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
