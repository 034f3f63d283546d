"""The alert rules and the dashboard in docker/: promtool accepts the rules and passes their
unit tests, the PrometheusRule holds the same rules, every alert has its runbook section in
docs/operations.md, the rules and the dashboard read only metrics a sidecar or relay exports,
and the head-age alert fires on what a real sidecar exports once its trainer stopped
publishing, and not while it publishes.

promtool is Debian's ``prometheus`` package; without it these tests skip, unless ``CI`` is
set (CI installs it: there a missing promtool fails).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serverkit import server_config, wait_for

from deltad.segment.format import ShardRows, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis
from deltad.types import SegmentKind, Shard

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gen_docs  # noqa: E402

RULES = REPO / "docker" / "prometheus" / "deltad-rules.yml"
RULE_TESTS = REPO / "docker" / "prometheus" / "deltad-rules.test.yml"
PROMETHEUS_RULE = REPO / "docker" / "k8s" / "prometheus-rule.yaml"
DASHBOARD = REPO / "docker" / "grafana" / "deltad.json"
OPERATIONS = REPO / "docs" / "operations.md"
METRICS_MD = REPO / "docs" / "metrics.md"

#: Names the rules and dashboard use ahead of a rename another change makes (new -> old):
#: accepted while the old name is the one exported. Drop an entry once the rename is merged.
PENDING_RENAMES: dict[str, str] = {}
#: Series Prometheus makes itself, not a sidecar.
PROMETHEUS_OWN = {"up"}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI: apt-get install -y prometheus")
        pytest.skip("promtool not installed (apt-get install -y prometheus)")
    return path


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)


def _rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _exported() -> set[str]:
    """Every sample name docs/metrics.md lists (tests/test_docs.py checks it against a real
    sidecar's and relay's /metrics)."""
    return set(re.findall(r"`((?:deltad|process)_[a-z0-9_]+)`", METRICS_MD.read_text()))


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # no label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # no selectors
    words = set(re.findall(r"\b[a-z_][a-z0-9_]*\b", expr))
    return {w for w in words if w.startswith(("deltad_", "process_")) or w in PROMETHEUS_OWN}


def _known(name: str, exported: set[str]) -> bool:
    return name in exported or name in PROMETHEUS_OWN or PENDING_RENAMES.get(name, "") in exported


def _render(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


# --- the rules ---------------------------------------------------------------------------


def test_the_rules_pass_promtool_check(promtool: str) -> None:
    done = _run([promtool, "check", "rules", str(RULES)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_the_rules_pass_their_promtool_unit_tests(promtool: str) -> None:
    done = _run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    checks: dict[str, list[bool]] = {}
    for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for c in t["alert_rule_test"]:
            checks.setdefault(c["alertname"], []).append(bool(c["exp_alerts"]))
    for alert in _rules():
        assert True in checks.get(alert, []), f"no promtool test sees {alert} fire"
        assert False in checks.get(alert, []), f"no promtool test sees {alert} not fire"


def test_the_prometheus_rule_holds_the_same_rules_and_passes_promtool(
    promtool: str, tmp_path: Path
) -> None:
    assert PROMETHEUS_RULE.read_text() == gen_docs.prometheus_rule_yaml(), (
        "docker/k8s/prometheus-rule.yaml is stale: python scripts/gen_docs.py"
    )
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    spec = tmp_path / "spec.yml"
    spec.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = _run([promtool, "check", "rules", str(spec)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_links_its_runbook_section_and_names_its_severity() -> None:
    headings = {
        _anchor(h) for h in re.findall(r"^#{2,4} (.+)$", OPERATIONS.read_text(), flags=re.M)
    }
    for alert, rule in _rules().items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), alert
        ann = rule["annotations"]
        assert ann.get("summary") and ann.get("description"), alert
        url = ann["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/operations.md" and anchor == alert.lower(), (alert, url)
        assert anchor in headings, f"{alert}: docs/operations.md has no section #{anchor}"
        # annotations render from labels alone (what fired is in the labels)
        for text in ann.values():
            assert "{{" not in re.sub(r"\{\{ \$labels\.\w+ \}\}", "", text), (alert, text)


def test_the_rules_and_the_dashboard_read_only_exported_metrics() -> None:
    exported = _exported()
    assert "deltad_head_age_seconds" in exported and "process_resident_memory_bytes" in exported
    for alert, rule in _rules().items():
        names = _metric_names(str(rule["expr"]))
        assert names, alert
        for n in names:
            assert _known(n, exported), f"{alert} reads {n}, which no sidecar or relay exports"
    for panel, expr in _dashboard_exprs(json.loads(DASHBOARD.read_text())):
        names = _metric_names(expr)
        assert names, (panel, expr)
        for n in names:
            assert _known(n, exported), f"panel {panel!r} reads {n}, which nothing exports"


# --- the dashboard -----------------------------------------------------------------------


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def _dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (p.get("title", ""), t["expr"])
        for p in _panels(dash)
        for t in p.get("targets", [])
        if "expr" in t
    ]


def test_the_dashboard_shows_each_concern_with_unique_panel_ids() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "deltad" and dash["title"]
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    rows = {p["title"] for p in panels if p["type"] == "row"}
    assert {
        "Freshness and lag",
        "Pulls and failures",
        "Gate and release",
        "Relays",
        "Memory",
    } <= rows
    exprs = " ".join(e for _, e in _dashboard_exprs(dash))
    for name in ("deltad_head_age_seconds", "deltad_pulls_total", "deltad_gate_held",
                 "deltad_release_step", "deltad_upstream_lost", "deltad_rss_bytes"):  # fmt: skip
        assert name in exprs, name
    # every query is scoped by the dashboard's model (and rank) variables
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model", "rank"} <= variables
    for panel, expr in _dashboard_exprs(dash):
        if "deltad_" in expr:
            assert 'model=~"$model"' in expr, (panel, expr)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


# --- the head-age alert against a real sidecar -------------------------------------------


def _publish(layout: SpoolLayout, seq: int, step: int, created: float) -> None:
    """One segment of table t0, as the trainer writes it, with the time its rows were read."""
    shard = Shard("t0", 64, 4, 0, 64, 0, 4)
    ids = torch.arange(64) if seq == 0 else torch.arange(8)
    write_segment(
        layout.segment_path(1, 0, seq), model="m", generation=1, rank=0, world_size=1,
        seq=seq, step=step, kind=SegmentKind.BASE if seq == 0 else SegmentKind.DELTA,
        shards=[ShardRows(shard, ids, torch.randn(ids.numel(), 4))], created_unix=created,
    )  # fmt: skip


def _scrape(port: int) -> dict[str, tuple[dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: (dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _head_stale_fires(
    promtool: str, tmp_path: Path, labels: dict[str, str], values: str, fires: bool
) -> subprocess.CompletedProcess[str]:
    """promtool's verdict on DeltadHeadStale over the scraped series, held as ``values``."""
    rule = _rules()["DeltadHeadStale"]
    series = "deltad_head_age_seconds{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    expected = [
        {
            "exp_labels": {**labels, **rule["labels"]},
            "exp_annotations": {k: _render(v, labels) for k, v in rule["annotations"].items()},
        }
    ]
    case = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": series, "values": values}],
                "alert_rule_test": [
                    {
                        "eval_time": "6m",
                        "alertname": "DeltadHeadStale",
                        "exp_alerts": expected if fires else [],
                    },
                ],
            }
        ],
    }
    path = tmp_path / f"head-{'stale' if fires else 'fresh'}.test.yml"
    path.write_text(yaml.safe_dump(case))
    return _run([promtool, "test", "rules", str(path)])


