"""Settings: SPECD_* parsing, overrides, validation messages, and failing at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers.gateway_fakes import free_port
from gateway.settings import MiB, Settings, SettingsError
from worker.errors import SpecdError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.redis_url, s.prefix, s.api_keys) == ("redis://127.0.0.1:6379/0", "specd", ())
    assert (s.max_body_bytes, s.max_queue, s.host, s.port) == (MiB, 64, "127.0.0.1", 8000)


def test_environment_and_overrides():
    env = {"SPECD_REDIS_URL": "redis://r:1/2", "REDIS_URL": "redis://ignored:1/0",
           "SPECD_REDIS_PREFIX": "p1", "SPECD_API_KEYS": " a, b,,c ", "SPECD_MAX_BODY_BYTES": "4096",
           "SPECD_MAX_QUEUE": "3", "SPECD_WORKER_TIMEOUT_S": "7.5", "SPECD_QUEUE_TIMEOUT_S": "60",
           "SPECD_POLL_S": "0.5", "SPECD_HOST": "0.0.0.0", "SPECD_PORT": "9000",
           "SPECD_LOG_LEVEL": "WARNING", "SPECD_EVENTS_TTL_S": "100"}
    s = Settings.from_env(env)
    assert s == Settings(redis_url="redis://r:1/2", prefix="p1", api_keys=("a", "b", "c"),
                         max_body_bytes=4096, max_queue=3, worker_timeout_s=7.5, queue_timeout_s=60,
                         poll_s=0.5, host="0.0.0.0", port=9000, log_level="warning", events_ttl_s=100)
    # Flags override the environment; None means "flag not given".
    s = Settings.from_env(env, port=8100, host=None, prefix="p2", api_keys="x,y")
    assert (s.port, s.host, s.prefix, s.api_keys) == (8100, "0.0.0.0", "p2", ("x", "y"))
    assert Settings.from_env({"REDIS_URL": "redis://h:6/0"}).redis_url == "redis://h:6/0"
    assert Settings.from_env({"SPECD_API_KEYS": ""}).api_keys == ()


@pytest.mark.parametrize("env, message", [
    ({"SPECD_PORT": "abc"}, "SPECD_PORT must be an integer, got 'abc'; fix or unset SPECD_PORT"),
    ({"SPECD_PORT": "70000"}, "gateway setting port (SPECD_PORT) must be an integer from 1 to 65535, "
                              "got 70000; fix SPECD_PORT or the matching flag"),
    ({"SPECD_MAX_QUEUE": "0"}, "gateway setting max_queue (SPECD_MAX_QUEUE) must be an integer from 1 "
                               "to 1000000, got 0; fix SPECD_MAX_QUEUE or the matching flag"),
    ({"SPECD_MAX_BODY_BYTES": "10"}, "max_body_bytes (SPECD_MAX_BODY_BYTES) must be an integer from "
                                     "1024 to"),
    ({"SPECD_WORKER_TIMEOUT_S": "soon"}, "SPECD_WORKER_TIMEOUT_S must be a number of seconds, got "
                                         "'soon'"),
    ({"SPECD_WORKER_TIMEOUT_S": "0.5", "SPECD_POLL_S": "1"},
     "worker_timeout_s (SPECD_WORKER_TIMEOUT_S) must be at least poll_s (1.0 s, SPECD_POLL_S), got 0.5"),
    ({"SPECD_QUEUE_TIMEOUT_S": "-1"}, "queue_timeout_s (SPECD_QUEUE_TIMEOUT_S) must be a number of "
                                      "seconds from 0.1 to 86400.0, got -1.0"),
    ({"SPECD_REDIS_URL": "localhost:6379"}, "redis_url (SPECD_REDIS_URL) must be a Redis URL like "
                                            "redis://HOST:6379/0"),
    ({"SPECD_REDIS_PREFIX": "a b"}, "prefix (SPECD_REDIS_PREFIX) must be a non-empty key prefix"),
    ({"SPECD_LOG_LEVEL": "loud"}, "log_level (SPECD_LOG_LEVEL) must be one of critical, error, "
                                  "warning, info, debug, trace, got 'loud'"),
])
def test_invalid_values_say_what_to_change(env, message):
    with pytest.raises(SettingsError) as ei:
        Settings.from_env(env)
    assert message in str(ei.value)
    assert isinstance(ei.value, SpecdError)   # `specd gateway` prints it as one line


def test_invalid_overrides():
    with pytest.raises(SettingsError, match="unknown gateway setting"):
        Settings.from_env({}, colour="red")
    with pytest.raises(SettingsError, match=r"port \(SPECD_PORT\) must be an integer"):
        Settings.from_env({}, port="80")
    with pytest.raises(SettingsError) as ei:
        Settings(api_keys=("has space ",))
    assert "<hidden>" in str(ei.value)   # keys are never echoed


def _gateway_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    return {**env, **extra}


def test_gateway_fails_at_start_with_a_message():
    res = subprocess.run([sys.executable, "-m", "gateway"], cwd=ROOT, capture_output=True, text=True,
                         env=_gateway_env(SPECD_MAX_QUEUE="zero"), timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: SPECD_MAX_QUEUE must be an integer, got 'zero'; fix or "
                                  "unset SPECD_MAX_QUEUE")


def test_serve_runs_uvicorn(redis_url, prefix):
    """python -m gateway -> serve(settings): answers /health, stops on SIGTERM."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--port", str(port)], cwd=ROOT,
                            env=_gateway_env(SPECD_REDIS_URL=redis_url, SPECD_REDIS_PREFIX=prefix,
                                             SPECD_LOG_LEVEL="warning"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:   # no readiness signal from a child process but its port: poll it
            try:
                res = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.05)
        assert res.status_code == 200 and res.json()["status"] == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM)


def test_gateway_imports_no_engine_code():
    """The gateway image has no numpy and no native build: importing it must not need them."""
    code = ("import sys, gateway.app, gateway.server, gateway.__main__\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'gguf', 'tokenizers',"
            " 'jinja2') or (m.startswith('worker.') and m not in ('worker.protocol', 'worker.errors')))\n"
            "print('loaded:', bad)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "loaded: []"
