"""The archive in an S3-compatible bucket (``s3://bucket/prefix``, boto3).

Create-once: ``PutObject`` with ``If-None-Match: *`` (a 412 means the object exists). A server
that does not implement conditional writes (501, or one that ignores the header) still never
has an object replaced by other bytes: the archive's object keys are content-addressed (they
name the object's checksum), so a second write of a key writes the same bytes. The manifest's
compare-and-swap is ``If-Match: <ETag>`` (``If-None-Match: *`` to create it).

Credentials come from boto3's standard chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_PROFILE``, an instance
role), never from a flag. Every call has a connect and read timeout and few retries: the
uploader retries with its own backoff, so a store that is down is not waited on here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deltad.serve.archive.store import (
    ArchiveError,
    ArchiveUnavailable,
    ObjectStore,
    Versioned,
    check_key,
)

log = logging.getLogger(__name__)

#: seconds to connect / to wait for each read of an answer
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0

_UNAVAILABLE_CODES = {
    "500",
    "502",
    "503",
    "504",
    "SlowDown",
    "ServiceUnavailable",
    "RequestTimeout",
}


class S3Store(ObjectStore):
    """Objects under ``prefix`` in ``bucket`` of an S3-compatible server."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None) -> None:
        try:
            import boto3  # type: ignore[import-untyped]
            from botocore.config import Config  # type: ignore[import-untyped]
        except ImportError as e:  # pragma: no cover - an install without the extra
            raise ArchiveError("s3:// archives need boto3 (pip install deltad[archive])") from e
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint = endpoint
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1",
            config=Config(
                connect_timeout=CONNECT_TIMEOUT_S,
                read_timeout=READ_TIMEOUT_S,
                retries={"max_attempts": 2, "mode": "standard"},
                s3={"addressing_style": "path"},
                # checksums only where the server requires them (S3-compatible servers differ)
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        #: None until a conditional create was tried: does the server honour If-None-Match?
        self.conditional: bool | None = None

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, what: str, key: str, e: Exception) -> ArchiveError:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        where = f"{self.url} {what} {key}"
        if isinstance(e, ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _UNAVAILABLE_CODES or status in _UNAVAILABLE_CODES:
                return ArchiveUnavailable(f"{where}: {code or status}")
            return ArchiveError(f"{where}: {code or status}: {e}")
        if isinstance(e, BotoCoreError):  # connection refused, timeouts, no credentials
            name = type(e).__name__
            if "Credential" in name:
                return ArchiveError(f"{where}: {e}")
            return ArchiveUnavailable(f"{where}: {e}")
        return ArchiveUnavailable(f"{where}: {e}")

    @staticmethod
    def _code(e: Exception) -> tuple[str, int]:
        resp = getattr(e, "response", None) or {}
        code = str(resp.get("Error", {}).get("Code", ""))
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status

    def put_if_absent(self, key: str, src: Path) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        k = self._key(key)
        try:
            if self.conditional is not False:
                try:
                    with open(src, "rb") as f:
                        self._client.put_object(Bucket=self.bucket, Key=k, Body=f, IfNoneMatch="*")
                    self.conditional = True
                    return True
                except ClientError as e:
                    code, status = self._code(e)
                    if status == 412 or code in (
                        "PreconditionFailed",
                        "ConditionalRequestConflict",
                    ):
                        return False
                    if status != 501 and code != "NotImplemented":
                        raise
                    log.info("%s: no conditional writes; content-addressed keys only", self.url)
                    self.conditional = False
            if self._head(k) is not None:
                return False
            with open(src, "rb") as f:
                self._client.put_object(Bucket=self.bucket, Key=k, Body=f)
            return True
        except (ClientError, BotoCoreError) as e:
            raise self._fail("put", key, e) from e
        except OSError as e:
            raise ArchiveError(f"cannot read {src} for {self.url} {key}: {e}") from e

    def _head(self, k: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError  # type: ignore[import-untyped]

        try:
            resp: dict[str, Any] = self._client.head_object(Bucket=self.bucket, Key=k)
            return resp
        except ClientError as e:
            code, status = self._code(e)
            if status == 404 or code in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        k = self._key(key)
        kw: dict[str, Any] = {}
        if length is not None:
            if length <= 0:
                return b""
            kw["Range"] = f"bytes={start}-{start + length - 1}"
        elif start:
            kw["Range"] = f"bytes={start}-"
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=k, **kw)
            data: bytes = resp["Body"].read()
            return data
        except ClientError as e:
            code, status = self._code(e)
            if status == 404 or code in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"{self.url}/{key}") from None
            if status == 416 or code == "InvalidRange":  # a range past the end: no bytes
                return b""
            raise self._fail("get", key, e) from e
        except BotoCoreError as e:
            raise self._fail("get", key, e) from e

    def size(self, key: str) -> int | None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        try:
            head = self._head(self._key(key))
        except (ClientError, BotoCoreError) as e:
            raise self._fail("head", key, e) from e
        return None if head is None else int(head["ContentLength"])

    def list(self, prefix: str) -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        full = (
            self._key(prefix.rstrip("/")) + "/"
            if prefix
            else (f"{self.prefix}/" if self.prefix else "")
        )
        cut = len(self.prefix) + 1 if self.prefix else 0
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    yield str(obj["Key"])[cut:]
        except (ClientError, BotoCoreError) as e:
            raise self._fail("list", prefix, e) from e

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as e:
            raise self._fail("delete", key, e) from e

    def read_versioned(self, key: str) -> Versioned | None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return Versioned(resp["Body"].read(), str(resp["ETag"]))
        except ClientError as e:
            code, status = self._code(e)
            if status == 404 or code in ("NoSuchKey", "404"):
                return None
            raise self._fail("get", key, e) from e
        except BotoCoreError as e:
            raise self._fail("get", key, e) from e

    def compare_and_swap(self, key: str, data: bytes, expected: str | None) -> str | None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        cond = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            resp = self._client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, **cond
            )
            return str(resp["ETag"])
        except ClientError as e:
            code, status = self._code(e)
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return None
            raise self._fail("swap", key, e) from e
        except BotoCoreError as e:
            raise self._fail("swap", key, e) from e

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # pragma: no cover
            pass
