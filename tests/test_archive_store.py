"""The object store seam against a real SeaweedFS and a real directory: create-once, ranged
reads, listing, deletion, compare-and-swap, and refusals (bad URLs, wrong credentials)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from s3kit import Seaweed, archive_url, own_seaweed, s3_env, seaweed  # noqa: F401

from deltad.errors import ConfigError
from deltad.serve.archive.opening import open_store
from deltad.serve.archive.store import ArchiveError, ObjectStore


@pytest.fixture(params=["file", "s3"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ObjectStore]:
    if request.param == "file":
        s = open_store(f"file://{tmp_path / 'archive'}")
    else:
        weed: Seaweed = request.getfixturevalue("seaweed")
        request.getfixturevalue("s3_env")
        s = open_store(archive_url(), endpoint=weed.endpoint)
    yield s
    s.close()


def _file(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / f"src-{len(data)}-{data[:4].hex()}"
    p.write_bytes(data)
    return p


def test_an_object_is_created_once_and_never_replaced(store: ObjectStore, tmp_path: Path) -> None:
    assert store.put_if_absent("m/a/obj", _file(tmp_path, b"first bytes"))
    assert not store.put_if_absent("m/a/obj", _file(tmp_path, b"other bytes!"))
    assert store.get("m/a/obj") == b"first bytes"
    assert store.size("m/a/obj") == 11
    assert store.size("m/a/none") is None


def test_ranged_reads_return_exactly_the_bytes_asked(store: ObjectStore, tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    store.put_if_absent("m/r/obj", _file(tmp_path, data))
    assert store.get("m/r/obj", 100, 17) == data[100:117]
    assert store.get("m/r/obj", 10000) == data[10000:]
    assert store.get("m/r/obj", len(data), 1) == b""  # past the end: nothing, no error
    with pytest.raises(FileNotFoundError):
        store.get("m/r/missing")


def test_listing_and_deleting(store: ObjectStore, tmp_path: Path) -> None:
    for k in ("m/l/a", "m/l/b/c", "m/other"):
        store.put_if_absent(k, _file(tmp_path, k.encode()))
    assert sorted(store.list("m/l/")) == ["m/l/a", "m/l/b/c"]
    store.delete("m/l/a")
    store.delete("m/l/a")  # gone already: no error
    assert sorted(store.list("m/l/")) == ["m/l/b/c"]


def test_compare_and_swap_moves_only_from_the_tag_read(store: ObjectStore) -> None:
    assert store.read_versioned("m/manifest") is None
    t1 = store.compare_and_swap("m/manifest", b"v1", None)
    assert t1 is not None
    assert store.compare_and_swap("m/manifest", b"again", None) is None  # it exists
    got = store.read_versioned("m/manifest")
    assert got is not None and got.data == b"v1" and got.tag == t1
    t2 = store.compare_and_swap("m/manifest", b"v2", t1)
    assert t2 is not None
    assert store.compare_and_swap("m/manifest", b"stale writer", t1) is None
    got = store.read_versioned("m/manifest")
    assert got is not None and got.data == b"v2"


@pytest.mark.parametrize(
    "url",
    [
        "ftp://x/y",
        "s3://key:secret@bucket/p",
        "file://relative/path",
        "s3://",
    ],
)
def test_bad_archive_urls_are_refused_with_one_clear_error(url: str) -> None:
    with pytest.raises(ConfigError, match="--archive"):
        open_store(url)


def test_wrong_credentials_are_refused_not_retried_forever(
    seaweed: Seaweed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-the-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s = open_store(archive_url(), endpoint=seaweed.endpoint)
    with pytest.raises(
        ArchiveError, match=r"InvalidAccessKeyId|AccessDenied|SignatureDoesNotMatch"
    ):
        s.put_if_absent("m/x", _file(tmp_path, b"x"))
    s.close()
