"""docker/: what can be checked without a container engine.

The files parse; every command they run exists and accepts exactly those flags (argparse of
the very argv); the health-check command answers for a live `deltad serve` and fails for a
dead one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deltad.commands.healthcheck import LIVENESS_SERVICE
from deltad.commands.main import build_parser
from deltad.serve.memory import RUNTIME_BYTES

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


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for k, a in _dockerfile_instructions():
        if k == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((k, a))
    return stages


def test_dockerfile_runs_existing_commands() -> None:
    ins = _dockerfile_instructions()
    build, runtime = _stages()
    # a pinned base image, parametrised once
    base = next(a for k, a in ins if k == "ARG" and a.startswith("PYTHON_IMAGE="))
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11\.\d+-slim-\w+", base), base
    # dependencies are installed (from pinned constraints) before the source is copied
    build_kinds = [(k, a) for k, a in build]
    first_source_copy = next(
        i for i, (k, a) in enumerate(build_kinds) if k == "COPY" and "deltad/" in a
    )
    deps_run = next(
        i for i, (k, a) in enumerate(build_kinds) if k == "RUN" and "constraints.txt" in a
    )
    assert deps_run < first_source_copy
    assert "torch==2.13.0" in build_kinds[deps_run][1]
    # the runtime stage copies the virtualenv only: no pip install, no compilers, not root
    runtime_kinds = dict(runtime)
    assert not any(k == "RUN" and "pip" in a for k, a in runtime)
    assert runtime_kinds["USER"] not in ("root", "0", "0:0")
    assert any(k == "COPY" and a.startswith("--from=build /opt/deltad") for k, a in runtime)
    args = {a.split("=")[0] for k, a in ins if k == "ARG"}
    assert {"DELTAD_VARIANT", "DELTAD_TORCH_INDEX"} <= args
    for k, a in build:
        if k == "COPY":
            for src in shlex.split(a)[:-1]:
                assert (ROOT / src).exists(), f"COPY source {src} missing"
    # EXPOSE only what listens by default: the gRPC port of DELTAD_LISTEN
    env = dict(item.split("=", 1) for item in shlex.split(runtime_kinds["ENV"]) if "=" in item)
    assert runtime_kinds["EXPOSE"].split() == [env["DELTAD_LISTEN"].rsplit(":", 1)[1]]
    entry = _exec_form(runtime_kinds["ENTRYPOINT"])
    assert entry == ["deltad"]
    _check_deltad_argv(_exec_form(runtime_kinds["CMD"]))
    health = runtime_kinds["HEALTHCHECK"]
    assert " CMD " in f" {health} "
    _check_healthcheck_argv(_exec_form(health.split(" CMD ", 1)[1]))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)


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
        assert "REDIS_PASSWORD" in svc["environment"]["DELTAD_REDIS_URL"]
        assert not any("redis://" in a for a in svc["command"]), "a secret in the args"
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
    # Redis: a password and a data volume; the plaintext sidecar port only on loopback
    redis = services["redis"]
    assert "--requirepass" in redis["command"]
    assert any(v.endswith(":/data") for v in redis["volumes"])
    for port in services["sidecar"].get("ports", []):
        assert str(port).startswith("127.0.0.1:"), port


def test_k8s_pod_runs_existing_commands() -> None:
    pod: dict[str, Any] = yaml.safe_load((DOCKER / "k8s" / "pod.yaml").read_text())
    assert pod["kind"] == "Pod"
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert any("emptyDir" in v for v in spec["volumes"])
    containers = {c["name"]: c for c in spec["containers"]}
    init = {c["name"]: c for c in spec["initContainers"]}
    assert set(containers) == {"trainer"} and set(init) == {"deltad"}
    side = init["deltad"]
    assert side["restartPolicy"] == "Always"  # a native sidecar: outlives the trainer
    env = {"POD_IP": "10.0.0.7"}
    for c in (*containers.values(), side):
        _check_deltad_argv(_subst(c["args"], env))
        assert {"name": "spool", "mountPath": "/spool"} in c["volumeMounts"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert not any("DELTAD_REDIS_URL" in a or "redis://" in a for a in c["args"])
    secret = {e["name"]: e for e in side["env"]}["DELTAD_REDIS_URL"]["valueFrom"]
    assert "secretKeyRef" in secret
    # the rank is the sidecar's DELTAD_RANK, as its comment tells a multi-host trainer to set
    # per pod: a --rank in args would win over it
    assert {e["name"]: e.get("value") for e in side["env"]}["DELTAD_RANK"] == "0"
    assert "--rank" not in side["args"]
    # the sidecar's memory limit holds 1.2 x a log as big as the spool, every cache budget
    # its flags allow (the defaults, where a flag is not given) and the runtime
    sargs = build_parser().parse_args(_subst(side["args"], env))
    budgets = (
        sargs.window_cache_bytes + sargs.run_cache_bytes + sargs.generation_keep_bytes
        + sargs.packed_cache_bytes + RUNTIME_BYTES
    )  # fmt: skip
    spool = next(v for v in spec["volumes"] if v["name"] == "spool")["emptyDir"]["sizeLimit"]
    assert _k8s_bytes(side["resources"]["limits"]["memory"]) >= 1.2 * _k8s_bytes(spool) + budgets
    assert [p["name"] for p in side["ports"]] == ["grpc", "metrics"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert side[probe]["grpc"]["port"] == 50051
    # liveness reflects only the process; readiness (the server, "") its dependencies
    assert side["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    assert side["startupProbe"]["grpc"]["service"] == LIVENESS_SERVICE  # it kills too
    assert side["readinessProbe"]["grpc"].get("service", "") == ""


def test_healthcheck_follows_the_sidecars_environment(tmp_path: Path, redis_url: str) -> None:
    """With no target, the probe finds the sidecar through DELTAD_LISTEN, as the sidecar does.
    (The probe is the process under test; the sidecar runs in this process.)"""
    from spoolkit import cli_sidecar

    srv = cli_sidecar("--spool", str(tmp_path / "spool"), "--model", "m", "--rank", "0",
                      "--listen", "127.0.0.1:0", "--redis-url", redis_url)  # fmt: skip
    try:
        port = srv.endpoint.rsplit(":", 1)[1]
        env = {**os.environ, "DELTAD_LISTEN": f"0.0.0.0:{port}"}
        ok = subprocess.run(
            [sys.executable, "-m", "deltad.healthcheck", "--timeout", "5"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert ok.returncode == 0, ok.stderr
        env["DELTAD_LISTEN"] = "0.0.0.0:1"  # nothing listens there
        bad = subprocess.run(
            [sys.executable, "-m", "deltad.healthcheck", "--timeout", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert bad.returncode == 1 and "127.0.0.1:1" in bad.stderr
    finally:
        srv.stop(0)


@pytest.mark.slow
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


def _dependency_run() -> str:
    """The build stage's RUN that installs the pinned dependencies."""
    build = _stages()[0]
    return next(a for k, a in build if k == "RUN" and "constraints.txt" in a)


