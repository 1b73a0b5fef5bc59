"""Gateway test fixtures: a real Redis, a per-test key prefix, the app under Litestar's test
client (or uvicorn, for real disconnects), and FakeWorker.

FakeWorker stands in for worker/service.py in these tests only (never shipped): a thread
writes the WorkerInfo heartbeat with a short TTL, another pops RQ job ids from the model's
queue, marks the job started as rq does, and runs a script that writes protocol events to
the request's stream. `die()` imitates kill -9: no more events, no more heartbeats, the
key expires by its TTL.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from litestar.testing import TestClient
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from gateway.app import create_app
from gateway.settings import Settings
from helpers.redis_server import delete_prefix, redis_for_tests, unique_prefix
from worker.protocol import (
    EVENT_FIELD,
    Done,
    Event,
    GenerateJob,
    Keys,
    Started,
    Token,
    Usage,
    WorkerInfo,
    decode_job,
    encode,
)

# Short timeouts so liveness tests take about a second (the production defaults are
# poll 1 s, worker heartbeat TTL 5 s).
FAST = {"poll_s": 0.05, "worker_timeout_s": 2.0, "queue_timeout_s": 10.0}


# ---- Redis ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_for_tests() as (url, _source):
        yield url


@pytest.fixture
def prefix(redis_url: str, request) -> Iterator[str]:
    p = unique_prefix("gw-" + re.sub(r"[^A-Za-z0-9_]+", "-", request.node.name[:20]))
    yield p
    delete_prefix(redis_url, p)


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)


# ---- the fake worker --------------------------------------------------------------------

Script = Callable[["FakeWorker", GenerateJob], None]


def reply(parts: list[str], finish: str = "stop", prompt_tokens: int = 7) -> Script:
    """Started, one Token per part (text may be ''), Done with exact usage."""

    def script(w: FakeWorker, job: GenerateJob) -> None:
        w.emit(job, Started(worker_id=w.worker_id, prompt_tokens=prompt_tokens))
        for i, part in enumerate(parts):
            w.emit(job, Token(ids=[100 + i], text=part))
        w.emit(job, Done(finish_reason=finish,
                         usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(parts))))

    return script


def events(*evs: Event) -> Script:
    def script(w: FakeWorker, job: GenerateJob) -> None:
        for ev in evs:
            w.emit(job, ev)

    return script


def die_after(n_tokens: int) -> Script:
    """Started, n tokens, then the worker dies (as kill -9) with the job in hand."""

    def script(w: FakeWorker, job: GenerateJob) -> None:
        w.emit(job, Started(worker_id=w.worker_id, prompt_tokens=3))
        for i in range(n_tokens):
            w.emit(job, Token(ids=[i], text=f"t{i} "))
        w.die()

    return script


def until_cancelled(step_s: float = 0.02, max_steps: int = 2000) -> Script:
    """Started, then one token per step until the cancel flag appears (checked between
    steps, like worker/jobs.py); then Done(cancelled)."""

    def script(w: FakeWorker, job: GenerateJob) -> None:
        w.emit(job, Started(worker_id=w.worker_id, prompt_tokens=3))
        for i in range(max_steps):
            if not w.running:
                return
            if w.redis.exists(w.keys.cancel(job.request_id)):
                w.saw_cancel.set()
                w.emit(job, Done(finish_reason="cancelled",
                                 usage=Usage(prompt_tokens=3, completion_tokens=i)))
                return
            w.emit(job, Token(ids=[i], text="x"))
            w.steps += 1
            time.sleep(step_s)   # stands in for one engine step

    return script


class FakeWorker:
    def __init__(self, redis_url: str, prefix: str, *, model: str = "demo", n_ctx: int = 2048,
                 ttl_s: float = 1.0, script: Script | None = None, serve: bool = True) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.keys = Keys(prefix)
        self.worker_id = f"fake-{uuid.uuid4().hex[:8]}"
        self.info = WorkerInfo(worker_id=self.worker_id, model=model, device="cpu", n_ctx=n_ctx,
                               started_at=time.time(), pid=os.getpid(), host="test")
        self.ttl_ms = int(ttl_s * 1000)
        self.script = script or reply(["Hello", " world", "", "!"])
        self.serve = serve
        self.jobs: list[GenerateJob] = []
        self.job_taken = threading.Event()
        self.saw_cancel = threading.Event()
        self.steps = 0
        self._stop = threading.Event()
        self._dead = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- life --

    def start(self) -> "FakeWorker":
        self._beat()
        for target in (self._heartbeat, self._work):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def die(self) -> None:
        """Like kill -9: nothing more is written; the heartbeat key expires by its TTL."""
        self.died_at = time.monotonic()
        self._dead.set()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        if not self._dead.is_set():
            self.redis.delete(self.keys.worker(self.worker_id))
        self.redis.close()

    @property
    def running(self) -> bool:
        return not (self._stop.is_set() or self._dead.is_set())

    def _beat(self) -> None:
        self.redis.set(self.keys.worker(self.worker_id), encode(self.info), px=self.ttl_ms)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_ms / 4000):
            if self._dead.is_set():
                return
            self._beat()

    def _work(self) -> None:
        queue = Queue(self.keys.queue(self.info.model), connection=self.redis)
        while self.running:
            if not self.serve:
                self._stop.wait(0.02)
                continue
            item = self.redis.blpop([queue.key], timeout=0.05)
            if item is None:
                continue
            try:
                job = Job.fetch(item[1].decode(), connection=self.redis)
            except NoSuchJobError:
                continue
            job.set_status(JobStatus.STARTED)   # as rq's worker does when it takes a job
            gjob = decode_job(job.args[0])
            self.jobs.append(gjob)
            self.job_taken.set()
            self.script(self, gjob)
            if self._dead.is_set():
                return
            job.set_status(JobStatus.FINISHED)
            self.redis.expire(job.key, 60)

    # -- writing events (as worker/jobs.py: XADD + EXPIRE) --

    def emit(self, job: GenerateJob, event: Event) -> None:
        if self._dead.is_set():
            return
        stream = self.keys.events(job.request_id)
        with self.redis.pipeline() as pipe:
            pipe.xadd(stream, {EVENT_FIELD: encode(event)})
            pipe.expire(stream, job.events_ttl_s)
            pipe.execute()


@pytest.fixture
def make_worker(redis_url: str, prefix: str) -> Iterator[Callable[..., FakeWorker]]:
    started: list[FakeWorker] = []

    def make(**kwargs) -> FakeWorker:
        w = FakeWorker(redis_url, prefix, **kwargs).start()
        started.append(w)
        return w

    yield make
    for w in started:
        w.stop()


@pytest.fixture
def worker(make_worker) -> FakeWorker:
    return make_worker()


# ---- the app ----------------------------------------------------------------------------

@pytest.fixture
def make_client(redis_url: str, prefix: str) -> Iterator[Callable[..., TestClient]]:
    """make_client(**settings) -> a started TestClient on a fresh app (FAST timeouts)."""
    clients: list[TestClient] = []

    def make(**overrides) -> TestClient:
        settings = Settings(**{"redis_url": redis_url, "prefix": prefix, **FAST, **overrides})
        client = TestClient(create_app(settings))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()


@pytest.fixture(scope="module")
def shared_client(redis_url: str) -> Iterator[TestClient]:
    """One app for a module's requests that never reach Redis (validation errors)."""
    p = unique_prefix("gw-shared")
    with TestClient(create_app(Settings(redis_url=redis_url, prefix=p, **FAST))) as client:
        yield client
    delete_prefix(redis_url, p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_url(redis_url: str, prefix: str) -> Iterator[str]:
    """The app under a real uvicorn in a thread (real sockets, so real disconnects)."""
    import uvicorn

    settings = Settings(redis_url=redis_url, prefix=prefix, port=free_port(), **FAST)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1",
                                           port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:   # uvicorn offers no event for "listening"
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{settings.port}"
    server.should_exit = True
    thread.join(timeout=10)


# ---- helpers for the tests ----------------------------------------------------------------

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}


def sse_lines(body: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing (`data: ...` + blank line)."""
    assert body.endswith("\n\n"), body[-100:]
    frames = body[:-2].split("\n\n")
    assert all(f.startswith("data: ") and "\n" not in f for f in frames), frames
    return [f[len("data: "):] for f in frames]


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
