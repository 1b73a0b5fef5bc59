"""The gateway's only Redis file: enqueue jobs, read their event streams, flag cancellation,
and judge worker liveness.

One request's life here:
    submit(job)   -> RQ enqueue on Keys.queue(model) (sync rq API in a thread; rq is quick)
    Subscription  -> XREAD BLOCK poll_s on Keys.events(request_id), yields protocol Events
                     (Started, Token*, Done | Error). When a read times out it checks
                     liveness and, if the request cannot finish, yields a synthesized Error:
                       queued too long (queue_timeout_s)        -> 504 queue_timeout, job cancelled
                       no live worker for the model (worker_timeout_s) -> 503 no_worker, cancelled
                       serving worker's heartbeat key gone, or not refreshed for worker_timeout_s
                                                                -> 504 worker_timeout, job moved to
                                                                   RQ's FailedJobRegistry
                       Redis unreachable                        -> 503 redis_unavailable
    aclose()      -> after Done/Error: DEL the stream; otherwise (client gone, gateway error):
                     SET Keys.cancel(request_id) (TTL events_ttl_s) and cancel a still-queued job.

Heartbeat refresh is seen through PTTL: an untouched key's PTTL falls with wall time, so a
PTTL above (previous PTTL - elapsed) means the worker wrote it again.
Redis errors outside a stream become ApiError 503 (redis_unavailable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import anyio.to_thread
import msgspec
import redis
import redis.asyncio as aredis
from redis.exceptions import RedisError
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry

try:  # rq >= 2.5: the worker-less failure path rq itself uses for abandoned jobs
    from rq.job_lifecycle import record_job_failure as _record_job_failure
except ImportError:  # pragma: no cover
    _record_job_failure = None

from gateway.errors import ApiError, unavailable
from gateway.settings import Settings
from worker.protocol import (
    EVENT_FIELD,
    JOB_FUNC,
    Done,
    Error,
    Event,
    GenerateJob,
    Keys,
    Started,
    WorkerInfo,
    decode_event,
    decode_worker,
    encode,
)

log = logging.getLogger("specd.gateway")

JOB_TIMEOUT_S = 3600        # RQ's per-job timeout (a generation is bounded by max_tokens)
RESULT_TTL_S = 60           # the job function's return value is unused: Done is in the stream
FAILURE_TTL_S = 86400       # failed jobs stay inspectable for a day
# A rewrite raises PTTL by at least the worker's heartbeat period above (previous PTTL -
# elapsed); the slack absorbs ms rounding and round-trip jitter and must stay below that period.
_REFRESH_SLACK_MS = 10
_CLOSE_TIMEOUT_S = 2.0      # best effort clean-up on close (Redis may be the thing that failed)


def redis_down(exc: Exception) -> ApiError:
    return unavailable(f"Redis is unavailable ({type(exc).__name__}: {exc}); "
                       f"check SPECD_REDIS_URL and that Redis is running", "redis_unavailable")


@contextmanager
def _redis_errors() -> Iterator[None]:
    try:
        yield
    except RedisError as exc:
        raise redis_down(exc) from None


@dataclass
class _Cached:
    at: float
    workers: list[WorkerInfo]


class Events:
    """Redis access for the whole app (one per process, built in the lifespan)."""

    def __init__(self, client: aredis.Redis, sync_client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.sync = sync_client               # rq's API is synchronous
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self._queues: dict[str, Queue] = {}
        self._cache: _Cached | None = None
        self._refresh: asyncio.Task | None = None   # background worker-list refresh, if running
        self._seen: dict[str, float] = {}     # model -> monotonic time a live worker served it

    async def aclose(self) -> None:
        """Stop a background refresh (the Redis clients belong to their own lifespans)."""
        if self._refresh is not None:
            self._refresh.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(self._refresh, return_exceptions=True)

    # ---- liveness ---------------------------------------------------------------------

    async def ping(self) -> None:
        with _redis_errors():
            await self.redis.ping()

    async def workers(self, max_age_s: float | None = None) -> list[WorkerInfo]:
        """Live workers (their heartbeat keys exist). With max_age_s=None the cached list is
        returned even when older than poll_s/2, and a refresh starts in the background
        (SCAN walks the whole keyspace: requests should not wait for it); an explicit
        max_age_s (0 = fresh) waits for a refresh when the cache is older."""
        now = time.monotonic()
        cached = self._cache
        if max_age_s is None:
            if cached is not None:
                if now - cached.at > self.settings.poll_s / 2 and self._refresh is None:
                    self._refresh = asyncio.create_task(self._refresh_in_background())
                return cached.workers
        elif cached is not None and now - cached.at <= max_age_s:
            return cached.workers
        return await self._scan_workers()

    async def _refresh_in_background(self) -> None:
        try:
            await self._scan_workers()
        except ApiError as exc:
            log.warning("refreshing the worker list failed: %s", exc.message)
        finally:
            self._refresh = None

    async def _scan_workers(self) -> list[WorkerInfo]:
        with _redis_errors():
            keys = [k async for k in self.redis.scan_iter(match=self.keys.workers_pattern(),
                                                          count=10_000)]
            values = await self.redis.mget(keys) if keys else []
        workers = []
        for key, value in zip(keys, values):
            if value is None:           # expired between SCAN and MGET
                continue
            try:
                workers.append(decode_worker(value))
            except msgspec.MsgspecError:
                log.warning("ignoring undecodable heartbeat %r (worker version mismatch?)", key)
        now = time.monotonic()
        for w in workers:
            self._seen[w.model] = now
        self._cache = _Cached(now, workers)
        return workers

    async def served(self, max_age_s: float | None = None) -> dict[str, list[WorkerInfo]]:
        """Served model name -> its live workers."""
        by_model: dict[str, list[WorkerInfo]] = {}
        for w in await self.workers(max_age_s):
            by_model.setdefault(w.model, []).append(w)
        return by_model

    def known_models(self) -> list[str]:
        """Models some live worker served since this process started (for metrics)."""
        return sorted(self._seen)

    async def route(self, model: str) -> list[WorkerInfo]:
        """The live workers of `model`, or ApiError 404 (not served) / 503 (no live worker).
        A refusal is only ever based on a fresh worker list."""
        served = await self.served()
        if model in served:
            return served[model]
        served = await self.served(max_age_s=0)
        if model in served:
            return served[model]
        if model in self._seen:
            ago = time.monotonic() - self._seen[model]
            raise unavailable(f"no live worker serves model '{model}' (last seen {ago:.0f} s ago); "
                              f"start one with `specd worker --model {model}` or retry later",
                              "no_worker")
        if not served:
            raise unavailable("no live worker is registered; start one with `specd worker` "
                              "(or `specd up`) and retry", "no_worker")
        names = ", ".join(sorted(served))
        raise ApiError(404, f"model '{model}' is not served; available: {names} (see GET /v1/models)",
                       param="model", code="model_not_found")

    # ---- queues -----------------------------------------------------------------------

    def _queue(self, model: str) -> Queue:
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = Queue(self.keys.queue(model), connection=self.sync)
        return q

    async def queue_depth(self, model: str) -> int:
        """Jobs waiting (not yet taken by a worker) on the model's RQ queue."""
        with _redis_errors():
            return int(await self.redis.llen(self._queue(model).key))

    async def submit(self, job: GenerateJob) -> "Subscription":
        """Enqueue the job; the returned Subscription must be closed (aclose)."""
        try:
            await anyio.to_thread.run_sync(self._enqueue, job)
        except RedisError as exc:
            raise redis_down(exc) from None
        return Subscription(self, job)

    def _enqueue(self, job: GenerateJob) -> None:
        self._queue(job.model).enqueue(
            JOB_FUNC, encode(job),
            job_id=job.request_id,
            description=f"generate {job.model} {job.request_id}",
            job_timeout=JOB_TIMEOUT_S,
            result_ttl=RESULT_TTL_S,
            failure_ttl=FAILURE_TTL_S,
            ttl=int(self.settings.queue_timeout_s) + 60,   # backstop if this gateway dies
        )

    # ---- cancellation and failure -----------------------------------------------------

    async def cancel(self, request_id: str) -> None:
        """Ask the worker to stop (it polls the key between engine steps)."""
        await self.redis.set(self.keys.cancel(request_id), b"1", ex=self.settings.events_ttl_s)

    def retire_job(self, request_id: str, reason: str, *, taken: bool, fail: bool) -> None:
        """(sync: run it in a thread) Take the job out of RQ's live state. A job still waiting
        (and not `taken`: no Started seen) is cancelled (CanceledJobRegistry). A job a worker
        took is marked failed with `reason` in the FailedJobRegistry when `fail` (its worker
        is dead or stuck), else left to the worker (which sees the cancel flag). Finished
        jobs are left alone."""
        try:
            job = Job.fetch(request_id, connection=self.sync)
        except NoSuchJobError:
            return
        status = job.get_status(refresh=False)
        if status in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED):
            return
        if not taken and status in (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
            try:
                job.cancel()
            except InvalidJobOperation:
                pass
            return
        if not fail:
            return
        queue = Queue(job.origin, connection=self.sync)
        with self.sync.pipeline() as pipe:
            registry = job.started_job_registry
            if hasattr(registry, "remove_executions"):   # rq >= 2.0 keys executions
                registry.remove_executions(job, pipeline=pipe)
            else:  # pragma: no cover
                registry.remove(job, pipeline=pipe)
            pipe.lrem(queue.key, 0, job.id)
            if _record_job_failure is not None:   # status, FailedJobRegistry and a failure Result
                _record_job_failure(job, reason, pipe)
            else:  # pragma: no cover - older rq
                job.set_status(JobStatus.FAILED, pipeline=pipe)
                FailedJobRegistry(queue=queue).add(job, ttl=job.failure_ttl or FAILURE_TTL_S,
                                                   exc_string=reason, pipeline=pipe)
            pipe.execute()
        log.warning("job %s failed: %s", request_id, reason)


class Subscription:
    """One request's event stream, read with XREAD BLOCK. Use `await next()` until it returns
    Done or Error, then `await aclose()` (always, also on errors and disconnects)."""

    def __init__(self, events: Events, job: GenerateJob) -> None:
        self.events = events
        self.job = job
        self.request_id = job.request_id
        self._stream = events.keys.events(job.request_id)
        self._last_id: bytes | str = "0-0"
        self._buffer: deque[Event] = deque()
        self.finished = False                   # a Done or Error was returned
        self.worker_id: str | None = None
        now = time.monotonic()
        self._submitted = now
        self._worker_seen = now                 # last time a live worker of the model existed
        self._alive = now                       # last sign of life of the serving worker
        self._pttl: tuple[float, int] | None = None

    async def next(self) -> Event:
        if self.finished and not self._buffer:
            raise RuntimeError("subscription already finished")
        settings = self.events.settings
        block_ms = max(1, int(settings.poll_s * 1000))
        while not self._buffer:
            try:
                got = await self.events.redis.xread({self._stream: self._last_id}, count=256,
                                                    block=block_ms)
            except RedisError as exc:
                return self._end(Error(message=f"lost the connection to Redis while waiting for "
                                               f"the worker ({type(exc).__name__}: {exc})",
                                       code="redis_unavailable", status=503))
            if got:
                self._take(got)
                continue
            error = await self._check()
            if error is None:
                continue
            try:   # the worker may have written its last events just before the check
                got = await self.events.redis.xread({self._stream: self._last_id}, count=256)
            except RedisError:
                got = None
            if got:
                self._take(got)
                continue
            await self._retire(error.message)
            return self._end(error)
        event = self._buffer.popleft()
        if isinstance(event, Started):
            self.worker_id = event.worker_id
            self._alive, self._pttl = time.monotonic(), None
        elif isinstance(event, (Done, Error)):
            self.finished = True
            self._buffer.clear()
        return event

    def _take(self, got: list) -> None:
        self._alive = time.monotonic()
        for _stream, entries in got:
            for entry_id, fields in entries:
                self._last_id = entry_id
                try:
                    self._buffer.append(decode_event(fields[EVENT_FIELD]))
                except (KeyError, msgspec.MsgspecError) as exc:
                    self._buffer.append(Error(
                        message=f"undecodable event from the worker ({exc}); gateway and worker "
                                f"versions may differ", code="bad_event", status=502))

    def _end(self, error: Error) -> Error:
        self.finished = True
        self._buffer.clear()
        return error

    async def _check(self) -> Error | None:
        """None while the request can still finish, else the error to end it with."""
        s = self.events.settings
        now = time.monotonic()
        model = self.job.model
        try:
            if self.worker_id is None:
                if now - self._submitted > s.queue_timeout_s:
                    return Error(message=f"no worker started the request within "
                                         f"{s.queue_timeout_s:g} s (the queue of model '{model}' is "
                                         f"busy or its workers are stuck); retry later, add workers "
                                         f"or raise SPECD_QUEUE_TIMEOUT_S",
                                 code="queue_timeout", status=504)
                if any(w.model == model for w in await self.events.workers()):
                    self._worker_seen = now
                elif now - self._worker_seen > s.worker_timeout_s:
                    return Error(message=f"no live worker serves model '{model}' any more; the "
                                         f"request was not started; retry when a worker is up",
                                 code="no_worker", status=503)
                return None
            pttl = await self.events.redis.pttl(self.events.keys.worker(self.worker_id))
        except (RedisError, ApiError):
            return None   # the next XREAD reports Redis trouble
        if pttl == -2:
            return self._dead("its heartbeat expired")
        if pttl >= 0:
            if self._pttl is not None:
                t0, p0 = self._pttl
                if pttl > p0 - (now - t0) * 1000 + _REFRESH_SLACK_MS:
                    self._alive = now
            self._pttl = (now, pttl)
            if now - self._alive > s.worker_timeout_s:
                return self._dead(f"its heartbeat was not refreshed for {s.worker_timeout_s:g} s")
        return None

    def _dead(self, why: str) -> Error:
        return Error(message=f"worker {self.worker_id} stopped answering while serving this "
                             f"request ({why}); the request failed, retry it",
                     code="worker_timeout", status=504)

    async def _retire(self, reason: str) -> None:
        """Give up on the request: flag it cancelled; cancel the job if still queued, else
        (its worker died or hangs) fail it in RQ with the reason."""
        with anyio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
            try:
                await self.events.cancel(self.request_id)
                await anyio.to_thread.run_sync(
                    lambda: self.events.retire_job(self.request_id, reason,
                                                   taken=self.worker_id is not None, fail=True))
            except RedisError as exc:
                log.warning("could not retire job %s: %s", self.request_id, exc)

    async def aclose(self) -> None:
        """Finished: drop the stream. Not finished (client gone, error): cancel the request."""
        with anyio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
            try:
                if self.finished:
                    await self.events.redis.delete(self._stream)
                    return
                self.finished = True
                await self.events.cancel(self.request_id)
                if self.worker_id is None:   # still queued: make sure no worker starts it
                    await anyio.to_thread.run_sync(
                        lambda: self.events.retire_job(self.request_id, "cancelled: client left",
                                                       taken=False, fail=False))
            except RedisError as exc:
                log.warning("could not close request %s cleanly: %s", self.request_id, exc)
