"""docker/healthcheck.py (specd-healthcheck, the probe of every image) against a real Redis
and a real HTTP port: a worker is healthy exactly when a live heartbeat of its own host name
is in Redis; --redis-down-ok keeps a worker alive while Redis is unreachable; the gateway is
healthy when GET /health answers 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from deploy_helpers import ROOT
from helpers.redis_server import delete_prefix, redis_for_tests, unique_prefix

from worker.protocol import Keys, WorkerInfo, encode

SCRIPT = ROOT / "docker" / "healthcheck.py"


def probe(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=30)


@pytest.fixture(scope="module")
def redis_url():
    with redis_for_tests() as (url, _source):
        yield url


@pytest.fixture
def prefix(redis_url):
    p = unique_prefix("hc")
    yield p
    delete_prefix(redis_url, p)


def beat(redis_url: str, prefix: str, host: str, ttl_ms: int = 5000) -> None:
    import redis

    info = WorkerInfo(worker_id=f"{host}-1-abcd", model="demo", device="cpu", n_ctx=2048, host=host,
                      started_at=time.time(), pid=1)
    client = redis.Redis.from_url(redis_url)
    client.set(Keys(prefix).worker(info.worker_id), encode(info), px=ttl_ms)
    client.close()


def test_worker_healthy_with_its_own_heartbeat(redis_url, prefix):
    beat(redis_url, prefix, "some-other-pod")
    r = probe("worker", SPECD_REDIS_URL=redis_url, SPECD_REDIS_PREFIX=prefix)
    assert r.returncode == 1 and "no live heartbeat" in r.stdout, r.stdout + r.stderr
    beat(redis_url, prefix, socket.gethostname())
    r = probe("worker", SPECD_REDIS_URL=redis_url, SPECD_REDIS_PREFIX=prefix)
    assert r.returncode == 0 and "serves demo on cpu" in r.stdout, r.stdout + r.stderr


def test_worker_unhealthy_once_the_heartbeat_expires(redis_url, prefix):
    beat(redis_url, prefix, socket.gethostname(), ttl_ms=300)
    time.sleep(0.5)
    r = probe("worker", SPECD_REDIS_URL=redis_url, SPECD_REDIS_PREFIX=prefix)
    assert r.returncode == 1, r.stdout


def test_worker_with_redis_down():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    r = probe("worker", SPECD_REDIS_URL=url)
    assert r.returncode == 1 and "Redis unreachable" in r.stdout, r.stdout + r.stderr
    r = probe("worker", "--redis-down-ok", SPECD_REDIS_URL=url)
    assert r.returncode == 0, r.stdout + r.stderr


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status,code", [(200, 0), (503, 1)])
def test_gateway_probe(status: int, code: int):
    handler = type("H", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = probe("gateway", SPECD_PORT=str(server.server_address[1]))
        assert r.returncode == code, r.stdout + r.stderr
    finally:
        server.shutdown()
        server.server_close()
    r = probe("gateway", SPECD_PORT=str(server.server_address[1]))  # nothing listens any more
    assert r.returncode == 1


def test_usage_errors_are_unhealthy_not_docker_reserved():
    r = probe("workers")
    assert r.returncode == 1 and "usage" in r.stderr
