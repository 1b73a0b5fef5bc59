"""The Redis <-> engine boundary: one GenerateJob in, one request's Event stream out.

RQ calls `run_generate(payload)` (protocol.JOB_FUNC) inside the resident worker process
(worker/service.py), which installs the loaded Generator here once with `install()`.

Event stream of one request (Redis Stream Keys.events(request_id), field EVENT_FIELD):
    [Started]  Token*  (Done | Error)
  - Started(worker_id, prompt_tokens) once the prompt is tokenized and checked, before
    the prefill; a request refused before that (bad input, cancelled while queued, a
    malformed payload) ends with its terminal event alone.
  - one Token per engine step (1 token today, 1..k+1 with speculation): the ids the model
    generated and the text they settled ('' while held back, e.g. the final EOS).
  - exactly one terminal event: Done(stop | length | cancelled, usage) or Error.
Every write is XADD + EXPIRE(events_ttl_s) in one pipeline.

Usage: prompt_tokens = tokens of the rendered prompt (chat template included);
completion_tokens = tokens the model generated for the request, including the final
end-of-turn / EOS token when one ended it, and the token that completed a stop string
(vLLM counts the same way). Streamed and non-streamed responses both take usage from the
one Done event, so they agree by construction.

Redis round trips per job: 1 (cancel check) + 1 (Started) + 1 per engine step: each
step's pipeline is XADD Token [+ XADD Done] + EXPIRE + EXISTS cancel, so the cancel flag
set during step k is seen before step k+1 starts (a cancelled request costs at most the
one step already running).

JobRunner owns one request (start -> step* -> terminal event). run_generate drives a
single runner to the end; a continuous-batching loop would hold several runners and
step them together, writing the same events.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

import msgspec

from worker.errors import InvalidRequestError
from worker.protocol import (
    EVENT_FIELD,
    Done,
    Error,
    Event,
    GenerateJob,
    Keys,
    SamplingParams,
    Started,
    Token,
    Usage,
    decode_job,
    encode,
)

log = logging.getLogger("specd.worker")

FINISH_CANCELLED = "cancelled"
_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
_UNDECODABLE_TTL_S = 300   # stream TTL when the payload (and its events_ttl_s) is unreadable


@dataclasses.dataclass
class Resident:
    """What stays loaded between jobs: set up once by worker/service.py."""

    generator: object              # worker.generate.Generator (not imported: keeps this file light)
    redis: object                  # redis.Redis shared with the heartbeat thread (thread-safe pool)
    keys: Keys
    worker_id: str
    model: str                     # served model name
    current_request: str | None = None   # read by the heartbeat thread
    jobs_done: int = 0


_resident: Resident | None = None


def install(state: Resident) -> None:
    global _resident
    _resident = state


def uninstall() -> None:
    global _resident
    _resident = None


def resident() -> Resident:
    if _resident is None:
        raise RuntimeError(
            "no resident engine in this process: worker.jobs.run_generate runs inside "
            "`specd worker` (worker.service.run_worker), not a plain `rq worker`"
        )
    return _resident


class RequestError(Exception):
    """Ends a request with an Error event (raised before any Token was sent)."""

    def __init__(self, event: Error):
        super().__init__(event.message)
        self.event = event


def _invalid(message: str, param: str | None, code: str | None = None) -> RequestError:
    return RequestError(Error(message=message, type="invalid_request_error", code=code,
                              param=param, status=400))


def context_error(n_ctx: int, n_prompt: int, max_tokens: int | None, chat: bool) -> RequestError:
    """OpenAI's wording for prompt + completion over the context window."""
    param = "messages" if chat else "prompt"
    where = "in the messages" if chat else "in the prompt"
    if max_tokens is None:
        msg = (f"This model's maximum context length is {n_ctx} tokens. However, your {param} "
               f"resulted in {n_prompt} tokens, which leaves no room for the completion. "
               f"Please reduce the length of the {param}.")
    else:
        msg = (f"This model's maximum context length is {n_ctx} tokens. However, you requested "
               f"{n_prompt + max_tokens} tokens ({n_prompt} {where}, {max_tokens} in the "
               f"completion). Please reduce the length of the {param} or completion.")
    return _invalid(msg, param, "context_length_exceeded")


def _param_of(message: str, default: str | None) -> str | None:
    """The request field a validation message names ('temperature must be ...')."""
    head = message.split(" ", 1)[0]
    return head if head in _SAMPLING_FIELDS else default


