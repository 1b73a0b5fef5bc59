"""The gateway's configuration: one frozen, validated Settings built from SPECD_* variables.

`Settings.from_env(**overrides)` reads the environment, applies overrides (CLI flags; None
means "not given") and validates everything before the app takes traffic. A bad value
raises SettingsError (a SpecdError: `specd gateway` prints it as one line) naming the
variable, the value, what is allowed and what to change.

| field            | variable                 | default                   |
|------------------|--------------------------|---------------------------|
| redis_url        | SPECD_REDIS_URL, REDIS_URL | redis://127.0.0.1:6379/0 |
| prefix           | SPECD_REDIS_PREFIX       | specd                     |
| api_keys         | SPECD_API_KEYS (a,b,c)   | empty: auth off           |
| max_body_bytes   | SPECD_MAX_BODY_BYTES     | 1 MiB                     |
| max_queue        | SPECD_MAX_QUEUE          | 64 queued jobs per model  |
| worker_timeout_s | SPECD_WORKER_TIMEOUT_S   | 15 s                      |
| queue_timeout_s  | SPECD_QUEUE_TIMEOUT_S    | 300 s                     |
| poll_s           | SPECD_POLL_S             | 1 s                       |
| events_ttl_s     | SPECD_EVENTS_TTL_S       | 300 s                     |
| host / port      | SPECD_HOST / SPECD_PORT  | 127.0.0.1 / 8000          |
| log_level        | SPECD_LOG_LEVEL          | info                      |

Liveness (what the timeouts mean): a worker serving a request is dead when its heartbeat
key is gone (the worker's own TTL, ~5 s) or when the gateway has not seen that key
refreshed for worker_timeout_s (keep it above the workers' heartbeat interval). poll_s is
the XREAD BLOCK time, i.e. how often a silent request re-checks liveness. A job that no
worker starts within queue_timeout_s is cancelled (504).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlparse

from worker.errors import SpecdError
from worker.protocol import DEFAULT_PREFIX

MiB = 1024 * 1024
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-:]+")


class SettingsError(SpecdError, ValueError):
    """A configuration value is invalid; the message says which and what to change."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX           # Redis key prefix (worker.protocol.Keys)
    api_keys: tuple[str, ...] = ()         # Bearer keys accepted on /v1/*; empty: auth off
    max_body_bytes: int = 1 * MiB          # request bodies above this get 413
    max_queue: int = 64                    # queued (not started) jobs per model; at this: 429
    worker_timeout_s: float = 15.0         # heartbeat not seen refreshed this long: worker dead
    queue_timeout_s: float = 300.0         # no worker started the job this long: 504
    poll_s: float = 1.0                    # XREAD BLOCK time = liveness re-check period
    events_ttl_s: int = 300                # event stream / cancel flag lifetime in Redis
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"

    def __post_init__(self) -> None:
        self._validate()

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Settings from `environ` (default os.environ), then `overrides` (None = not given)."""
        env = os.environ if environ is None else environ
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise SettingsError(f"unknown gateway setting(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(names))}")
        values: dict[str, Any] = {}
        for name, var in _ENV.items():
            raw = env.get(var)
            if raw is None and name == "redis_url":
                raw, var = env.get("REDIS_URL"), "REDIS_URL"
            if raw is None or (raw.strip() == "" and name != "api_keys"):
                continue
            values[name] = _parse(name, var, raw)
        for name, value in overrides.items():
            if value is None:
                continue
            if name == "api_keys" and isinstance(value, str):
                value = _parse(name, "api_keys", value)
            values[name] = value
        return cls(**values)

    # -- validation --------------------------------------------------------------------

    def _validate(self) -> None:
        url = urlparse(self.redis_url) if isinstance(self.redis_url, str) else None
        if url is None or url.scheme not in ("redis", "rediss", "unix") or not (url.netloc or url.path):
            _fail("redis_url", self.redis_url,
                  "a Redis URL like redis://HOST:6379/0 (schemes redis, rediss, unix)")
        if not isinstance(self.prefix, str) or not _PREFIX_RE.fullmatch(self.prefix):
            _fail("prefix", self.prefix, "a non-empty key prefix of letters, digits and _ . - :")
        if not isinstance(self.api_keys, tuple) or not all(
                isinstance(k, str) and k and k == k.strip() and "," not in k for k in self.api_keys):
            _fail("api_keys", self.api_keys, "a tuple of non-empty keys without spaces or commas")
        _int_range("max_body_bytes", self.max_body_bytes, 1024, 1024 * MiB)
        _int_range("max_queue", self.max_queue, 1, 1_000_000)
        _float_range("poll_s", self.poll_s, 0.01, 30.0)
        _float_range("worker_timeout_s", self.worker_timeout_s, 0.1, 3600.0)
        if self.worker_timeout_s < self.poll_s:
            _fail("worker_timeout_s", self.worker_timeout_s,
                  f"at least poll_s ({self.poll_s} s, {_ENV['poll_s']})")
        _float_range("queue_timeout_s", self.queue_timeout_s, 0.1, 86400.0)
        _int_range("events_ttl_s", self.events_ttl_s, 10, 86400)
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            _fail("host", self.host, "a bind address such as 127.0.0.1 or 0.0.0.0")
        _int_range("port", self.port, 1, 65535)
        if self.log_level not in _LOG_LEVELS:
            _fail("log_level", self.log_level, f"one of {', '.join(_LOG_LEVELS)}")


_ENV = {
    "redis_url": "SPECD_REDIS_URL",
    "prefix": "SPECD_REDIS_PREFIX",
    "api_keys": "SPECD_API_KEYS",
    "max_body_bytes": "SPECD_MAX_BODY_BYTES",
    "max_queue": "SPECD_MAX_QUEUE",
    "worker_timeout_s": "SPECD_WORKER_TIMEOUT_S",
    "queue_timeout_s": "SPECD_QUEUE_TIMEOUT_S",
    "poll_s": "SPECD_POLL_S",
    "events_ttl_s": "SPECD_EVENTS_TTL_S",
    "host": "SPECD_HOST",
    "port": "SPECD_PORT",
    "log_level": "SPECD_LOG_LEVEL",
}
_INTS = {"max_body_bytes", "max_queue", "events_ttl_s", "port"}
_FLOATS = {"worker_timeout_s", "queue_timeout_s", "poll_s"}


def _parse(name: str, var: str, raw: str) -> Any:
    text = raw.strip()
    if name == "api_keys":
        return tuple(k.strip() for k in text.split(",") if k.strip())
    if name in _INTS:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise SettingsError(f"{var} must be an integer, got {raw!r}; fix or unset {var}") from None
    if name in _FLOATS:
        try:
            return float(text)
        except ValueError:
            raise SettingsError(f"{var} must be a number of seconds, got {raw!r}; "
                                f"fix or unset {var}") from None
    if name == "log_level":
        return text.lower()
    return text


def _fail(name: str, value: Any, rule: str) -> None:
    shown = "<hidden>" if name == "api_keys" else repr(value)
    raise SettingsError(f"gateway setting {name} ({_ENV[name]}) must be {rule}, got {shown}; "
                        f"fix {_ENV[name]} or the matching flag")


def _int_range(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _fail(name, value, f"an integer from {lo} to {hi}")


def _float_range(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        _fail(name, value, f"a number of seconds from {lo} to {hi}")
