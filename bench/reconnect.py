"""How soon predictors are back after their sidecar was away or went silent.

Three consumers of one ``deltad serve`` pull in a loop (one thread each, every 0.1 s, the
library's default deadlines, retries and backoff): one with deltad's channels
(:mod:`deltad.channels`: reconnect backoff from the client's, ping timeout, keepalive), and two
with gRPC's defaults for those options (the channels of deltad before them; two, so the
baseline's own spread shows next to the ratio). Arms, each shared by the three at once:

* **outage of N s**: the sidecar is stopped (SIGTERM), N s later started again on the same
  port and spool;
* **silent**: the consumers reach the sidecar through a TCP proxy in this process
  (:class:`bench.netproxy.DroppingProxy`) whose open connections go silent (no FIN, no RST:
  a node that died, a partition); new connections get through.

Measured: seconds from the sidecar's return (or the link going silent) to each consumer's
first pull that reads the rank again; one not back within ``GIVE_UP_S`` (120 s) is recorded
as None and counts as 120 s in the ratios (which then say how many were censored).

``python -m bench.reconnect [--outages 10,60] [--repeats 2] [--record]``: prints one JSON line;
``--record`` writes bench/results/reconnect.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Children, Context, free_port, record_standalone, summarize
from bench.deltad_procs import MODEL, start_sidecar
from bench.netproxy import DroppingProxy

ARMS = ("deltad", "grpc_default", "grpc_default_again")
#: Longest an arm waits for its consumers; one not back by then is recorded as None ("not
#: back within GIVE_UP_S": with gRPC's defaults a silent connection may be kept for good).
GIVE_UP_S = 120.0


class Puller:
    """A consumer pulling every 0.1 s in its own thread, noting when pulls read the rank."""

    def __init__(self, name: str, endpoint: str, grpc_defaults: bool) -> None:
        from deltad.channels import STREAM_OPTIONS
        from deltad.config import ConsumerConfig
        from deltad.consume.client import DeltaConsumer

        # the library's defaults (deadlines, retries, backoff)
        self.consumer = DeltaConsumer(ConsumerConfig(name, MODEL, sidecars=(endpoint,)))
        side = self.consumer._sidecars
        if grpc_defaults:  # the baseline: gRPC's defaults for what deltad.channels sets
            side.channel_options = list(STREAM_OPTIONS)
        # a connection of its own, as a predictor process has (channels of one process with
        # the same options would share one)
        side.channel_options = [*side.channel_options, ("grpc.use_local_subchannel_pool", 1)]
        self.consumer.connect()
        #: (start, end) of each pull that read the rank, monotonic
        self.ok: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                r = self.consumer.pull()
            except Exception:  # (closed under a pull in flight)
                if self._stop.is_set():
                    return
                raise
            if not r.missing:
                self.ok.append((start, time.monotonic()))
            self._stop.wait(0.1)

    def back_after(self, since: float) -> float | None:
        """Seconds from ``since`` to the end of the first pull started after it that read
        the rank (one that started before may have had its answer on the way already)."""
        later = [end for start, end in self.ok if start > since]
        return later[0] - since if later else None

    def close(self) -> None:
        self._stop.set()
        self.consumer.close()  # (first: a pull stuck on a silent connection is cancelled)
        self._thread.join(60.0)


def _wait_back(pullers: dict[str, Puller], since: float) -> dict[str, float | None]:
    """Each consumer's seconds from ``since`` to reading the rank again (None: not within
    :data:`GIVE_UP_S`)."""
    deadline = time.monotonic() + GIVE_UP_S
    while True:
        got = {n: p.back_after(since) for n, p in pullers.items()}
        if all(v is not None for v in got.values()) or time.monotonic() >= deadline:
            return got
        time.sleep(0.1)


def _pullers(endpoint: str, tag: str) -> dict[str, Puller]:
    return {a: Puller(f"{a}-{tag}", endpoint, a != "deltad") for a in ARMS}


def _settle(pullers: dict[str, Puller]) -> None:
    got = _wait_back(pullers, time.monotonic())  # each read the rank once: connected
    if any(v is None for v in got.values()):
        raise RuntimeError(f"consumers never read the rank: {got}")


def run(outages: list[float], repeats: int, work: Path) -> dict[str, Any]:
    from bench.datagen import write_spool

    write_spool(work, model=MODEL, tables=2, rows_per_table=1000, dim=16, deltas=1)
    samples: list[dict[str, Any]] = []
    with Children() as kids:
        port = free_port()
        side = start_sidecar(kids, work, Context(), port=port)
        for i in range(repeats):
            for outage in outages:
                pullers = _pullers(side.endpoint, f"out{outage:g}-{i}")
                try:
                    _settle(pullers)
                    side.stop()
                    time.sleep(outage)
                    side = start_sidecar(kids, work, Context(), port=port)
                    back = _wait_back(pullers, time.monotonic())
                finally:
                    for p in pullers.values():
                        p.close()
                samples.append({"arm": f"outage_{outage:g}s", **back})
            with DroppingProxy(side.endpoint, drop_after=1 << 50, drops=0) as link:
                pullers = _pullers(link.endpoint, f"silent-{i}")
                try:
                    _settle(pullers)
                    silenced = link.blackhole()
                    back = _wait_back(pullers, time.monotonic())
                finally:
                    for p in pullers.values():
                        p.close()
            samples.append({"arm": "silent", "connections_silenced": silenced, **back})
        side.stop()
    out: dict[str, Any] = {"outages_s": outages, "samples": samples}
    for arm in sorted({s["arm"] for s in samples}):
        rows = [s for s in samples if s["arm"] == arm]
        out[arm] = {
            **{f"{a}_s": _seconds([r[a] for r in rows]) for a in ARMS},
            "deltad_x_grpc_default": _ratios(rows, "deltad", "grpc_default"),
            "noise": _ratios(rows, "grpc_default_again", "grpc_default"),
        }
    return out


def _seconds(values: list[float | None]) -> dict[str, Any]:
    """Summary of the consumers that came back, and how many did not within GIVE_UP_S."""
    back = [v for v in values if v is not None]
    return {**(summarize(back) if back else {}), "not_back": len(values) - len(back)}


def _ratios(rows: list[dict[str, Any]], num: str, den: str) -> dict[str, Any]:
    """``num / den`` per sample; a consumer not back counts as GIVE_UP_S (a bound: "<=" for
    the numerator's, ">=" for the denominator's)."""
    vals = [
        (r[num] if r[num] is not None else GIVE_UP_S)
        / max(r[den] if r[den] is not None else GIVE_UP_S, 1e-9)
        for r in rows
    ]
    censored = sum(r[num] is None or r[den] is None for r in rows)
    return {**summarize(vals), "censored": censored}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reconnect", description=__doc__)
    p.add_argument("--outages", default="10,60", help="comma-separated outage lengths (s)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--record", action="store_true", help="write bench/results/reconnect.json")
    a = p.parse_args(argv)
    try:
        outages = [float(x) for x in a.outages.split(",") if x.strip()]
    except ValueError:
        p.error(f"--outages: not a list of seconds: {a.outages!r}")
    if not outages or any(not 0 < x <= 600 for x in outages) or not 1 <= a.repeats <= 20:
        p.error("--outages must be in (0, 600] s and --repeats in [1, 20]")
    with tempfile.TemporaryDirectory(prefix="deltad-reconnect-") as tmp:
        result = run(outages, a.repeats, Path(tmp))
    print(record_standalone("reconnect", result, argv, a.record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
