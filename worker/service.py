"""The resident worker process: load one model once, announce it, serve its RQ queue.

    run_worker("demo", redis_url="redis://127.0.0.1:6379/0")     # what `specd worker` calls
    python -m worker.service --model demo --redis-url redis://...  # the same, without the CLI

Start-up: check the device and Redis, load worker.generate.Generator (once), install it
for worker.jobs, write the first heartbeat, then serve Keys(prefix).queue(model) with
ResidentWorker, an rq SimpleWorker (jobs run in this process: no fork per job, so the
engine stays resident).

Heartbeat: a thread SETs Keys.worker(worker_id) = WorkerInfo with PX ttl_s every
heartbeat_s; the gateway treats a worker whose key expired as dead (kill -9, hung host).
While a job runs the same thread also refreshes RQ's execution entry with a short TTL,
so a job whose worker died is moved to RQ's FailedJobRegistry ("abandoned") by the next
registry cleanup (any live worker's maintenance every MAINTENANCE_S, or the gateway
calling StartedJobRegistry.cleanup()) instead of sitting there for the job timeout.

Stopping (SIGTERM or SIGINT, once): take no new job, finish the current one (Done),
delete the heartbeat key, exit 0; queued jobs stay queued for another worker. An idle
worker polls the queue with a POLL_S blocking pop, so it notices the request within
POLL_S; a stop never interrupts a pop, so no dequeued job can be dropped. A second
signal (more than 1 s after the first) is rq's cold shutdown: SystemExit is raised in the
running job, which then ends with Error(503, code worker_shutdown) and is recorded failed.

Job timeout: UnixSignalDeathPenalty (SIGALRM in this process, no fork); a job runs for at
least JOB_TIMEOUT_S (the gateway's enqueue may ask for longer) and then ends with
Error(504). RQ results are kept RESULT_TTL_S: the event stream carries every answer.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from worker.errors import InvalidRequestError, SpecdError
from worker.protocol import DEFAULT_PREFIX, Keys, WorkerInfo, encode

log = logging.getLogger("specd.worker")

JOB_TIMEOUT_S = 3600       # safety net against a hung engine; generation is bounded by n_ctx
RESULT_TTL_S = 60          # RQ return values (always None) are not used
FAILURE_TTL_S = 24 * 3600  # failed jobs stay inspectable for a day (rq's default: a year)
POLL_S = 1                 # blocking-pop timeout while idle = worst-case idle stop latency
MAINTENANCE_S = 10         # rq registry cleanup interval (moves abandoned jobs to failed)
PUBSUB_JOIN_S = 5          # at a stop, the longest wait for rq's command thread (a daemon)


# ---- configuration ----

def check_device(device: str) -> str:
    """worker.engine.check_device (imported on use: loading this module loads no native code)."""
    from worker.engine import check_device as check

    return check(device)


def served_name(model: str, name: str | None = None) -> str:
    """The model name clients use: `name` if given, a known name as is, else the file stem."""
    from worker.models import KNOWN_MODELS

    if name is None:
        name = model if model in KNOWN_MODELS else Path(model).stem
    if not name or any(c.isspace() for c in name):
        raise InvalidRequestError(f"served model name {name!r} must be non-empty, without spaces")
    return name


def _connect(redis_url: str):
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=30,
                                      health_check_interval=30)
    except ValueError as exc:
        raise InvalidRequestError(
            f"--redis-url {redis_url!r} is not a Redis URL ({exc}); expected e.g. redis://127.0.0.1:6379/0"
        ) from None
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        raise SpecdError(
            f"cannot reach Redis at {redis_url!r}: {str(exc).rstrip('.')}; start it or fix --redis-url"
        ) from None
    return client


# ---- heartbeat ----

class Heartbeat:
    """SETs the WorkerInfo key (PX ttl) every period; while a job runs, also keeps its RQ
    execution alive (see the module header). One thread, started and stopped here."""

    def __init__(self, redis, key: str, info: WorkerInfo, state, period_s: float, ttl_s: float):
        self.redis, self.key, self.info, self.state = redis, key, info, state
        self.period_s, self.ttl_ms = period_s, int(ttl_s * 1000)
        self.worker = None            # the ResidentWorker, once it exists
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specd-heartbeat", daemon=True)
        self._failing = False

    def beat(self) -> None:
        import msgspec

        info = msgspec.structs.replace(self.info, current_request=self.state.current_request)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.key, encode(info), px=self.ttl_ms)
            if self.worker is not None:
                self.worker.refresh_execution(pipe)
            pipe.execute()

    def start(self) -> None:
        self.beat()                    # visible before the first job can arrive
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
                if self._failing:
                    log.warning("heartbeat: Redis answers again")
                self._failing = False
            except Exception as exc:   # Redis blip: keep trying; the key expires meanwhile
                if not self._failing:
                    log.warning("heartbeat: cannot write %s: %s", self.key, exc)
                self._failing = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.redis.delete(self.key)
        except Exception as exc:
            log.warning("could not delete heartbeat key %s: %s (it expires by itself)", self.key, exc)


# ---- the RQ worker ----

def _resident_worker_class():
    from rq.worker import SimpleWorker, WorkerStatus
    from rq.utils import now

    class ResidentWorker(SimpleWorker):
        """SimpleWorker with a cooperative stop (a signal never interrupts a pop or a job),
        a polling dequeue, and a short execution TTL kept alive by the Heartbeat thread."""

        execution_ttl_s = 10

        @property
        def dequeue_timeout(self) -> int:
            return POLL_S

        def _install_signal_handlers(self):
            signal.signal(signal.SIGINT, self._request_warm_stop)
            signal.signal(signal.SIGTERM, self._request_warm_stop)

        def _request_warm_stop(self, signum, frame):
            self._stop_requested = True
            self._shutdown_requested_date = now()
            signal.signal(signal.SIGINT, self.request_force_stop)
            signal.signal(signal.SIGTERM, self.request_force_stop)
            busy = self.get_state() == WorkerStatus.BUSY
            log.info("worker %s: %s received; %s", self.name, signal.Signals(signum).name,
                     "finishing the current job, then stopping" if busy else "stopping")

        def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
            # rq's loop retries timed-out pops forever; pop in POLL_S slices instead and
            # look at the stop flag between them. None ends work() (it breaks on None).
            while not self._stop_requested:
                result = super().dequeue_job_and_maintain_ttl(POLL_S, max_idle_time=POLL_S)
                if result is not None:
                    return result
            return None

        def unsubscribe(self):
            # rq's order, UNSUBSCRIBE and then stop the command thread, loses a race with
            # redis-py 8.2's PubSubWorkerThread.stop() (it joins without a timeout): a thread
            # that reads the UNSUBSCRIBE reply before its flag clears goes back to wait for a
            # subscription for get_message's 60 s, and the stopping worker waits with it (a
            # SIGTERM'd worker took 60 s to exit in 1 run of test_worker.py in 4 on a loaded
            # 2-core machine). The flag first, then the reply wakes the thread, which sees it
            # and closes its connection.
            thread = self.pubsub_thread
            if thread is None:
                return
            self.pubsub_thread = None
            try:
                thread.stop(timeout=0)   # (where stop() takes a timeout it also joins: bounded here)
            except TypeError:
                thread.stop()            # (redis-py 5: only clears the flag)
            try:
                self.pubsub.unsubscribe()
            except Exception as exc:     # Redis gone: the daemon thread dies with the process
                log.warning("worker %s: cannot unsubscribe from %s: %s", self.name, self.pubsub_channel_name, exc)
            thread.join(timeout=PUBSUB_JOIN_S)
            if thread.is_alive():
                log.warning("worker %s: command thread still running after %.0f s; exiting without it",
                            self.name, PUBSUB_JOIN_S)

        def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
            return self.execution_ttl_s

        def execute_job(self, job, queue):
            t = job.timeout
            job.timeout = JOB_TIMEOUT_S if t is None or t < 0 else max(t, JOB_TIMEOUT_S)
            if job.failure_ttl is None:
                job.failure_ttl = FAILURE_TTL_S
            self._queue_of_job = queue
            try:
                super().execute_job(job, queue)
            finally:
                self._running = None

        def prepare_execution(self, job):
            execution = super().prepare_execution(job)
            self._running = (execution, self._queue_of_job)   # one tuple: read atomically
            return execution

        def refresh_execution(self, pipe) -> None:
            """Called from the heartbeat thread: extend the running job's execution TTL."""
            running = getattr(self, "_running", None)
            if running is None:
                return
            execution, queue = running
            self.heartbeat(self.execution_ttl_s, pipeline=pipe)
            execution.heartbeat(queue.started_job_registry, self.execution_ttl_s, pipeline=pipe)

    return ResidentWorker


