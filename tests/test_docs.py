"""The docs stay true to the code: docs/cli.md is what the parsers say, every metric a real
sidecar and relay export is in docs/metrics.md (and nothing else is), the README stays a
front door, and every relative link of the docs leads to a file and a heading that exist.

Regenerate with ``python scripts/gen_docs.py``.
"""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverkit import SpoolWriter, server_config, wait_for

from deltad.config import ArchiveFollowConfig, RelayConfig
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.archived import ArchiveRelayServer
from deltad.serve.relay.server import RelayServer
from deltad.store import EmbeddedRedis
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gen_docs  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DOCS = sorted((REPO / "docs").glob("*.md"))


def test_cli_md_is_what_the_parsers_say() -> None:
    want = gen_docs.cli_markdown()
    assert (REPO / "docs" / "cli.md").read_text() == want, (
        "docs/cli.md is stale: python scripts/gen_docs.py"
    )
    # every subcommand has its section, and a flag of each is there with its help
    for cmd in ("train", "serve", "consume", "status", "rollout", "demo", "bench"):
        assert f"### `deltad {cmd}`" in want, cmd
    assert "| `--spill-max-bytes SPILL_MAX_BYTES` |" in want
    assert "[DELTAD_SPILL_MAX_BYTES] (default: 8589934592)" in want


def test_cli_md_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTAD_SPILL_MAX_BYTES", "123")
    monkeypatch.setenv("DELTAD_MODEL", "other")
    assert gen_docs.cli_markdown() == (REPO / "docs" / "cli.md").read_text()


def _db(redis_url: str, n: int) -> str:
    """Database ``n`` of the test's Redis (a relay's own keyspace)."""
    u = urlsplit(redis_url)
    if u.scheme == "unix":
        query = [(k, v) for k, v in parse_qsl(u.query) if k != "db"] + [("db", str(n))]
        return f"unix://{u.path}?{urlencode(query)}"
    return redis_url.rsplit("/", 1)[0] + f"/{n}"


def _scrape(port: int) -> dict[str, tuple[str, str, set[str]]]:
    """family -> (type, help, sample names) of a real /metrics, ``*_created`` aside."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        f.name: (
            f.type,
            f.documentation,
            {s.name for s in f.samples if not s.name.endswith("_created")},
        )
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")  # (prometheus_client's; dropped, not documented)
    }


def test_every_metric_a_real_sidecar_and_relay_export_is_in_metrics_md(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool").delta()
    archive = f"file://{tmp_path / 'archive'}"  # (its metrics too)
    side = SidecarServer(
        server_config(tmp_path / "spool", redis_server.url, metrics_port=0, archive_url=archive)
    )
    side.start()
    relay = follower = None
    try:
        relay = RelayServer(
            server_config(tmp_path / "relay", _db(redis_server.url, 1), metrics_port=0),
            RelayConfig(upstream=side.endpoint, consumer="docs", poll_interval_s=0.02, fsync=False),
        ).start()
        follower = ArchiveRelayServer(  # a relay following the sidecar's archive
            server_config(tmp_path / "follower", _db(redis_server.url, 2), metrics_port=0),
            ArchiveFollowConfig(archive, poll_interval_s=0.05, fsync=False),
        ).start()
        assert side.metrics_port is not None and relay.server.metrics_port is not None
        assert follower.server.metrics_port is not None
        wait_for(lambda: relay.server.log.snapshot() is not None)
        wait_for(lambda: follower.server.log.snapshot() is not None)
        # the relay is a live consumer of the sidecar: a ListConsumers (what `deltad status`
        # asks) refreshes the per-consumer series
        with grpc.insecure_channel(side.endpoint) as channel:
            stub = delta_pb2_grpc.DeltaServiceStub(channel)
            stub.ListConsumers(pb.ListConsumersRequest(), timeout=10)
        from prometheus_client import start_http_server

        from consumers.metrics import PredictorMetrics
        from deltad.evaluate.promex import EvalMetrics

        predictor = PredictorMetrics("m", "p")  # what `deltad consume --metrics-port` serves
        evaluator = EvalMetrics("m")  # and `deltad evaluate --metrics-port`, after a verdict
        evaluator.ne.labels("m", "golden", "candidate").set(0.7)
        evaluator.cal.labels("m", "golden", "candidate").set(1.0)
        evaluator.step.labels("m").set(5)
        evaluator.release_step.labels("m").set(4)
        evaluator.seconds.labels("m").observe(0.4)
        ev_http, _ = start_http_server(0, addr="127.0.0.1", registry=evaluator.registry)
        try:
            scraped = {
                "sidecar": _scrape(side.metrics_port),
                "relay": _scrape(relay.server.metrics_port),
                "archive relay": _scrape(follower.server.metrics_port),
                "predictor": _scrape(predictor.serve_http(0)),
                "evaluator": _scrape(int(ev_http.server_port)),
            }
        finally:
            predictor.close()
            ev_http.shutdown()
            ev_http.server_close()
        upstream = side.endpoint
    finally:
        for r in (relay, follower):
            if r is not None:
                r.stop(0)
        side.stop(0)
    doc = (REPO / "docs" / "metrics.md").read_text()
    rows = {
        m.group(1): line
        for line in doc.splitlines()
        if (m := re.match(r"^\| `([a-z0-9_]+)`", line))
    }
    listed = set(re.findall(r"`((?:deltad|process)_[a-z0-9_]+)`", doc))
    exported: set[str] = set()
    for who, families in scraped.items():
        assert who in ("predictor", "evaluator") or "deltad_head_age_seconds" in families, who
        for name, (mtype, help_text, samples) in families.items():
            for s in samples:
                assert s in listed, f"{who} exports {s}, which docs/metrics.md lacks"
            exported |= samples
            first = gen_docs.exported_names(name, mtype)[0]
            row = rows.get(first)
            assert row is not None, f"docs/metrics.md has no row for {first}"
            help_text = help_text.replace(upstream, "HOST:PORT").replace("|", "\\|")
            assert f"| {mtype} |" in row and help_text in row, f"{first}: stale row\n{row}"
    assert {"deltad_upstream_up", "deltad_mirror_pulls_total"} <= scraped["relay"].keys() | {
        n + "_total" for n in scraped["relay"]
    }
    # nothing listed that nobody exports (a renamed or removed metric)
    histograms = {s for s in listed if s.endswith(("_bucket", "_sum", "_count"))}
    stale = listed - exported - histograms
    assert not stale, f"docs/metrics.md lists metrics nothing exports: {sorted(stale)}"


# --- the README and the links of the docs ------------------------------------------------


def test_the_readme_is_a_front_door() -> None:
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the reference to docs/"
    assert lines[0] == "# deltad"
    assert lines[2:6] == [
        "```bash",
        "make demo   # sets up .venv (CPU torch, no CUDA) and runs `deltad demo`: trainer, "
        "sidecars, Redis, predictors",
        "make test   # sets up .venv and runs the whole test suite (what CI runs: .ci/run)",
        "```",
    ]
    for page in ("operations", "rollout", "trust", "managed-collision", "cli", "metrics"):
        assert f"docs/{page}.md" in text, page


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize(
    "page",
    [REPO / "README.md", REPO / "bench" / "README.md", REPO / "bench" / "HISTORY.md", *DOCS],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_every_relative_link_leads_to_a_file_and_heading(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: link to {target}: no such heading"
