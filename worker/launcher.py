"""Process supervision for `specd up`: Redis, N workers and the gateway, each its own process.

    validate config -> pull the model once -> Redis (given, or started) -> N workers ->
    gateway -> wait for GET /ready == 200 and N live heartbeats -> print the URL -> supervise

Children run `python -m worker.cli worker|gateway ...` (this interpreter, explicit flags),
in their own session so a terminal's Ctrl-C reaches only this process, which then stops
them in order: the gateway first (no new requests), then the workers (SIGTERM: they
finish or fail their current job), then the Redis it started; SIGKILL after a grace
period. A child that dies on its own stops everything (exit 1), its last output lines
shown. Linux's parent-death signal takes the children down if this process is killed.

Workers: --workers CPU workers (sharing the cores), or with --device one worker per GPU
device listed (cuda:N / hip:N; a worker owns its device), CPU workers where cpu is listed too.

The gateway's internals are never imported here (ARCHITECTURE.md): only worker.protocol
for the heartbeat records, redis-py, the standard library, and worker.engine's device check
when a GPU device is asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from worker.cli import DEVICE
from worker.errors import SpecdError
from worker.generate import MAX_DRAFT_K
from worker.redis_local import LocalRedis, check_url, die_with_parent, env_url, start_local


def child_pythonpath(env: Mapping[str, str]) -> str:
    """PYTHONPATH for the workers and the gateway, which start with `python -P` (no current
    directory on sys.path): from inside a source checkout, `python -m worker.cli` would
    otherwise import the checkout's `worker/`, which holds no built engine unless it is the
    editable install. When this `worker` package was not imported from a site-packages
    folder (a checkout on PYTHONPATH or the current directory), its folder goes first, so
    children run the same code as `specd up`."""
    import site

    import worker

    root = str(Path(worker.__file__).resolve().parent.parent)
    sites = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return os.pathsep.join(rest if root in sites else [root, *rest])


DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"


class StackError(SpecdError):
    """`specd up` cannot start or keep running; the message says which part and why."""


def cpu_count() -> int:
    """Cores this process may run on (affinity-aware where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(workers: int, cores: int | None = None) -> int:
    """Threads per worker when not given: the cores split evenly, at least one each."""
    return max(1, (cpu_count() if cores is None else cores) // max(1, workers))


@dataclasses.dataclass(frozen=True)
class UpConfig:
    """What `specd up` starts. Built from flags (then SPECD_* variables, then defaults);
    validate() checks everything that can be checked before anything starts."""

    model: str = "demo"                  # a known name or a .gguf path
    host: str = DEFAULT_HOST             # the gateway's bind address
    port: int = DEFAULT_PORT
    workers: int = 1                     # CPU worker processes (when devices has cpu)
    devices: tuple[str, ...] | None = None  # the workers' devices; None: ("cpu",)
    redis_url: str | None = None         # None: $SPECD_REDIS_URL / $REDIS_URL, else start one
    threads_per_worker: int | None = None  # None: default_threads(workers)
    ctx_size: int | None = None          # None: the worker's default
    prefix: str | None = None            # Redis key prefix; None: the components' default
    draft: str | None = None             # the workers' --draft (None: theirs, $SPECD_DRAFT)
    draft_k: int | None = None           # the workers' --draft-k (None: theirs, $SPECD_DRAFT_K or 4)
    ready_timeout_s: float = 180.0       # from the first child's start to /ready
    grace_s: float = 10.0                # SIGTERM -> SIGKILL, per phase

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **flags) -> "UpConfig":
        """Flags that are None fall back to SPECD_PORT / SPECD_HOST / SPECD_MODEL /
        SPECD_REDIS_PREFIX, then to the defaults. Bad numbers raise StackError."""
        env = os.environ if env is None else env
        values = {k: v for k, v in flags.items() if v is not None}
        for field, var, conv in (("port", "SPECD_PORT", int), ("host", "SPECD_HOST", str),
                                 ("model", "SPECD_MODEL", str), ("prefix", "SPECD_REDIS_PREFIX", str)):
            if field not in values and env.get(var):
                try:
                    values[field] = conv(env[var])
                except ValueError:
                    raise StackError(f"${var} must be an integer, got {env[var]!r}") from None
        return cls(**values)

    def device_list(self) -> list[str]:
        return ["cpu"] if self.devices is None else list(self.devices)

    def worker_devices(self) -> list[str]:
        """One entry per worker to start: `workers` CPU workers where the devices list cpu,
        one worker per GPU device (a worker owns its device)."""
        out: list[str] = []
        for d in self.device_list():
            out += [d] * (self.workers if d == "cpu" else 1)
        return out

    def threads(self) -> int:
        """CPU threads of each CPU worker (they share the cores)."""
        return self.threads_per_worker or default_threads(self.workers)

    def validate(self) -> "UpConfig":
        def need_int(name: str, value: object, low: int, high: int | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (
                    high is not None and value > high):
                rule = f"between {low} and {high}" if high is not None else f">= {low}"
                raise StackError(f"{name} must be an integer {rule}, got {value!r}")

        need_int("--port", self.port, 1, 65535)
        need_int("--workers", self.workers, 1)
        if self.threads_per_worker is not None:
            need_int("--threads-per-worker", self.threads_per_worker, 1)
        if self.ctx_size is not None:
            need_int("--ctx-size", self.ctx_size, 1)
        if self.draft_k is not None:
            need_int("--draft-k", self.draft_k, 1, MAX_DRAFT_K)
        if not self.model:
            raise StackError("--model must be a known model name (demo) or a path to a .gguf file")
        self._validate_devices()
        if self.ready_timeout_s <= 0 or self.grace_s < 0:
            raise StackError("ready timeout must be > 0 and grace period >= 0")
        _check_port_free(self.host, self.port)
        return self

    def _validate_devices(self) -> None:
        devices = self.device_list()
        if not devices:
            raise StackError("--device needs at least one device: cpu, cuda:N or hip:N")
        seen: set[str] = set()
        for d in devices:
            if not isinstance(d, str) or not DEVICE.fullmatch(d):
                raise StackError(f"--device {d!r} is not one of cpu, cuda:N, hip:N (N = GPU index)")
            if d in seen:
                raise StackError(f"--device lists {d} twice; a worker owns its device, so list each once "
                                 f"(--workers sets how many CPU workers share cpu)")
            seen.add(d)
        if self.workers != 1 and "cpu" not in seen:
            raise StackError(f"--workers {self.workers} counts CPU workers, but --device lists no cpu; "
                             f"each GPU device gets one worker (add cpu to --device, or drop --workers)")
        gpus = [d for d in devices if d != "cpu"]
        if gpus:  # this install's backend, before anything starts (the worker would say the same)
            from worker.engine import check_device
            from worker.errors import InvalidRequestError

            for d in gpus:
                try:
                    check_device(d)
                except InvalidRequestError as exc:
                    raise StackError(str(exc)) from None


def _check_port_free(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StackError(f"--host {host!r} does not resolve ({exc}); try 127.0.0.1 or 0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise StackError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another port with "
                f"--port or stop what uses it"
            ) from None


def client_host(host: str) -> str:
    """Where a local client connects for a bind address (0.0.0.0 / :: mean every interface)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def base_url(host: str, port: int) -> str:
    h = client_host(host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


def curl_example(url: str, model: str, api_key_hint: bool = False) -> str:
    """Greedy (temperature 0): at the API's default of 1.0 the 135M demo model mostly
    rambles (measured: 5 of 5 samples without "Paris", one running to the context limit)."""
    body = json.dumps({"model": model, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    auth = " -H 'Authorization: Bearer <one of $SPECD_API_KEYS>'" if api_key_hint else ""
    return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"  -d '{body}'")


# ---- children ----

class Child:
    """One supervised process. stdout+stderr go through a pipe: each line is echoed to
    `echo` as `name | line` and the last lines kept for error reports."""

    def __init__(self, name: str, argv: list[str], *, env: Mapping[str, str] | None = None,
                 echo: TextIO | None = None, keep_lines: int = 30):
        self.name = name
        self.argv = argv
        self.tail: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._echo = echo
        self._echo_lock = threading.Lock()
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=None if env is None else dict(env), start_new_session=True,
            preexec_fn=die_with_parent, text=True, encoding="utf-8", errors="replace", bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, name=f"specd-up-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if self._echo is not None:
                with self._echo_lock:
                    try:
                        self._echo.write(f"{self.name:<9}| {line}\n")
                        self._echo.flush()
                    except (OSError, ValueError):  # our stderr went away
                        self._echo = None
        self.process.stdout.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            try:
                self.process.send_signal(sig)
            except ProcessLookupError:
                pass

    def join_output(self, timeout: float = 2.0) -> None:
        """Waits for the pipe's last lines (after the process exited)."""
        self._reader.join(timeout)

    def last_lines(self, n: int = 15) -> str:
        lines = list(self.tail)[-n:]
        return "\n".join(f"    {line}" for line in lines) if lines else "    (no output)"

    def describe_exit(self) -> str:
        rc = self.returncode
        if rc is None:
            return "running"
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with status {rc}"


def stop_children(children: list[Child], grace_s: float, force: threading.Event | None = None) -> None:
    """SIGTERM all and wait up to grace_s (a worker finishes its current job: warm stop);
    then SIGTERM again (a worker fails its job with an error event and exits: cold stop)
    and wait a little more; SIGKILL only what still runs. `force` cuts the waits short."""

    def wait_all(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for c in children:
            while c.returncode is None:
                left = deadline - time.monotonic()
                if left <= 0 or (force is not None and force.is_set()):
                    return
                try:
                    c.process.wait(min(left, 0.1))
                except subprocess.TimeoutExpired:
                    pass

    for c in children:
        c.signal(signal.SIGTERM)
    wait_all(grace_s)
    for c in children:
        if c.returncode is None:
            c.signal(signal.SIGTERM)
    wait_all(min(grace_s, 3.0))
    for c in children:
        if c.returncode is None:
            c.signal(signal.SIGKILL)
            c.process.wait()
        c.join_output()


# ---- the stack ----

class Stack:
    """Starts, supervises and stops one `specd up`. Use start() / supervise() / stop(),
    or run() which does all three with SIGINT/SIGTERM handling (CLI and tests)."""

    def __init__(self, config: UpConfig, *, out: TextIO | None = None, log: TextIO | None = None,
                 env: Mapping[str, str] | None = None, progress: bool = True):
        self.config = config
        self.out = out if out is not None else sys.stdout
        self.log = log if log is not None else sys.stderr
        self.env = dict(os.environ if env is None else env)
        self.progress = progress
        self.redis_url: str | None = None
        self.redis_source = ""
        self.redis: LocalRedis | None = None
        self.workers: list[Child] = []
        self.gateway: Child | None = None
        self.model_arg = config.model        # what workers get (absolute path for files)
        self.served_models: list[str] = []
        self.stopping = threading.Event()    # a signal asked us to stop
        self.force = threading.Event()       # a second signal: do not wait for the grace period
        self._prepared = False

    @property
    def prefix(self) -> str:
        """The Redis key prefix every child gets (explicitly: the readiness check reads it)."""
        from worker.protocol import DEFAULT_PREFIX

        return self.config.prefix or self.env.get("SPECD_REDIS_PREFIX") or DEFAULT_PREFIX

    @property
    def url(self) -> str:
        return base_url(self.config.host, self.config.port)

    @property
    def children(self) -> list[Child]:
        return [*self.workers, *([self.gateway] if self.gateway else [])]

    def say(self, text: str) -> None:
        print(f"specd: {text}", file=self.log, flush=True)

    # -- start --

    def prepare(self) -> None:
        """Everything before a child starts: checks, the given Redis, the model file."""
        if self._prepared:
            return
        self.config.validate()
        given = self.config.redis_url
        if given:
            check_url(given, what="--redis-url")
            self.redis_url, self.redis_source = given, "--redis-url"
        elif (found := env_url(self.env)) is not None:
            name, value = found
            check_url(value, what=f"${name}")
            self.redis_url, self.redis_source = value, f"${name}"
        self.model_arg = self._pull_model()
        self._prepared = True

    def _pull_model(self) -> str:
        """Pulls a known model once here (with a progress bar), so N workers never race
        to download it; a path is checked and made absolute."""
        from worker.models import KNOWN_MODELS, pull, resolve_model

        name = self.config.model
        if name in KNOWN_MODELS:
            self.say(f"model {name}: checking the local cache (first use downloads it)")
            path = pull(KNOWN_MODELS[name], progress=self.progress)
            self.say(f"model {name}: {path}")
            return name
        return str(Path(resolve_model(name)).resolve())

    def start(self) -> None:
        """prepare(), Redis, workers, gateway, then waits for readiness. Raises StackError
        (the caller must still call stop()) on failure or when a signal arrives."""
        self.prepare()
        if self.redis_url is None:
            self.redis = start_local()
            self.redis_url = self.redis.url
            self.redis_source = f"started {self.redis.kind}"
            self.say(f"Redis: {self.redis_url} ({self.redis_source}, in memory, stopped on exit)")
        else:
            self.say(f"Redis: {self.redis_url} (from {self.redis_source})")
        cfg = self.config
        threads = cfg.threads()
        child_env = {**self.env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": child_pythonpath(self.env)}
        cli = [sys.executable, "-P", "-m", "worker.cli"]  # -P: see child_pythonpath
        prefix = ["--prefix", self.prefix]
        self.say(f"starting {self.describe_workers()} and the gateway")
        for i, device in enumerate(cfg.worker_devices(), start=1):
            argv = [*cli, "worker", "--model", self.model_arg, "--device", device,
                    "--redis-url", self.redis_url, *prefix]
            if device == "cpu":
                argv += ["--threads", str(threads)]
            if cfg.ctx_size:
                argv += ["--ctx-size", str(cfg.ctx_size)]
            if cfg.draft:
                argv += ["--draft", cfg.draft]
            if cfg.draft_k is not None:
                argv += ["--draft-k", str(cfg.draft_k)]
            self.workers.append(Child(f"worker-{i}", argv, env=child_env, echo=self.log))
        self.gateway = Child("gateway", [*cli, "gateway", "--host", cfg.host, "--port", str(cfg.port),
                                         "--redis-url", self.redis_url, *prefix],
                             env=child_env, echo=self.log)
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Until every worker of ours has a heartbeat (read from Redis: no HTTP request,
        so the gateway's access log stays quiet) and then GET /ready answers 200. Fails
        fast when a child exits, on a signal, or after ready_timeout_s."""
        import redis

        from worker.protocol import Keys, decode_worker
        from worker.redis_local import no_retry

        keys = Keys(self.prefix)
        ours = {c.pid for c in self.workers}
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, retry=no_retry())
        deadline = time.monotonic() + self.config.ready_timeout_s
        live: dict[int, str] = {}
        last = "no answer yet"
        try:
            while True:
                dead = next((c for c in self.children if c.returncode is not None), None)
                if dead is not None:
                    dead.join_output()
                    raise StackError(f"{dead.name} {dead.describe_exit()} while starting; its last "
                                     f"output:\n{dead.last_lines()}")
                if self.stopping.is_set():
                    raise StackError("interrupted while starting")
                if len(live) < len(ours):
                    try:
                        for key in client.scan_iter(match=keys.workers_pattern(), count=1000):
                            raw = client.get(key)
                            if raw:
                                info = decode_worker(raw)
                                if info.pid in ours:
                                    live[info.pid] = info.model
                    except redis.RedisError as exc:
                        last = f"Redis: {exc}"
                    else:
                        last = f"{len(live)} of {len(ours)} workers loaded"
                if len(live) == len(ours):
                    status, answer = http_get(f"{self.url}/ready")
                    if status == 200:
                        self.served_models = sorted(set(live.values()))
                        return
                    last = f"GET {self.url}/ready: {answer}"
                if time.monotonic() > deadline:
                    raise StackError(f"not ready after {self.config.ready_timeout_s:.0f} s ({last}); "
                                     f"see the output above")
                # Neither a worker's load nor the gateway's bind signals us: poll, briefly.
                self.stopping.wait(0.1 if len(live) < len(ours) else 0.25)
        finally:
            client.close()

    def describe_workers(self) -> str:
        """'1 worker(s) x 2 thread(s)' (CPU only), '2 worker(s): cuda:0, cuda:1',
        '3 worker(s): cuda:0, 2 x cpu (1 thread(s) each)'."""
        cfg = self.config
        devices = cfg.worker_devices()
        if set(devices) == {"cpu"}:
            return f"{len(devices)} worker(s) x {cfg.threads()} thread(s)"
        parts = [d for d in cfg.device_list() if d != "cpu"]
        if "cpu" in devices:
            parts.append(f"{cfg.workers} x cpu ({cfg.threads()} thread(s) each)")
        return f"{len(devices)} worker(s): {', '.join(parts)}"

    def banner(self) -> str:
        model = self.served_models[0] if self.served_models else self.config.model
        keys = bool(self.env.get("SPECD_API_KEYS"))
        return (
            f"specd is up: {self.url}/v1  (model {', '.join(self.served_models) or model}; "
            f"{self.describe_workers()}; Redis {self.redis_url})\n"
            f"Try it:\n{curl_example(self.url, model, api_key_hint=keys)}\n"
            f"OpenAI SDK: base_url=\"{self.url}/v1\". Press Ctrl-C to stop."
        )

    # -- run --

    def supervise(self) -> int:
        """Blocks until a signal (returns 0) or a child's unexpected exit (returns 1)."""
        while not self.stopping.is_set():
            dead = next((c for c in self.children if c.returncode is not None), None)
            if dead is not None:
                dead.join_output()
                print(f"error: {dead.name} (pid {dead.pid}) {dead.describe_exit()} unexpectedly; "
                      f"stopping everything. Its last output:\n{dead.last_lines()}", file=self.log, flush=True)
                return 1
            # Children are not ours to wait() on from a second thread; a short poll is cheap.
            self.stopping.wait(0.25)
        return 0

    def stop(self) -> None:
        """Gateway, then workers, then the Redis we started. Idempotent."""
        grace = self.config.grace_s
        if self.gateway is not None:
            stop_children([self.gateway], grace, self.force)
        if self.workers:
            stop_children(self.workers, grace, self.force)
        if self.redis is not None:
            self.redis.stop(grace_s=min(grace, 5.0))

    def _on_signal(self, signum, frame) -> None:
        if self.stopping.is_set():
            self.force.set()  # second Ctrl-C: kill without waiting
        self.stopping.set()

    def run(self) -> int:
        """The whole life of `specd up`: 0 after Ctrl-C/SIGTERM, 1 when a child failed.
        Configuration errors raise StackError before anything starts."""
        self.prepare()  # validation + model pull (Ctrl-C here is a plain KeyboardInterrupt)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self.start()
            except StackError as exc:
                if self.stopping.is_set():
                    self.say("interrupted while starting; stopping what started")
                    return 0
                print(f"error: {exc}", file=self.log, flush=True)
                return 1
            print(self.banner(), file=self.out, flush=True)
            rc = self.supervise()
            if rc == 0:
                self.say("stopping (Ctrl-C again to kill at once)")
            return rc
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.say("stopped")


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: never via a proxy


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int | None, str]:
    """(status, short body) of a GET; (None, reason) when nothing answered."""
    try:
        with _opener.open(url, timeout=timeout_s) as r:
            return r.status, r.read(300).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, f"{exc.code} {exc.read(300).decode('utf-8', 'replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return None, f"no answer ({getattr(exc, 'reason', exc)})"