# ---- entry point ----

def run_worker(
    model: str,
    *,
    device: str = "cpu",
    redis_url: str,
    prefix: str = DEFAULT_PREFIX,
    name: str | None = None,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    heartbeat_s: float = 1.0,
    ttl_s: float = 5.0,
    draft: str | None = None,
    draft_k: int = 4,
    adaptive: bool = True,
) -> int:
    """Serves `model` from Redis until SIGTERM/SIGINT; returns the process exit code.

    model: a known name (demo) or a .gguf path; device: cpu, cuda:N or hip:N (the GPU
    backends need a build with SPECD_BACKEND=cuda|hip); redis_url: where the queues live; prefix: Keys prefix shared
    with the gateway (SPECD_REDIS_PREFIX); name: served model name (default: the known
    name, else the file stem); n_ctx / n_threads: engine options (None = engine default);
    heartbeat_s / ttl_s: heartbeat period and key TTL (the gateway declares a worker
    dead ttl_s after its last beat); draft / draft_k / adaptive: speculative decoding for
    every request, as Generator takes them (a draft model path or name, or "ngram"; None:
    off): the output is the same, only faster (adaptive: speculative steps only while they
    beat plain ones).

    Returns 0 after a requested stop, 1 if the serving loop ended on its own (e.g. Redis
    timed out). Bad configuration raises SpecdError (the CLI prints it, exit 2) before
    anything is loaded or announced.
    """
    check_device(device)
    if not heartbeat_s > 0 or not ttl_s > heartbeat_s:
        raise InvalidRequestError(
            f"heartbeat period ({heartbeat_s} s) must be > 0 and below the heartbeat TTL ({ttl_s} s)"
        )
    served = served_name(model, name)
    _setup_logging()
    redis = _connect(redis_url)
    keys = Keys(prefix)
    from rq import Queue

    from worker import jobs
    from worker.generate import Generator

    t0 = time.perf_counter()
    generator = Generator(model, n_ctx=n_ctx, n_threads=n_threads, device=device, draft=draft, draft_k=draft_k,
                          adaptive=adaptive)
    host, pid = socket.gethostname(), os.getpid()
    worker_id = f"{host}-{pid}-{uuid.uuid4().hex[:8]}"
    state = jobs.Resident(generator=generator, redis=redis, keys=keys, worker_id=worker_id, model=served)
    info = WorkerInfo(worker_id=worker_id, model=served, device=device, n_ctx=generator.n_ctx, capacity=1,
                      started_at=time.time(), pid=pid, host=host)
    heartbeat = Heartbeat(redis, keys.worker(worker_id), info, state, heartbeat_s, ttl_s)
    queue = Queue(keys.queue(served), connection=redis)
    worker = _resident_worker_class()(
        [queue], name=worker_id, connection=redis, default_result_ttl=RESULT_TTL_S,
        maintenance_interval=MAINTENANCE_S,
    )
    worker.execution_ttl_s = max(2, math.ceil(ttl_s) + 1)
    jobs.install(state)
    try:
        heartbeat.worker = worker
        heartbeat.start()
        log.info("worker %s: serving %s (%s, n_ctx %d, loaded in %.1f s) from queue %s", worker_id, served,
                 device, generator.n_ctx, time.perf_counter() - t0, queue.name)
        worker.work(logging_level="WARNING")
    finally:
        heartbeat.stop()
        jobs.uninstall()
        generator.close()
        redis.close()
    stopped = worker._stop_requested
    log.info("worker %s: stopped after %d jobs%s", worker_id, state.jobs_done,
             "" if stopped else " (the serving loop ended on its own; see the errors above)")
    return 0 if stopped else 1


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s specd-worker %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    from worker.cli import draft_flags

    p = argparse.ArgumentParser(prog="python -m worker.service", description=run_worker.__doc__.split("\n")[0])
    p.add_argument("--model", "-m", default="demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--redis-url", default=os.environ.get("SPECD_REDIS_URL") or os.environ.get("REDIS_URL")
                   or "redis://127.0.0.1:6379/0")
    p.add_argument("--prefix", default=os.environ.get("SPECD_REDIS_PREFIX", DEFAULT_PREFIX))
    p.add_argument("--name", default=None)
    p.add_argument("--ctx-size", "-c", type=int, default=None)
    p.add_argument("--threads", "-t", type=int, default=None)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--ttl-s", type=float, default=5.0)
    draft_flags(p, env=True)  # (as `specd worker`: defaults from $SPECD_DRAFT, $SPECD_DRAFT_K)
    a = p.parse_args(argv)
    try:
        return run_worker(a.model, device=a.device, redis_url=a.redis_url, prefix=a.prefix, name=a.name,
                          n_ctx=a.ctx_size, n_threads=a.threads, heartbeat_s=a.heartbeat_s, ttl_s=a.ttl_s,
                          draft=a.draft, draft_k=a.draft_k, adaptive=not a.draft_always)
    except SpecdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
