"""Probe a sidecar's gRPC health service: ``python -m deltad.healthcheck host:port``.

Exit 0 when the service answers SERVING, 1 otherwise (one line on stderr). Used by the
Docker HEALTHCHECK and the Kubernetes probes; imports nothing heavy (no torch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(
    target: str, *, service: str = "", timeout_s: float = 3.0, tls_ca: Path | None = None
) -> str:
    """The health status name of ``service`` at ``target`` (e.g. "SERVING")."""
    if tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
        channel = grpc.secure_channel(target, creds)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deltad.healthcheck", description=__doc__)
    p.add_argument("target", help="host:port of the sidecar")
    p.add_argument("--service", default="", help='service name ("" = the whole server)')
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA bundle for a TLS sidecar")
    args = p.parse_args(argv)
    try:
        status = check(
            args.target, service=args.service, timeout_s=args.timeout, tls_ca=args.tls_ca
        )
    except (grpc.RpcError, OSError) as e:
        detail = e.code().name if isinstance(e, grpc.RpcError) else str(e)
        print(f"deltad healthcheck: {args.target}: {detail}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"deltad healthcheck: {args.target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
