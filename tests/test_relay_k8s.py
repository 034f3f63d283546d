"""docker/k8s/relay.yaml: the relay tier's manifests run existing commands with existing flags,
and the tier is wired sidecar -> relay -> predictors."""

from __future__ import annotations

from typing import Any

import yaml
from test_docker import DOCKER, _check_deltad_argv, _k8s_bytes, _subst

from deltad.commands.healthcheck import LIVENESS_SERVICE
from deltad.commands.main import build_parser
from deltad.serve.cli import build_relay_config
from deltad.serve.memory import RUNTIME_BYTES


def test_relay_tier_deployment_mirrors_the_sidecar_and_serves_predictors() -> None:
    docs: list[dict[str, Any]] = list(
        yaml.safe_load_all((DOCKER / "k8s" / "relay.yaml").read_text())
    )
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    side_svc = by[("Service", "deltad-sidecar-0")]
    pod: dict[str, Any] = yaml.safe_load((DOCKER / "k8s" / "pod.yaml").read_text())
    labels = pod["metadata"]["labels"]
    assert all(labels[k] == v for k, v in side_svc["spec"]["selector"].items())
    relay = by[("Deployment", "deltad-relay-0")]
    tpl = relay["spec"]["template"]
    assert relay["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    assert by[("Service", "deltad-relay-0")]["spec"]["selector"].items() <= (
        tpl["metadata"]["labels"].items()
    )
    (c,) = tpl["spec"]["containers"]
    env = {"POD_IP": "10.0.0.9", "DELTAD_REDIS_URL": "redis://redis:6379/1"}
    argv = _subst(c["args"], env)
    _check_deltad_argv(argv)
    args = build_parser().parse_args(argv)
    assert args.upstream == "deltad-sidecar-0:50051" and args.rank == 0
    assert build_relay_config(args).upstream == "deltad-sidecar-0:50051"
    secret = {e["name"]: e for e in c["env"]}["DELTAD_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert secret["key"] == "relay-url"  # not the sidecars' Redis database
    assert {"name": "spool", "mountPath": "/spool"} in c["volumeMounts"]
    # the Redis URL (with its password) never on the command line
    assert not any("REDIS" in a or "redis://" in a for a in c["args"]), c["args"]
    assert "--redis-url" not in c["args"]
    # native gRPC probes on the port it listens on, like pod.yaml's sidecar
    port = int(args.listen.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, (probe, c[probe])
    # liveness (and startup, which kills too) ask only for the process; readiness for its
    # dependencies (Redis, the upstream)
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["grpc"]["service"] == LIVENESS_SERVICE, probe
    assert c["readinessProbe"]["grpc"].get("service", "") == ""
    _check_restricted(c, tpl["spec"])
    # memory: the limit holds the tmpfs spool, the caches the flags allow and the log
    budgets = [
        int(args.window_cache_bytes), int(args.run_cache_bytes), int(args.generation_keep_bytes),
        int(args.packed_cache_bytes), RUNTIME_BYTES,
    ]  # fmt: skip
    spool = next(v for v in tpl["spec"]["volumes"] if v["name"] == "spool")
    assert spool["emptyDir"]["medium"] == "Memory"
    need = _k8s_bytes(spool["emptyDir"]["sizeLimit"]) * 2.2 + sum(budgets)  # spool + 1.2 x log
    assert _k8s_bytes(c["resources"]["limits"]["memory"]) >= need
    # owed rows and the spill share the tmpfs spool with the log: bounded well inside it (on a
    # tmpfs the "on disk" spill is memory: the default 8 GiB would not even fit)
    volume = _k8s_bytes(spool["emptyDir"]["sizeLimit"])
    assert 0 < args.owed_max_bytes <= volume // 4
    assert 0 < args.spill_max_bytes <= volume // 4
    assert args.owed_max_bytes + args.spill_max_bytes <= volume // 2
    # predictors keep their names (a StatefulSet behind a headless Service): no dead
    # consumer names after a rollout
    sts = by[("StatefulSet", "deltad-predictor")]
    assert ("Deployment", "deltad-predictor") not in by
    headless = by[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    ptpl = sts["spec"]["template"]
    pred = ptpl["spec"]["containers"][0]
    _check_restricted(pred, ptpl["spec"])
    pargv = _subst(pred["args"], {"POD_NAME": "deltad-predictor-3"})
    _check_deltad_argv(pargv)
    pargs = build_parser().parse_args(pargv)
    assert pargs.sidecar == ["deltad-relay-0:50051"]
    assert pargs.consumer == "deltad-predictor-3"
    name_env = {e["name"]: e for e in pred["env"]}["POD_NAME"]
    assert name_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def _check_restricted(container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """The restricted Pod Security profile, a pinned image tag, limits."""
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    image = container["image"]
    assert ":" in image and not image.endswith(":latest"), image
    assert container["resources"]["limits"]["memory"]
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    assert "/tmp" in mounts  # a writable /tmp on a read-only root file system


def test_the_manifests_images_are_the_packages_version() -> None:
    from deltad import __version__

    for f in ("relay.yaml", "pod.yaml"):
        for doc in yaml.safe_load_all((DOCKER / "k8s" / f).read_text()):
            spec = doc.get("spec", {})
            pod = spec.get("template", {}).get("spec", spec)
            for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
                assert c["image"] == f"deltad:{__version__}", (f, c["name"], c["image"])
