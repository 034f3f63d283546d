"""Opening an archive by URL: ``file:///path`` (:mod:`.filestore`) or ``s3://bucket/prefix``
(:mod:`.s3store`), behind the :class:`~deltad.serve.archive.store.ObjectStore` seam."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from deltad.errors import ConfigError
from deltad.serve.archive.store import ObjectStore


def open_store(url: str, *, endpoint: str | None = None) -> ObjectStore:
    """The store at ``url``: ``file:///abs/path`` or ``s3://bucket[/prefix]`` (``endpoint``:
    an S3-compatible server's URL; credentials come from the standard AWS environment or
    shared credentials file, never from the URL). ConfigError for anything else."""
    u = urlparse(url)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path.startswith("/"):
            raise ConfigError(f"--archive {url!r}: a file URL names an absolute path, file:///p")
        if endpoint:
            raise ConfigError("--archive-endpoint is for s3:// archives")
        from deltad.serve.archive.filestore import FileStore

        return FileStore(Path(u.path))
    if u.scheme == "s3":
        if not u.netloc or "@" in u.netloc or u.password or u.username:
            raise ConfigError(
                f"--archive {url!r}: s3://BUCKET[/PREFIX], no credentials in it (they come "
                "from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_SHARED_CREDENTIALS_FILE)"
            )
        if endpoint is not None and urlparse(endpoint).scheme not in ("http", "https"):
            raise ConfigError(f"--archive-endpoint {endpoint!r}: an http:// or https:// URL")
        from deltad.serve.archive.s3store import S3Store

        return S3Store(u.netloc, u.path.strip("/"), endpoint=endpoint)
    raise ConfigError(f"--archive {url!r}: expected file:///path or s3://bucket/prefix")