def _pip_installs(run: str) -> list[list[str]]:
    """Every ``pip install`` of a RUN, as its argv after ``install``."""
    out = []
    for cmd in re.split(r";|&&", run):
        words = shlex.split(cmd)
        if "pip" in " ".join(words[:1]) and words[1:2] == ["install"]:
            out.append(words[2:])
    return out


def test_the_image_installs_torchrec_without_resolving_its_dependencies() -> None:
    run = _dependency_run()
    installs = _pip_installs(run)
    assert installs, run
    for argv in installs:
        names = " ".join(argv)
        if "torchrec" in names:
            assert "--no-deps" in argv, f"torchrec resolved with its CUDA metadata: {argv}"
        if "-r" in argv:
            listed = argv[argv.index("-r") + 1]
            assert listed != "docker/constraints.txt", "constraints.txt lists torchrec"
    # the requirement file is constraints.txt without torch, fbgemm and torchrec
    grep = re.search(r"grep -v (.*?) docker/constraints.txt > (\S+)", run)
    assert grep is not None, run
    excluded = re.findall(r"-e '(\^[^']+)'", grep.group(1))
    assert set(excluded) >= {"^torch==", "^fbgemm", "^torchrec=="}
    # the torchrec --no-deps install is the last install: no resolver runs after it
    assert "--no-deps" in installs[-1] and any("torchrec" in w for w in installs[-1])


@pytest.mark.slow
def test_the_images_dependency_resolution_has_one_fbgemm_and_the_pinned_torch(
    tmp_path: Path,
) -> None:
    """Resolve (pip --dry-run, the machine's index) exactly what the CPU image's resolving
    installs ask for: one fbgemm distribution (the CPU one), torch 2.13.0, no torchrec."""
    run = _dependency_run()
    grep = re.search(r"grep -v (.*?) docker/constraints.txt > (\S+)", run)
    assert grep is not None
    patterns = [p.lstrip("^") for p in re.findall(r"-e '(\^[^']+)'", grep.group(1))]
    lines = (DOCKER / "constraints.txt").read_text().splitlines()
    rest = tmp_path / "rest.txt"
    rest.write_text(
        "\n".join(ln for ln in lines if not any(ln.startswith(p) for p in patterns)) + "\n"
    )
    cpu_branch = run.split('= "cpu" ]; then', 1)[1].split("else", 1)[0]
    asked: list[str] = []
    for argv in _pip_installs(cpu_branch):
        asked += [a for a in argv if "==" in a and not a.startswith("-")]
    assert any(a.startswith("torch==2.13.0") for a in asked), asked
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), *asked, "-r", str(rest)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    names = {
        i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    fbgemm = sorted(n for n in names if n.startswith("fbgemm"))
    assert fbgemm == ["fbgemm-gpu-cpu"], fbgemm
    assert names["torch"].startswith("2.13.0"), names["torch"]
    assert "torchrec" not in names


def _k8s_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (Ki/Mi/Gi/Ti or plain bytes) in bytes."""
    for suffix, shift in (("Ki", 10), ("Mi", 20), ("Gi", 30), ("Ti", 40)):
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * (1 << shift))
    return int(quantity)
