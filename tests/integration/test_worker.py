"""The resident worker (worker/service.py + worker/jobs.py) against a real Redis.

Redis comes from tests/integration/conftest.py (`redis_url`, session-scoped). One worker
process on the demo model serves the whole module (loaded once, ~3 s); each
test enqueues GenerateJobs with rq exactly as the gateway does and reads the request's
event stream with XREAD. The SIGTERM test stops that worker, so it runs last.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from worker.protocol import (
    EVENT_FIELD,
    JOB_FUNC,
    ChatMessage,
    Done,
    Error,
    GenerateJob,
    Keys,
    SamplingParams,
    Started,
    Token,
    Usage,
    decode_event,
    decode_worker,
    encode,
)

ROOT = Path(__file__).resolve().parents[2]
N_CTX = 512
HEARTBEAT_S, TTL_S = 0.2, 2.0
GREEDY = SamplingParams(temperature=0.0)
PARIS = [ChatMessage(role="user", content="What is the capital of France?")]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"   # greedy continues counting: a long generation
WAIT_S = 60.0                                 # upper bound on any wait (a hang fails, not blocks)


# ---- fixtures ----

class Worker:
    """One `python -m worker.service` process and the Redis names it serves."""

    def __init__(self, url: str, prefix: str, log_path: Path, extra: tuple[str, ...] = ()):
        import redis

        self.url, self.prefix, self.keys = url, prefix, Keys(prefix)
        self.redis = redis.Redis.from_url(url)
        self.log_path = log_path
        self.request_ids: list[str] = []
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.service", "--model", "demo", "--redis-url", url,
             "--prefix", prefix, "--ctx-size", str(N_CTX), "--heartbeat-s", str(HEARTBEAT_S),
             "--ttl-s", str(TTL_S), *extra],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        try:
            self.worker_id = self._wait_for_heartbeat()
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            self._log.close()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_heartbeat(self) -> str:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = list(self.redis.scan_iter(match=self.keys.workers_pattern()))
            if found:
                return found[0].decode().rsplit(":", 1)[1]
            if self.proc.poll() is not None:
                pytest.fail(f"worker exited with {self.proc.returncode} before its heartbeat:\n{self.log()}")
            time.sleep(0.05)
        pytest.fail(f"no heartbeat within {WAIT_S} s:\n{self.log()}")

    def queue(self):
        from rq import Queue

        return Queue(self.keys.queue("demo"), connection=self.redis)

    def submit(self, **fields) -> str:
        rid = uuid.uuid4().hex
        job = GenerateJob(request_id=rid, model="demo", created=time.time(), events_ttl_s=120, **fields)
        self.queue().enqueue(JOB_FUNC, encode(job), job_id=rid)
        self.request_ids.append(rid)
        return rid

    def events(self, rid: str, start: str = "0-0") -> list[tuple[str, object]]:
        """Reads the request's stream from `start` until its terminal event."""
        out: list[tuple[str, object]] = []
        last = start
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            res = self.redis.xread({self.keys.events(rid): last}, block=1000)
            for _name, entries in res:
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    out.append((last, decode_event(fields[EVENT_FIELD])))
            if out and isinstance(out[-1][1], (Done, Error)):
                return out
            if self.proc.poll() is not None and not res:
                pytest.fail(f"worker exited ({self.proc.returncode}) mid-request:\n{self.log()}")
        pytest.fail(f"request {rid}: no terminal event within {WAIT_S} s; got {out}\n{self.log()}")

    def wait_first_token(self, rid: str) -> None:
        res = []
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            res = self.redis.xrange(self.keys.events(rid))
            if any(isinstance(decode_event(f[EVENT_FIELD]), Token) for _, f in res):
                return
            time.sleep(0.005)
        pytest.fail(f"request {rid}: no token within {WAIT_S} s")

    def heartbeat(self):
        raw = self.redis.get(self.keys.worker(self.worker_id))
        return None if raw is None else decode_worker(raw)

    def stop(self) -> None:
        """Stops the process (if still running) and removes what delete_prefix cannot
        find by prefix: the queue's name in rq:queues, a killed worker in rq:workers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.redis.srem("rq:queues", f"rq:queue:{self.keys.queue('demo')}")
        self.redis.srem("rq:workers", f"rq:worker:{self.worker_id}")
        self.redis.unlink(f"rq:worker:{self.worker_id}",
                          *(f"rq:executions:{rid}" for rid in self.request_ids))
        self.redis.close()


@pytest.fixture(scope="module")
def worker(redis_url, demo_model_path, tmp_path_factory):
    from helpers.redis_server import delete_prefix, unique_prefix

    prefix = unique_prefix("worker")
    w = Worker(redis_url, prefix, tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        yield w
    finally:
        w.stop()
        delete_prefix(redis_url, prefix)


def kinds(events) -> list[str]:
    return [type(e).__name__ for _, e in events]


def text_of(events) -> str:
    return "".join(e.text for _, e in events if isinstance(e, Token))


def ids_of(events) -> list[int]:
    return [t for _, e in events if isinstance(e, Token) for t in e.ids]


def ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])


def assert_well_formed(events, worker_id: str) -> tuple[Started, Done]:
    """Started, Token+, Done; usage matches the streamed ids."""
    ks = kinds(events)
    assert ks[0] == "Started" and ks[-1] == "Done" and set(ks[1:-1]) == {"Token"}, ks
    started, done = events[0][1], events[-1][1]
    assert started.worker_id == worker_id and started.prompt_tokens > 0
    assert done.usage == Usage(prompt_tokens=started.prompt_tokens, completion_tokens=len(ids_of(events)))
    return started, done


# ---- configuration rules (no worker needed) ----

def test_device_and_served_name_rules():
    from worker.errors import InvalidRequestError
    from worker.service import check_device, served_name

    from worker.engine import native

    assert check_device("cpu") == "cpu"
    for device, name in (("cuda:0", "CUDA"), ("hip:1", r"HIP \(ROCm\)")):
        if native.backend == device.split(":")[0]:
            assert check_device(device) == device
            continue
        with pytest.raises(InvalidRequestError, match=rf"device '{device}': this specd was built without the "
                                                      rf"{name} backend \(SPECD_BACKEND={native.backend}\); "
                                                      r"reinstall it with SPECD_BACKEND=\w+ pip install \. or use "
                                                      r"--device cpu"):
            check_device(device)
    with pytest.raises(InvalidRequestError, match=r"device 'gpu' is not one of cpu, cuda:N, hip:N"):
        check_device("gpu")
    assert served_name("demo") == "demo"
    assert served_name("/models/Qwen3-0.6B-Q8_0.gguf") == "Qwen3-0.6B-Q8_0"
    assert served_name("/models/x.gguf", "qwen") == "qwen"


def test_bad_device_exits_2_before_loading(redis_url):
    from worker.engine import native

    if native.backend == "hip":
        pytest.skip("this build serves hip devices")
    res = subprocess.run([sys.executable, "-m", "worker.service", "--device", "hip:0",
                          "--redis-url", redis_url],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: device 'hip:0': this specd was built without the HIP (ROCm) backend "
        f"(SPECD_BACKEND={native.backend}); reinstall it with SPECD_BACKEND=hip pip install . or use --device cpu")


# ---- serving ----

def test_heartbeat_record_while_idle(worker):
    info = worker.heartbeat()
    assert info is not None
    assert (info.worker_id, info.model, info.device, info.n_ctx, info.capacity) == (
        worker.worker_id, "demo", "cpu", N_CTX, 1)
    assert info.current_request is None
    assert (info.pid, info.host) == (worker.proc.pid, socket.gethostname())
    assert 0 < info.started_at <= time.time()
    assert 0 < worker.redis.pttl(worker.keys.worker(worker.worker_id)) <= TTL_S * 1000


def test_chat_greedy_answers_paris(worker):
    rid = worker.submit(messages=PARIS, max_tokens=32, sampling=GREEDY)
    events = worker.events(rid)
    started, done = assert_well_formed(events, worker.worker_id)
    assert text_of(events) == "The capital of France is Paris."
    assert done.finish_reason == "stop"
    # The end-of-turn token ends the answer: generated and counted, but adds no text.
    last = events[-2][1]
    assert last.text == "" and len(last.ids) == 1
    assert 0 < worker.redis.ttl(worker.keys.events(rid)) <= 120


def test_completion_stops_at_max_tokens(worker):
    rid = worker.submit(prompt="The capital of France is", max_tokens=4, sampling=GREEDY)
    events = worker.events(rid)
    started, done = assert_well_formed(events, worker.worker_id)
    assert done.finish_reason == "length" and done.usage.completion_tokens == 4
    assert text_of(events).startswith(" Paris")
    assert kinds(events) == ["Started"] + ["Token"] * 4 + ["Done"]


def test_stop_string_is_cut_and_counted(worker):
    rid = worker.submit(prompt="The capital of France is", max_tokens=16, sampling=GREEDY, stop=["."])
    events = worker.events(rid)
    _, done = assert_well_formed(events, worker.worker_id)
    assert text_of(events) == " Paris"
    assert done.finish_reason == "stop"


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (dict(sampling=SamplingParams(temperature=5.0)), "temperature",
         "temperature must be between 0 and 2 (0 = greedy), got 5.0"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p",
         "top_p must be greater than 0 and at most 1 (1 = off), got 0.0"),
        (dict(max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1, got 0"),
        (dict(stop=[""]), "stop", "stop strings must be non-empty strings, got ''"),
    ],
)
def test_bad_request_fields_give_400(worker, fields, param, message):
    rid = worker.submit(prompt="Hello", **fields)
    events = worker.events(rid)
    assert [e for _, e in events] == [Error(message=message, type="invalid_request_error", code=None,
                                           param=param, status=400)]


def test_bad_messages_give_400(worker):
    rid = worker.submit(messages=[ChatMessage(role="robot", content="hi")])
    [(_, err)] = worker.events(rid)
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", "messages", None)
    assert "role 'robot' is not supported" in err.message
    rid = worker.submit()   # neither messages nor prompt
    [(_, err)] = worker.events(rid)
    assert err == Error(message="exactly one of messages (chat) or prompt (completion) must be given",
                        type="invalid_request_error", param="messages", status=400)


def test_context_length_exceeded_then_keeps_serving(worker):
    # Prompt size of the conversation, from a one-token run.
    first = worker.events(worker.submit(messages=PARIS, max_tokens=1, sampling=GREEDY))
    n_prompt = first[0][1].prompt_tokens
    over = N_CTX - n_prompt + 1
    [(_, err)] = worker.events(worker.submit(messages=PARIS, max_tokens=over))
    assert err == Error(
        message=(f"This model's maximum context length is {N_CTX} tokens. However, you requested "
                 f"{n_prompt + over} tokens ({n_prompt} in the messages, {over} in the completion). "
                 f"Please reduce the length of the messages or completion."),
        type="invalid_request_error", code="context_length_exceeded", param="messages", status=400)
    # Exactly at the limit is fine (and max_tokens None means "up to the limit").
    ok = worker.events(worker.submit(messages=PARIS, max_tokens=over - 1, sampling=GREEDY))
    assert isinstance(ok[-1][1], Done)

    [(_, err)] = worker.events(worker.submit(prompt="hello " * 600))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "prompt")
    assert err.message.startswith(f"This model's maximum context length is {N_CTX} tokens. However, your "
                                  f"prompt resulted in ")
    [(_, err)] = worker.events(worker.submit(prompt="hello " * 400, max_tokens=200))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "prompt")
    assert "in the prompt, 200 in the completion" in err.message

    again = worker.events(worker.submit(messages=PARIS, max_tokens=32, sampling=GREEDY))
    assert text_of(again) == "The capital of France is Paris."


def test_cancelled_while_queued_ends_at_once(worker):
    rid = uuid.uuid4().hex
    worker.redis.set(worker.keys.cancel(rid), 1, ex=60)
    job = GenerateJob(request_id=rid, model="demo", prompt=COUNTING, max_tokens=100)
    worker.queue().enqueue(JOB_FUNC, encode(job), job_id=rid)
    assert [e for _, e in worker.events(rid)] == [
        Done(finish_reason="cancelled", usage=Usage(prompt_tokens=0, completion_tokens=0))]


def test_cancel_mid_generation_stops_within_a_step_and_next_job_starts(worker):
    a = worker.submit(prompt=COUNTING, max_tokens=400, sampling=GREEDY)
    worker.wait_first_token(a)
    # While A runs, the heartbeat names it.
    deadline = time.monotonic() + 5 * HEARTBEAT_S + 1
    while (info := worker.heartbeat()).current_request != a and time.monotonic() < deadline:
        time.sleep(HEARTBEAT_S / 4)
    assert info.current_request == a
    b = worker.submit(prompt="The capital of France is", max_tokens=8, sampling=GREEDY)
    # Set the flag and count A's events at that instant, atomically.
    with worker.redis.pipeline(transaction=True) as pipe:
        pipe.set(worker.keys.cancel(a), 1, ex=60)
        pipe.xlen(worker.keys.events(a))
        _, n_at_cancel = pipe.execute()

    ea = worker.events(a)
    _, done = assert_well_formed(ea, worker.worker_id)
    assert done.finish_reason == "cancelled"
    after = [e for _, e in ea[n_at_cancel:] if isinstance(e, Token)]
    assert len(after) <= 1, f"{len(after)} steps ran after the cancel flag was set"
    assert done.usage.completion_tokens < 400

    eb = worker.events(b)
    assert_well_formed(eb, worker.worker_id)
    assert text_of(eb).startswith(" Paris")
    # B starts right after A's Done: the gap is job hand-over (dequeue + bookkeeping),
    # measured on Redis's own clock (stream ids), compared with A's median step time.
    token_ms = sorted(ms(i2) - ms(i1) for (i1, e1), (i2, e2) in zip(ea[1:-1], ea[2:-1]))
    step_ms = token_ms[len(token_ms) // 2] if token_ms else 10
    gap_ms = ms(eb[0][0]) - ms(ea[-1][0])
    print(f"\ncancel -> next job: A/B gap {gap_ms} ms, A median step {step_ms} ms")
    assert gap_ms <= max(2 * step_ms, 50), f"next job started {gap_ms} ms after the cancel (step {step_ms} ms)"


def test_malformed_payload_fails_the_job_and_the_worker_survives(worker):
    from rq.job import Job, JobStatus

    rid = uuid.uuid4().hex
    worker.queue().enqueue(JOB_FUNC, b"\xc1 not msgpack", job_id=rid)
    [(_, err)] = worker.events(rid)
    assert (err.status, err.type) == (500, "server_error")
    assert err.message.startswith("malformed job payload (not a GenerateJob): ")
    deadline = time.monotonic() + WAIT_S
    while (status := Job.fetch(rid, connection=worker.redis).get_status()) != JobStatus.FAILED:
        assert time.monotonic() < deadline, status
        time.sleep(0.02)
    ok = worker.events(worker.submit(prompt="The capital of France is", max_tokens=2, sampling=GREEDY))
    assert isinstance(ok[-1][1], Done)


def test_kill_9_heartbeat_expires_and_the_job_is_failed_as_abandoned(redis_url, demo_model_path,
                                                                     tmp_path):
    """A worker that dies mid-job cannot write an event: its heartbeat key expires (the
    gateway's signal) and RQ's registry cleanup (the gateway's, or any live worker's
    maintenance) moves the job to the failed registry, because the worker kept its
    execution TTL short."""
    from rq.job import Job, JobStatus

    from helpers.redis_server import delete_prefix, unique_prefix

    prefix = unique_prefix("worker-kill")
    victim = Worker(redis_url, prefix, tmp_path / "victim.log")
    try:
        rid = victim.submit(prompt=COUNTING, max_tokens=400, sampling=GREEDY)
        victim.wait_first_token(rid)
        victim.proc.kill()
        victim.proc.wait()
        t_kill = time.monotonic()
        hb = victim.keys.worker(victim.worker_id)
        while victim.redis.exists(hb):
            assert time.monotonic() - t_kill < TTL_S + 1, "heartbeat outlived its TTL"
            time.sleep(0.05)
        queue = victim.queue()
        while rid not in queue.failed_job_registry.get_job_ids():
            assert time.monotonic() - t_kill < 10, "job not moved to the failed registry"
            queue.started_job_registry.cleanup()
            time.sleep(0.1)
        job = Job.fetch(rid, connection=victim.redis)
        assert job.get_status() == JobStatus.FAILED
        assert "AbandonedJobError" in job.latest_result().exc_string
        assert not any(isinstance(e, (Done, Error)) for e in
                       (decode_event(f[EVENT_FIELD]) for _, f in victim.redis.xrange(victim.keys.events(rid))))
    finally:
        victim.stop()
        delete_prefix(redis_url, prefix)


def test_a_speculating_worker_streams_the_plain_greedy_tokens(worker, redis_url, tmp_path):
    from helpers.redis_server import delete_prefix, unique_prefix

    plain = worker.events(worker.submit(prompt=COUNTING, max_tokens=48, sampling=GREEDY))
    prefix = unique_prefix("draft")
    w = Worker(redis_url, prefix, tmp_path / "draft.log", extra=("--draft", "ngram", "--draft-k", "4"))
    try:
        spec = w.events(w.submit(prompt=COUNTING, max_tokens=48, sampling=GREEDY))
        assert_well_formed(spec, w.worker_id)
        assert ids_of(spec) == ids_of(plain) and text_of(spec) == text_of(plain)
        # prompt lookup drafts the counting: some steps returned several tokens
        assert any(len(e.ids) > 1 for _, e in spec if isinstance(e, Token)), kinds(spec)
    finally:
        w.stop()
        delete_prefix(redis_url, prefix)


def test_stop_does_not_wait_out_the_command_threads_poll(redis_client, redis_prefix):
    """rq's command thread reading its UNSUBSCRIBE reply before its stop flag clears (the
    interleaving forced here) made a SIGTERM'd worker wait 60 s before exiting."""
    import threading

    from rq import Queue

    from worker.service import PUBSUB_JOIN_S, _resident_worker_class

    w = _resident_worker_class()([Queue(f"{redis_prefix}:q", connection=redis_client)],
                                 name=f"{redis_prefix}-w", connection=redis_client)
    w.subscribe()
    thread, pubsub = w.pubsub_thread, w.pubsub
    real = pubsub.unsubscribe

    def unsubscribe_then_let_the_thread_read_the_reply(*args, **kwargs):
        out = real(*args, **kwargs)
        deadline = time.monotonic() + 5
        while pubsub.subscribed and time.monotonic() < deadline:
            time.sleep(0.01)
        return out

    pubsub.unsubscribe = unsubscribe_then_let_the_thread_read_the_reply
    stopper = threading.Thread(target=w.unsubscribe, daemon=True)
    t0 = time.monotonic()
    stopper.start()
    stopper.join(PUBSUB_JOIN_S + 10)
    assert not stopper.is_alive(), "unsubscribe() still waiting after 15 s"
    assert not thread.is_alive()
    assert time.monotonic() - t0 < PUBSUB_JOIN_S
    assert w.pubsub_thread is None


def test_sigterm_finishes_current_job_then_exits_0(worker):
    """Runs last: stops the module's worker."""
    a = worker.submit(prompt=COUNTING, max_tokens=60, sampling=GREEDY)
    worker.wait_first_token(a)
    b = worker.submit(prompt="The capital of France is", max_tokens=4, sampling=GREEDY)
    worker.proc.send_signal(signal.SIGTERM)
    ea = worker.events(a)
    _, done = assert_well_formed(ea, worker.worker_id)
    assert done.finish_reason in ("length", "stop") and done.usage.completion_tokens > 1
    try:
        rc = worker.proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker still running {WAIT_S} s after SIGTERM and its job's end:\n{worker.log()}")
    assert rc == 0, worker.log()
    assert worker.redis.exists(worker.keys.worker(worker.worker_id)) == 0
    # B was never taken: still queued for another worker, no events written for it.
    assert b in worker.queue().get_job_ids()
    assert worker.redis.xlen(worker.keys.events(b)) == 0
    assert "SIGTERM received; finishing the current job, then stopping" in worker.log()
