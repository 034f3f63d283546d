"""Probe a sidecar's gRPC health service: ``python -m deltad.healthcheck [host:port]``.

Exit 0 when the service answers SERVING, 1 otherwise, 2 for a bad target or --timeout (one
line on stderr either way). Used by the Docker HEALTHCHECK and the Kubernetes probes;
imports nothing heavy (no torch).

Without a target it probes the sidecar configured in this environment, the way the sidecar
reads it: the port of ``DELTAD_LISTEN`` on 127.0.0.1, over TLS when ``DELTAD_TLS_CERT`` is
set (verified with ``DELTAD_TLS_CA``, else the server's own certificate), presenting
``DELTAD_TLS_CLIENT_CERT`` / ``DELTAD_TLS_CLIENT_KEY`` when the sidecar requires client
certificates (``DELTAD_TLS_CLIENT_CA``; the server's own pair if no client pair is set).

Two questions: readiness (the default, service "": the sidecar and its dependencies, e.g. the
offset store, serve) and liveness (``--service deltad.liveness``: the process serves at all;
a restart would help). Point a liveness probe at the second, so an outage of Redis does not
restart every sidecar.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltad.config import Range, check_endpoint, check_number
from deltad.errors import ConfigError

#: The health service name that answers liveness only (SERVING while the process serves).
LIVENESS_SERVICE = "deltad.liveness"


def check(
    target: str,
    *,
    service: str = "",
    timeout_s: float = 3.0,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    server_name: str | None = None,
) -> str:
    """The health status name of ``service`` at ``target`` (e.g. "SERVING")."""
    if tls_ca is not None or tls_cert is not None:  # a client certificate means TLS too
        creds = grpc.ssl_channel_credentials(
            root_certificates=tls_ca.read_bytes() if tls_ca else None,
            private_key=tls_key.read_bytes() if tls_key else None,
            certificate_chain=tls_cert.read_bytes() if tls_cert else None,
        )
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="python -m deltad.healthcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "target",
        nargs="?",
        default=None,
        help="host:port of the sidecar (default: 127.0.0.1 and the port of DELTAD_LISTEN)",
    )
    p.add_argument(
        "--service",
        default="",
        help=f'service name: "" (default) = readiness, {LIVENESS_SERVICE} = liveness',
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA bundle for a TLS sidecar")
    p.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mTLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="client private key (mTLS)")
    p.add_argument("--server-name", default=env("DELTAD_TLS_SERVER_NAME"), help="TLS name")
    args = p.parse_args(argv)
    if args.target is None:
        port = (env("DELTAD_LISTEN") or "127.0.0.1:50051").rsplit(":", 1)[-1]
        args.target = f"127.0.0.1:{port}"
        server_cert, server_key = env("DELTAD_TLS_CERT"), env("DELTAD_TLS_KEY")
        if args.tls_ca is None and server_cert:
            args.tls_ca = Path(env("DELTAD_TLS_CA") or server_cert)
        if args.tls_cert is None and env("DELTAD_TLS_CLIENT_CA"):
            cert = env("DELTAD_TLS_CLIENT_CERT") or server_cert
            key = env("DELTAD_TLS_CLIENT_KEY") or server_key
            args.tls_cert, args.tls_key = (Path(cert), Path(key)) if cert and key else (None, None)
    try:  # a probe given a bad flag must not read as "sidecar unhealthy" (exit 1)
        check_endpoint("target", args.target)
        check_number("--timeout", args.timeout, Range(0, 3600, lo_open=True))
    except ConfigError as e:
        print(f"deltad healthcheck: error: {e}", file=sys.stderr)
        return 2
    try:
        status = check(
            args.target,
            service=args.service,
            timeout_s=args.timeout,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            server_name=args.server_name,
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
