#!/opt/specd/bin/python
"""specd-healthcheck: the container health probe of every specd image (Docker HEALTHCHECK,
compose healthcheck, Kubernetes exec probes). Installed as /opt/specd/bin/specd-healthcheck.

    specd-healthcheck gateway                 GET http://127.0.0.1:$SPECD_PORT/health == 200
    specd-healthcheck worker                  this container's worker heartbeat is in Redis
    specd-healthcheck worker --redis-down-ok  the same, but healthy while Redis is unreachable

A worker has no HTTP port: it proves it is alive by refreshing its heartbeat key
<prefix>:worker:<id> (worker/service.py, TTL ~5 s), whose WorkerInfo records the host name.
Every container (and pod) has its own host name, so "some live heartbeat has host ==
gethostname()" means "the worker in this container has loaded its model and is serving".
--redis-down-ok is for liveness probes: restarting a worker cannot bring Redis back, so an
unreachable Redis must not restart workers (readiness still reports it). Exit 0 = healthy,
1 = unhealthy; one line on stdout says why.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request


def gateway() -> tuple[bool, str]:
    port = os.environ.get("SPECD_PORT") or "8000"
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            return r.status == 200, f"{url} -> {r.status}"
    except OSError as exc:  # URLError, connection refused, timeout
        return False, f"{url}: {exc}"


def worker(redis_down_ok: bool) -> tuple[bool, str]:
    import redis

    from worker.protocol import DEFAULT_PREFIX, Keys, decode_worker

    url = os.environ.get("SPECD_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    keys = Keys(os.environ.get("SPECD_REDIS_PREFIX") or DEFAULT_PREFIX)
    host = socket.gethostname()
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        for key in client.scan_iter(match=keys.workers_pattern(), count=500):
            raw = client.get(key)
            if raw is None:
                continue  # expired between SCAN and GET
            try:
                info = decode_worker(raw)
            except Exception:  # a record from another version: not ours to judge
                continue
            if info.host == host:
                return True, f"worker {info.worker_id} serves {info.model} on {info.device}"
        return False, f"no live heartbeat from host {host} under {keys.workers_pattern()} (still loading?)"
    except redis.RedisError as exc:
        return redis_down_ok, f"Redis unreachable ({exc})" + ("; not the worker's fault" if redis_down_ok else "")
    finally:
        client.close()


# The accepted command lines (tests/deploy checks every probe in compose and Helm against them).
FORMS = (("gateway",), ("worker",), ("worker", "--redis-down-ok"))


def main(argv: list[str]) -> int:
    if tuple(argv) == ("gateway",):
        ok, why = gateway()
    elif tuple(argv) in FORMS:
        ok, why = worker(redis_down_ok="--redis-down-ok" in argv)
    else:
        print("usage: specd-healthcheck gateway | worker [--redis-down-ok]", file=sys.stderr)
        return 1  # Docker reserves exit status 2
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