class JobRunner:
    """One request on the resident engine.

    start() checks and tokenizes, writes Started and returns True if generation should
    proceed; step() runs one engine step and writes its Token (and the terminal event on
    the last step), returning True while more steps remain; fail() writes an Error.
    Exactly one terminal event is written whatever happens (the `ended` flag).
    """

    def __init__(self, state: Resident, job: GenerateJob):
        self.state = state
        self.job = job
        self.stream = state.keys.events(job.request_id)
        self.cancel_key = state.keys.cancel(job.request_id)
        self.ttl = max(1, int(job.events_ttl_s))
        self.chat = job.messages is not None
        self.n_prompt = 0
        self.n_generated = 0
        self.finish_reason: str | None = None
        self.ended = False
        self.error: Error | None = None
        self.engine_tok_s = 0.0
        self._deltas: Iterator | None = None
        self.t_taken = time.perf_counter()
        self.queued_s = max(0.0, time.time() - job.created) if job.created else None  # gateway -> here
        self.t_first: float | None = None   # first Token event written
        self.t_end: float | None = None

    # ---- Redis writes ----

    def _write(self, *events: Event, check_cancel: bool = False) -> bool:
        """XADD the events + EXPIRE in one round trip; with check_cancel, also EXISTS the
        cancel flag and return whether it is set."""
        pipe = self.state.redis.pipeline(transaction=False)
        for ev in events:
            pipe.xadd(self.stream, {EVENT_FIELD: encode(ev)})
        pipe.expire(self.stream, self.ttl)
        if check_cancel:
            pipe.exists(self.cancel_key)
        out = pipe.execute()
        if any(isinstance(ev, (Done, Error)) for ev in events):
            if isinstance(events[-1], Error):
                self.finish_reason = "error"
                self.error = events[-1]
            self.ended = True
            self.t_end = time.perf_counter()
        return bool(out[-1]) if check_cancel else False

    def _usage(self) -> Usage:
        return Usage(prompt_tokens=self.n_prompt, completion_tokens=self.n_generated)

    # ---- lifecycle ----

    def start(self) -> bool:
        job, gen = self.job, self.state.generator
        if self.state.redis.exists(self.cancel_key):       # the client left while queued
            self.finish_reason = FINISH_CANCELLED
            self._write(Done(finish_reason=FINISH_CANCELLED, usage=self._usage()))
            return False
        try:
            ids, max_tokens = self._prepare(job, gen)
        except RequestError as exc:
            self._write(exc.event)
            return False
        self.n_prompt = len(ids)
        try:
            self._deltas = gen.generate(ids, max_tokens=max_tokens, params=job.sampling, stop=job.stop)
        except InvalidRequestError as exc:   # everything was checked above; keep the 400 anyway
            self._write(_invalid(str(exc), None).event)
            return False
        self.state.current_request = job.request_id
        cancelled = self._write(Started(worker_id=self.state.worker_id, prompt_tokens=self.n_prompt),
                                check_cancel=True)
        if cancelled:
            self._cancel()
            return False
        return True

    def _prepare(self, job: GenerateJob, gen) -> tuple[list[int], int]:
        """Validates the request; returns (prompt ids, max_tokens). Raises RequestError."""
        try:
            job.sampling.validate()
        except InvalidRequestError as exc:
            raise _invalid(str(exc), _param_of(str(exc), None)) from None
        if job.max_tokens is not None and (
            isinstance(job.max_tokens, bool) or not isinstance(job.max_tokens, int) or job.max_tokens < 1
        ):
            raise _invalid(f"max_tokens must be an integer >= 1, got {job.max_tokens!r}", "max_tokens")
        for s in job.stop:
            if not isinstance(s, str) or not s:
                raise _invalid(f"stop strings must be non-empty strings, got {s!r}", "stop")
        if (job.messages is None) == (job.prompt is None):
            raise _invalid("exactly one of messages (chat) or prompt (completion) must be given",
                           "messages" if job.prompt is None else "prompt")
        param = "messages" if self.chat else "prompt"
        try:
            if self.chat:
                msgs = [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name else {})
                        for m in job.messages]
                ids = gen.prompt_ids(msgs, chat=True)
            else:
                ids = gen.prompt_ids(job.prompt)
        except InvalidRequestError as exc:
            raise _invalid(str(exc), param) from None
        n_ctx = gen.n_ctx
        if job.max_tokens is None:
            if len(ids) >= n_ctx:
                raise context_error(n_ctx, len(ids), None, self.chat)
            return ids, n_ctx - len(ids)
        if len(ids) + job.max_tokens > n_ctx:
            raise context_error(n_ctx, len(ids), job.max_tokens, self.chat)
        return ids, job.max_tokens

    def step(self) -> bool:
        """One engine step; False once the request has ended."""
        assert self._deltas is not None and not self.ended
        d = next(self._deltas)
        self.n_generated += len(d.token_ids)
        if self.t_first is None:
            self.t_first = time.perf_counter()
        events: list[Event] = [Token(ids=list(d.token_ids), text=d.text)]
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            if d.stats is not None:
                self.engine_tok_s = d.stats.decode_tok_s
                self.n_generated = d.stats.n_generated
            events.append(Done(finish_reason=d.finish_reason, usage=self._usage()))
            self._write(*events)
            self._close_sequence()
            return False
        if self._write(*events, check_cancel=True):
            self._cancel()
            return False
        return True

    def _cancel(self) -> None:
        self._close_sequence()           # frees the sequence before the next job starts
        self.finish_reason = FINISH_CANCELLED
        self._write(Done(finish_reason=FINISH_CANCELLED, usage=self._usage()))

    def _close_sequence(self) -> None:
        if self._deltas is not None:
            self._deltas.close()         # Generator._run's finally frees the native sequence
            self._deltas = None

    def fail(self, event: Error) -> None:
        """Writes `event` as the terminal event unless one was already written."""
        self._close_sequence()
        if not self.ended:
            self._write(event)

    def finish(self) -> None:
        """Bookkeeping after the terminal event: the heartbeat's current request, the log line."""
        self.state.current_request = None
        self.state.jobs_done += 1
        log.info("%s", self.summary())

    def summary(self) -> str:
        """One log line: counts, finish, and stack-side timings (wall clock in this process)."""
        end = self.t_end or time.perf_counter()
        total = end - self.t_taken
        parts = [f"request={self.job.request_id}", f"finish={self.finish_reason}",
                 f"prompt={self.n_prompt}", f"completion={self.n_generated}"]
        if (e := self.error) is not None:
            parts.insert(2, f"error={e.status}:{e.code or e.type}:{e.param or '-'}")
        if self.t_first is not None:
            decode_s = end - self.t_first
            tok_s = (self.n_generated - 1) / decode_s if self.n_generated > 1 and decode_s > 0 else 0.0
            parts += [f"tok/s={tok_s:.1f}", f"engine_tok/s={self.engine_tok_s:.1f}",
                      f"ttft_ms={(self.t_first - self.t_taken) * 1e3:.1f}"]
        parts.append(f"total_ms={total * 1e3:.1f}")
        if self.queued_s is not None:
            parts.append(f"queued_ms={self.queued_s * 1e3:.1f}")
        return " ".join(parts)


