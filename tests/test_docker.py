"""docker/: what can be checked without a container engine.

The files parse; every command they run exists and accepts exactly those flags (argparse of
the very argv); the health-check command answers for a live `deltad serve` and fails for a
dead one.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deltad.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined."""
    text = (DOCKER / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _exec_form(arg: str) -> list[str]:
    v = json.loads(arg)
    assert isinstance(v, list) and all(isinstance(x, str) for x in v), arg
    return v


def _check_deltad_argv(argv: list[str]) -> None:
    """`deltad <argv>` parses (SystemExit from argparse fails the test with its message)."""
    parsed = build_parser().parse_args(argv)
    assert parsed.command == argv[0]
    assert not getattr(parsed, "_unavailable", None), parsed._unavailable


def _check_healthcheck_argv(argv: list[str]) -> None:
    assert argv[:3] == ["python", "-m", "deltad.healthcheck"], argv
    parser_ok = subprocess.run(
        [sys.executable, "-m", "deltad.healthcheck", *argv[3:], "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert parser_ok.returncode == 0, parser_ok.stderr


def _subst(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes $(VAR) expansion with the values a pod would have."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]


def test_dockerfile_runs_existing_commands() -> None:
    ins = _dockerfile_instructions()
    kinds = [k for k, _ in ins]
    assert kinds[0] == "FROM" and ins[0][1].startswith("python:3.11-slim")
    assert "USER" in kinds and dict(ins)["USER"] not in ("root", "0")
    args = {a.split("=")[0] for k, a in ins if k == "ARG"}
    assert {"DELTAD_VARIANT", "DELTAD_TORCH_INDEX"} <= args
    run = " ".join(a for k, a in ins if k == "RUN")
    assert "scripts/install.sh" in run
    for k, a in ins:
        if k == "COPY":
            for src in shlex.split(a)[:-1]:
                assert (ROOT / src).exists(), f"COPY source {src} missing"
    entry = _exec_form(dict(ins)["ENTRYPOINT"])
    assert entry == ["deltad"]
    _check_deltad_argv(_exec_form(dict(ins)["CMD"]))
    health = dict(ins)["HEALTHCHECK"]
    assert " CMD " in f" {health} "
    _check_healthcheck_argv(_exec_form(health.split(" CMD ", 1)[1]))


def test_compose_services_run_existing_commands() -> None:
    doc: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = doc["services"]
    assert {"redis", "trainer", "sidecar", "predictor-rows", "predictor-topk"} <= set(services)
    subcommands = {}
    for name, svc in services.items():
        if name == "redis":
            continue
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        _check_deltad_argv(svc["command"])
        subcommands[name] = svc["command"][0]
    assert subcommands == {
        "trainer": "train",
        "sidecar": "serve",
        "predictor-rows": "consume",
        "predictor-topk": "consume",
    }
    # the trainer and its sidecar share the spool volume
    assert "spool:/spool" in services["trainer"]["volumes"]
    assert "spool:/spool" in services["sidecar"]["volumes"]
    assert "spool" in doc["volumes"]


def test_k8s_pod_runs_existing_commands() -> None:
    pod: dict[str, Any] = yaml.safe_load((DOCKER / "k8s" / "pod.yaml").read_text())
    assert pod["kind"] == "Pod"
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert any("emptyDir" in v for v in spec["volumes"])
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"trainer", "deltad"}
    env = {"POD_IP": "10.0.0.7", "DELTAD_REDIS_URL": "redis://redis:6379/0"}
    for c in containers.values():
        _check_deltad_argv(_subst(c["args"], env))
        assert {"name": "spool", "mountPath": "/spool"} in c["volumeMounts"]
    side = containers["deltad"]
    secret = {e["name"]: e for e in side["env"]}["DELTAD_REDIS_URL"]["valueFrom"]
    assert "secretKeyRef" in secret
    assert [p["name"] for p in side["ports"]] == ["grpc", "metrics"]
    for probe in ("readinessProbe", "livenessProbe"):
        _check_healthcheck_argv(side[probe]["exec"]["command"])


@pytest.mark.timeout(120)
def test_healthcheck_against_live_sidecar(tmp_path: Path, redis_url: str) -> None:
    from spoolkit import running_serve

    with running_serve(tmp_path / "spool", rank=0, redis_url=redis_url) as endpoint:
        ok = subprocess.run(
            [sys.executable, "-m", "deltad.healthcheck", endpoint, "--timeout", "5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ok.returncode == 0, ok.stderr
    dead = subprocess.run(
        [sys.executable, "-m", "deltad.healthcheck", endpoint, "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dead.returncode == 1 and "UNAVAILABLE" in dead.stderr
