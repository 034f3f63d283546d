"""docker/k8s/relay.yaml: the relay tier's manifests run existing commands with existing flags,
and the tier is wired sidecar -> relay -> predictors."""

from __future__ import annotations

from typing import Any

import yaml
from test_docker import DOCKER, _check_deltad_argv, _check_healthcheck_argv, _subst

from deltad.cli import build_parser
from deltad.healthcheck import LIVENESS_SERVICE
from deltad.serve.cli import build_relay_config


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
    for probe in ("readinessProbe", "livenessProbe"):
        _check_healthcheck_argv(c[probe]["exec"]["command"])
    live, ready = c["livenessProbe"]["exec"]["command"], c["readinessProbe"]["exec"]["command"]
    assert live[live.index("--service") + 1] == LIVENESS_SERVICE  # the process only
    assert "--service" not in ready  # readiness: the relay and its upstream
    pred = by[("Deployment", "deltad-predictor")]["spec"]["template"]["spec"]["containers"][0]
    pargv = _subst(pred["args"], {"POD_NAME": "deltad-predictor-abc"})
    _check_deltad_argv(pargv)
    assert build_parser().parse_args(pargv).sidecar == ["deltad-relay-0:50051"]