def _unexpected(exc: BaseException) -> Error:
    """The Error event for an exception that is not the request's fault."""
    from rq.timeouts import JobTimeoutException

    if isinstance(exc, JobTimeoutException):
        return Error(message=f"generation exceeded the worker's job timeout: {exc}", type="server_error",
                     code="timeout", status=504)
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return Error(message="the worker was shut down during generation; retry the request",
                     type="server_error", code="worker_shutdown", status=503)
    return Error(message=f"internal error in the worker: {type(exc).__name__}: {exc}",
                 type="server_error", status=500)


def run_generate(payload: bytes) -> None:
    """RQ entry point (protocol.JOB_FUNC): serves one GenerateJob to its terminal event.

    Request errors end with an Error event and return normally (the job succeeded in RQ's
    eyes: it answered). Anything unexpected writes Error(500/503/504) and re-raises, so RQ
    records the failure; the worker process itself carries on with the next job.
    """
    state = resident()
    try:
        job = decode_job(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        _fail_undecodable(state, exc)
        raise
    runner = JobRunner(state, job)
    try:
        if runner.start():
            while runner.step():
                pass
    except BaseException as exc:
        try:
            runner.fail(_unexpected(exc))
        except Exception:
            log.exception("request=%s: could not write the error event", job.request_id)
        raise
    finally:
        runner.finish()


def _fail_undecodable(state: Resident, exc: Exception) -> None:
    """A payload that is not a GenerateJob: report on the stream named by the RQ job id
    (the gateway makes it the request id), so the waiting client still gets an answer."""
    from rq import get_current_job

    job = get_current_job()
    if job is None:
        return
    stream = state.keys.events(job.id)
    event = Error(message=f"malformed job payload (not a GenerateJob): {exc}", status=500)
    pipe = state.redis.pipeline(transaction=False)
    pipe.xadd(stream, {EVENT_FIELD: encode(event)})
    pipe.expire(stream, _UNDECODABLE_TTL_S)
    pipe.execute()
    log.error("request=%s finish=error malformed payload: %s", job.id, exc)
