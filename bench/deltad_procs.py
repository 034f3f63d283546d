"""Starting deltad's own processes for the benchmarks (sidecar, trainer), with clean stops.

Every check for a component that may not have landed yet lives here and answers with the
reason it is unavailable (or None), so a benchmark can report ``not available: <why>``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bench.common import MODEL, Children, Context, deltad_command, free_port, wait_until

T = TypeVar("T")


def module_unavailable(*modules: str) -> str | None:
    """None if every module imports, else why not."""
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:
            return f"{m} cannot be imported ({type(e).__name__}: {e})"
    return None


def sidecar_unavailable() -> str | None:
    """Why the sidecar (``deltad serve``) and the consumer library cannot be used, or None."""
    return module_unavailable("deltad.serve.cli", "deltad.consume.client", "deltad.wire")


def write_bench_spool(spool: Path, *, rows: int, tables: int, dim: int) -> dict[str, int]:
    """A spool whose fresh-consumer window is ``rows`` rows over ``tables`` tables."""
    from bench.datagen import write_spool  # (torch: not in a parent that only measures)

    return write_spool(
        spool, model=MODEL, tables=tables, rows_per_table=rows // tables, dim=dim, deltas=2
    )


#: ``deltad serve`` flags that keep the spool as written: no retention round merges its
#: segments before the pulls, so a window is merged by the pull, as the benchmark states
NO_RETENTION = ["--retention-interval", "86400"]


@dataclass
class Sidecar:
    """A running ``deltad serve`` child."""

    proc: Any
    endpoint: str
    model: str
    spool: Path
    log_path: Path
    children: Children
    #: its Prometheus /metrics port, where the caller asked for one (``--metrics-port``)
    metrics_port: int | None = None

    def stop(self) -> None:
        self.children.stop_popen(self.proc)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _answers(endpoint: str) -> bool:
    import grpc

    from deltad.v1 import delta_pb2 as pb
    from deltad.v1 import delta_pb2_grpc as pb_grpc

    ch = grpc.insecure_channel(endpoint)
    try:
        pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=1.0)
        return True
    except grpc.RpcError:
        return False
    finally:
        ch.close()


def start_sidecar(
    children: Children,
    spool: Path,
    ctx: Context,
    *,
    model: str = MODEL,
    redis_url: str | None = None,
    extra: list[str] | None = None,
    timeout_s: float = 90.0,
    require_head: bool = True,
    metrics: bool = False,
    port: int | None = None,
) -> Sidecar:
    """Start ``deltad serve`` on ``port`` (None: a free one) and wait until its Status answers
    (``metrics``: with ``/metrics`` on another free port, :attr:`Sidecar.metrics_port`)."""
    port = port or free_port()
    endpoint = f"127.0.0.1:{port}"
    spool.mkdir(parents=True, exist_ok=True)
    log_path = spool / f"sidecar-{port}.log"
    args = [
        *deltad_command(),
        "serve",
        "--spool",
        str(spool),
        "--model",
        model,
        "--listen",
        endpoint,
        "--grace-period",
        "1",
    ]
    if redis_url:
        args += ["--redis-url", redis_url]
    metrics_port = free_port() if metrics else None
    if metrics_port is not None:
        args += ["--metrics-port", str(metrics_port)]
    args += extra or []
    proc = children.popen(args, log_path=log_path)
    side = Sidecar(proc, endpoint, model, spool, log_path, children, metrics_port)
    ok = wait_until(lambda: proc.poll() is not None or _answers(endpoint), timeout_s, 0.2)
    if not ok or proc.poll() is not None:
        tail = side.log_tail()
        side.stop()
        raise RuntimeError(f"deltad serve did not come up on {endpoint}:\n{tail}")
    if require_head:
        _wait_head(endpoint, timeout_s)
    return side


def _wait_head(endpoint: str, timeout_s: float) -> None:
    import grpc

    from deltad.v1 import delta_pb2 as pb
    from deltad.v1 import delta_pb2_grpc as pb_grpc

    ch = grpc.insecure_channel(endpoint)
    try:
        stub = pb_grpc.DeltaServiceStub(ch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if stub.Status(pb.StatusRequest(), timeout=2.0).head_seq >= 0:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    finally:
        ch.close()
    raise RuntimeError(f"sidecar {endpoint} never indexed a segment")


def status(endpoint: str) -> Any:
    """The Status of the sidecar at ``endpoint`` (plaintext, 5 s deadline)."""
    import grpc

    from deltad.v1 import delta_pb2 as pb
    from deltad.v1 import delta_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        return pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=5.0)


def head_seq(endpoint: str) -> int:
    """The head seq at ``endpoint``; -2 when it does not answer."""
    try:
        return int(status(endpoint).head_seq)
    except Exception:
        return -2


def rounds_with_s3(
    prefix: str, repeat: int, one_round: Callable[[Path, Any, int], T]
) -> list[T] | None:
    """``one_round(tmp, s3, r)`` for r in 0..repeat-1, beside one embedded SeaweedFS
    (:class:`deltad.store.seaweed.EmbeddedS3`; its credentials in this process's environment,
    which the children inherit) in a temporary directory; None without the weed binary."""
    import os
    import tempfile

    from deltad.store.seaweed import EmbeddedS3, weed_binary

    binary = weed_binary()
    if binary is None:
        return None
    out: list[T] = []
    with tempfile.TemporaryDirectory(prefix=f"deltad-bench-{prefix}-") as tmp_s:
        tmp = Path(tmp_s)
        s3 = EmbeddedS3(binary, tmp / "seaweed").start()
        os.environ.update(s3.env())
        try:
            for r in range(repeat):
                out.append(one_round(tmp, s3, r))
        finally:
            s3.stop()
    return out