def test_the_head_age_alert_fires_on_a_real_sidecar_whose_trainer_stopped(
    promtool: str, tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    root = tmp_path / "spool"
    layout = SpoolLayout(root, "m")
    stopped = time.time() - 900  # the trainer's last publish: 15 minutes ago, then nothing
    layout.write_manifest(
        GenerationManifest(
            "m", 1, 1, 0, stopped, (TableInfo("t0", 64, 4, "float32", "ec", "ec", "row_wise"),)
        )
    )
    _publish(layout, 0, 0, stopped)
    srv = SidecarServer(server_config(root, redis_server.url, metrics_port=0)).start()
    try:
        assert srv.metrics_port is not None
        port = srv.metrics_port
        wait_for(lambda: _scrape(port)["deltad_head_seq"][1] == 0)
        labels, first = _scrape(port)["deltad_head_age_seconds"]
        time.sleep(1.5)
        _, age = _scrape(port)["deltad_head_age_seconds"]
        assert 900 <= first < age < 960 and age - first >= 1.4  # it grows: nothing published
        target = {**labels, "job": "deltad", "instance": f"127.0.0.1:{port}"}
        # held as Prometheus would scrape it each minute from now on: a minute older each time
        stale = _head_stale_fires(promtool, tmp_path, target, f"{age:.0f}+60x10", fires=True)
        assert stale.returncode == 0, stale.stdout + stale.stderr
        # the same expectation on the scraped series, with the alert said not to fire, fails
        wrong = _head_stale_fires(promtool, tmp_path, target, f"{age:.0f}+60x10", fires=False)
        assert wrong.returncode != 0 and "DeltadHeadStale" in wrong.stdout + wrong.stderr

        # the trainer publishes again: the head is fresh, and the alert does not fire
        _publish(layout, 1, 10, time.time())
        wait_for(lambda: _scrape(port)["deltad_head_seq"][1] == 1)
        labels, age = _scrape(port)["deltad_head_age_seconds"]
        assert 0 <= age < 30
        fresh = _head_stale_fires(promtool, tmp_path, target, f"{age:.1f}x10", fires=False)
        assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    finally:
        srv.stop(0)
