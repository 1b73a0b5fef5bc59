"""Fixtures for the integration tests: a real Redis and per-test key prefixes.

`redis_url` (session): REDIS_URL if set, else a testcontainers Redis when a Docker daemon
answers, else a local redis-server on a free port started here and stopped at the end
(tests/helpers/redis_server.py). Never FLUSH it: it may be shared (CI, a dev's Redis).
`redis_prefix` (per test): a unique Redis key prefix; its keys (and RQ's keys for queues
under it) are deleted after the test.
`redis_client` (per test): a redis.Redis on redis_url, closed after the test.
"""

from __future__ import annotations

import re

import pytest

from helpers.redis_server import delete_prefix, redis_for_tests, unique_prefix


@pytest.fixture(scope="session")
def redis_url() -> str:
    with redis_for_tests() as (url, _source):
        yield url


@pytest.fixture
def redis_prefix(redis_url: str, request) -> str:
    prefix = unique_prefix(re.sub(r"[^A-Za-z0-9_]+", "-", request.node.name[:24]))
    yield prefix
    delete_prefix(redis_url, prefix)


@pytest.fixture
def redis_client(redis_url: str):
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
