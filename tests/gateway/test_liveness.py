"""Worker death, queue timeouts and client disconnects: nothing hangs, nothing is lost.

Timeouts are shortened (conftest.FAST: poll 0.05 s, worker_timeout_s 2 s; fake heartbeat
TTL 1 s); the only timed assertion is the issue's bound (an answer within 10 s of a kill).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry

from helpers.gateway_fakes import CHAT, die_after, error_body, reply, sse_lines, until_cancelled
from worker.protocol import Started

KILL_BOUND_S = 10.0


def test_worker_death_mid_stream_ends_with_an_error_chunk(client, make_worker, keys, r):
    w = make_worker(script=die_after(2), ttl_s=1.0)
    res = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    answered = time.monotonic()
    assert res.status_code == 200
    assert answered - w.died_at < KILL_BOUND_S
    lines = sse_lines(res.text)
    assert [json.loads(x)["choices"][0]["delta"] for x in lines[:3]] == [
        {"role": "assistant", "content": ""}, {"content": "t0 "}, {"content": "t1 "}]
    assert len(lines) == 4 and "[DONE]" not in lines
    message = (f"worker {w.worker_id} stopped answering while serving this request (its heartbeat "
               f"expired); the request failed, retry it")
    assert json.loads(lines[3]) == error_body(message, type="server_error", code="worker_timeout")
    # The job is not silently lost: it is in RQ's failed registry with the reason.
    request_id = w.jobs[0].request_id
    job = Job.fetch(request_id, connection=r)
    assert job.get_status() == JobStatus.FAILED
    assert request_id in FailedJobRegistry(keys.queue("demo"), connection=r).get_job_ids()
    assert job.latest_result().exc_string == message
    assert r.exists(keys.cancel(request_id))   # in case the worker is merely slow


def test_worker_death_before_the_first_token_is_a_504(client, make_worker):
    w = make_worker(script=die_after(0), ttl_s=1.0)
    res = client.post("/v1/chat/completions", json=CHAT)
    assert time.monotonic() - w.died_at < KILL_BOUND_S
    assert res.status_code == 504
    assert res.json()["error"]["code"] == "worker_timeout"


def test_second_worker_serves_after_the_first_died(client, make_worker):
    first = make_worker(script=die_after(1), ttl_s=1.0)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 504
    assert first.jobs and first._dead.is_set()
    second = make_worker()
    res = client.post("/v1/chat/completions", json=CHAT)
    assert res.status_code == 200
    assert res.json()["choices"][0]["message"]["content"] == "Hello world!"
    assert len(second.jobs) == 1


def test_heartbeat_not_refreshed_is_death_even_before_the_key_expires(make_client, make_worker):
    """A worker key with a long TTL that nobody refreshes any more (hung process)."""
    client = make_client(worker_timeout_s=0.5)
    w = make_worker(script=die_after(1), ttl_s=60.0)
    res = client.post("/v1/chat/completions", json=CHAT)
    assert res.status_code == 504
    assert res.json() == error_body(
        f"worker {w.worker_id} stopped answering while serving this request (its heartbeat was not "
        f"refreshed for 0.5 s); the request failed, retry it", type="server_error",
        code="worker_timeout")


def test_a_slow_step_of_a_live_worker_is_not_death(make_client, make_worker):
    """No events for longer than worker_timeout_s, but the heartbeat keeps being refreshed."""
    client = make_client(worker_timeout_s=0.3)

    def slow(w, job):
        w.emit(job, Started(worker_id=w.worker_id, prompt_tokens=1))
        time.sleep(1.0)   # one very long engine step (a long prefill)
        reply(["ok"])(w, job)

    make_worker(script=slow, ttl_s=0.2)
    res = client.post("/v1/chat/completions", json=CHAT)
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["message"]["content"] == "ok"


def test_queue_timeout_cancels_the_job(make_client, make_worker, keys, r):
    client = make_client(queue_timeout_s=0.3)
    w = make_worker(serve=False)    # alive, never takes the job
    res = client.post("/v1/chat/completions", json=CHAT)
    assert res.status_code == 504
    assert res.json() == error_body(
        "no worker started the request within 0.3 s (the queue of model 'demo' is busy or its "
        "workers are stuck); retry later, add workers or raise SPECD_QUEUE_TIMEOUT_S",
        type="server_error", code="queue_timeout")
    request_id = res.headers["x-request-id"]
    assert _only_job_id(r, keys) == request_id
    assert Job.fetch(request_id, connection=r).get_status() == JobStatus.CANCELED
    assert r.llen(f"rq:queue:{keys.queue('demo')}") == 0
    assert r.exists(keys.cancel(request_id))
    assert w.jobs == []


def test_all_workers_gone_while_queued_is_a_503(make_client, make_worker, keys, r):
    client = make_client(worker_timeout_s=0.3)
    w = make_worker(serve=False, ttl_s=0.3)
    threading.Timer(0.2, w.stop).start()   # the only worker leaves while the job waits
    res = client.post("/v1/chat/completions", json=CHAT)
    assert res.status_code == 503
    assert res.json() == error_body("no live worker serves model 'demo' any more; the request was "
                                    "not started; retry when a worker is up",
                                    type="server_error", code="no_worker")
    request_id = _only_job_id(r, keys)
    assert Job.fetch(request_id, connection=r).get_status() == JobStatus.CANCELED


def _only_job_id(r, keys) -> str:
    ids = r.zrange(f"rq:canceled:{keys.queue('demo')}", 0, -1)
    assert len(ids) == 1, ids
    return ids[0].decode()


# ---- client disconnects (real sockets: the app under uvicorn) -----------------------------------

def test_disconnect_during_stream_sets_the_cancel_flag(live_url, make_worker, keys, r):
    w = make_worker(script=until_cancelled())
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{live_url}/v1/chat/completions",
                         json={**CHAT, "stream": True}) as res:
            assert res.status_code == 200
            seen = 0
            for line in res.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen == 3:   # role chunk + two tokens: the worker is generating
                    break
        # leaving the block closes the connection mid-stream
    assert w.saw_cancel.wait(5), "the worker never saw the cancel flag"
    request_id = w.jobs[0].request_id
    ttl = r.ttl(keys.cancel(request_id))
    assert 0 < ttl <= 300       # the flag expires (events_ttl_s)


def test_disconnect_while_waiting_for_a_non_streamed_answer(live_url, make_worker, keys, r):
    w = make_worker(script=until_cancelled())
    host, port = live_url.removeprefix("http://").split(":")
    body = json.dumps(CHAT).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        assert w.job_taken.wait(5)
    assert w.saw_cancel.wait(5), "the worker never saw the cancel flag"
    assert r.exists(keys.cancel(w.jobs[0].request_id))


def test_disconnect_while_queued_cancels_the_job(live_url, make_worker, keys, r):
    w = make_worker(serve=False)
    queue_key = f"rq:queue:{keys.queue('demo')}"
    host, port = live_url.removeprefix("http://").split(":")
    body = json.dumps({**CHAT, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        deadline = time.monotonic() + 5
        while r.llen(queue_key) == 0:   # wait until the job is queued
            assert time.monotonic() < deadline
            time.sleep(0.01)
        request_id = r.lrange(queue_key, 0, 0)[0].decode()
    deadline = time.monotonic() + 5
    while Job.fetch(request_id, connection=r).get_status() != JobStatus.CANCELED:
        assert time.monotonic() < deadline, "the queued job was not cancelled"
        time.sleep(0.01)
    assert r.llen(queue_key) == 0
    assert r.exists(keys.cancel(request_id))
    assert w.jobs == []
