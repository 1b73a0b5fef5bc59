"""Every client-visible error: status and exact OpenAI body. Bad input never gives a 500."""

from __future__ import annotations

import json

import pytest
from rq import Queue

from helpers.gateway_fakes import CHAT, error_body, events, sse_lines
from worker.protocol import Error, Started, Token

INVALID = "invalid_request_error"


def post_chat(client, **fields):
    return client.post("/v1/chat/completions", json={**CHAT, **fields})


# ---- 400: wrong types, bad values -----------------------------------------------------------

@pytest.mark.parametrize("fields, message, param", [
    ({"temperature": "hot"}, "invalid type for 'temperature': Expected `float | null`, got `str`",
     "temperature"),
    ({"messages": [{"role": "user", "content": 5}]},
     "invalid type for 'messages[0].content': Expected `str | array | null`, got `int`",
     "messages[0].content"),
    ({"messages": [{"content": "hi"}]}, "missing required field 'messages[0].role'",
     "messages[0].role"),
    ({"max_tokens": 1.5}, "invalid type for 'max_tokens': Expected `int | null`, got `float`",
     "max_tokens"),
    ({"stream": "yes"}, "invalid type for 'stream': Expected `bool | null`, got `str`", "stream"),
    ({"stop": [1]}, "invalid type for 'stop[0]': Expected `str`, got `int`", "stop[0]"),
    ({"stream_options": {"include_usage": 1}},
     "invalid type for 'stream_options.include_usage': Expected `bool | null`, got `int`",
     "stream_options.include_usage"),
    ({"temperature": 3}, "temperature must be between 0 and 2 (0 = greedy), got 3.0", "temperature"),
    ({"top_p": 0}, "top_p must be greater than 0 and at most 1 (1 = off), got 0.0", "top_p"),
    ({"top_k": -1}, "top_k must be an integer >= 0 (0 = off), got -1", "top_k"),
    ({"presence_penalty": -2.5}, "presence_penalty must be between -2 and 2 (0 = off), got -2.5",
     "presence_penalty"),
    ({"n": 2}, "only n=1 is supported, got n=2", "n"),
    ({"max_tokens": 0}, "max_tokens must be an integer from 1 to 2147483647, got 0", "max_tokens"),
    ({"max_completion_tokens": -5},
     "max_completion_tokens must be an integer from 1 to 2147483647, got -5", "max_completion_tokens"),
    ({"max_tokens": 2**70}, f"max_tokens must be an integer from 1 to 2147483647, got {2**70}",
     "max_tokens"),
    ({"top_k": 10**30}, f"top_k must be at most 2147483647 (0 = off), got {10**30}", "top_k"),
    ({"stop": [str(i) for i in range(17)]}, "'stop' takes at most 16 strings, got 17", "stop"),
    ({"stop": ""}, "stop strings must not be empty", "stop"),
    ({"messages": []}, "'messages' must contain at least one message", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role must be one of system, developer, user, assistant, tool, got 'robot'",
     "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0] has type 'image_url'; only {\"type\": \"text\", \"text\": ...} parts "
     "are supported", "messages[0].content[0]"),
    ({"messages": [{"role": "user"}]}, "messages[0].content is required for role 'user'",
     "messages[0].content"),
    ({"logprobs": True}, "logprobs are not supported yet; leave 'logprobs' unset or false", "logprobs"),
])
def test_chat_400_names_the_field(shared_client, fields, message, param):
    # Refused before routing: no worker is needed (a request that got further would be a 503).
    res = post_chat(shared_client, **fields)
    assert res.status_code == 400, res.text
    assert res.json() == error_body(message, param=param)


@pytest.mark.parametrize("body, message", [
    (b"", "the request body is empty; send a JSON object (Content-Type: application/json)"),
    (b"{\"model\": ", "the request body is not valid JSON: Input data was truncated"),
    (b"[1, 2]", "the request body must be a JSON object: Expected `object`, got `array`"),
    (b"\xff\xfe", "the request body is not valid JSON: invalid character"),
])
def test_unparseable_bodies(shared_client, body, message):
    res = shared_client.post("/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"})
    assert res.status_code == 400
    got = res.json()
    assert got["error"]["message"].startswith(message.split(":")[0])
    assert got == error_body(got["error"]["message"])
    if "invalid character" not in message:
        assert got["error"]["message"] == message


def test_missing_model(shared_client):
    res = shared_client.post("/v1/chat/completions", json={"messages": CHAT["messages"]})
    assert res.status_code == 400
    assert res.json() == error_body("missing required field 'model'", param="model")


@pytest.mark.parametrize("fields, message, param", [
    ({"prompt": ["a", "b"]}, "'prompt' must be a string or a list of exactly one string (batches are "
                             "not supported), got a list of 2", "prompt"),
    ({"prompt": [1, 2]}, "invalid type for 'prompt[0]': Expected `str`, got `int`", "prompt[0]"),
    ({"prompt": "x", "echo": True}, "'echo' is not supported; leave it unset or false", "echo"),
    ({"prompt": "x", "logprobs": 2}, "logprobs are not supported yet; leave 'logprobs' unset",
     "logprobs"),
    ({"prompt": "x", "best_of": 3}, "only best_of=1 is supported, got 3", "best_of"),
    ({"prompt": "x", "seed": 2**64}, f"seed must be an integer between {-(2**63)} and {2**64 - 1}, "
                                     f"got {2**64}", "seed"),
])
def test_completions_400(shared_client, fields, message, param):
    res = shared_client.post("/v1/completions", json={"model": "demo", **fields})
    assert res.status_code == 400, res.text
    assert res.json() == error_body(message, param=param)


def test_context_length_exceeded_from_the_worker(client, make_worker):
    """The worker refuses the prompt before Started: the client gets a 400, not a 200."""
    err = Error(message="prompt (3000 tokens) + max_tokens (100) exceed the context (2048)",
                type=INVALID, code="context_length_exceeded", param="messages", status=400)
    make_worker(script=events(err))
    for stream in (False, True):
        res = post_chat(client, stream=stream)
        assert res.status_code == 400
        assert res.headers["content-type"] == "application/json"
        assert res.json() == error_body(err.message, param="messages", code="context_length_exceeded")


def test_max_tokens_over_context_is_refused_before_enqueueing(client, make_worker):
    w = make_worker(n_ctx=512)
    res = post_chat(client, max_tokens=512)
    assert res.status_code == 400
    assert res.json() == error_body(
        "max_tokens (512) must be less than the context length of model 'demo' (512 tokens, "
        "prompt included); lower it", param="max_tokens", code="context_length_exceeded")
    assert w.jobs == []


def test_bad_input_never_500_fuzz(shared_client):
    """A spread of odd bodies: every answer is a 4xx with the error shape."""
    odd = [None, 0, "s", [], {}, {"model": None}, {"model": 1}, {"model": "demo", "messages": {}},
           {"model": "demo", "messages": [None]}, {"model": "demo", "messages": [[]]},
           {"model": "demo", "messages": [{"role": None, "content": "x"}]},
           {"model": "demo", "messages": [{"role": "user", "content": [None]}]},
           {"model": "demo", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
           {**CHAT, "temperature": float("inf")}, {**CHAT, "temperature": float("nan")},
           {**CHAT, "seed": 1.0}, {**CHAT, "stream_options": []}, {**CHAT, "top_k": 10**30}]
    for body in odd:
        res = shared_client.post("/v1/chat/completions", content=json.dumps(body))
        assert 400 <= res.status_code < 500, (body, res.status_code, res.text)
        assert set(res.json()["error"]) == {"message", "type", "param", "code"}


# ---- 404 / 405 ------------------------------------------------------------------------------

def test_unknown_model_lists_the_served_ones(client, make_worker):
    make_worker()
    make_worker(model="big")
    res = post_chat(client, model="x")
    assert res.status_code == 404
    assert res.json() == error_body("model 'x' is not served; available: big, demo (see GET /v1/models)",
                                    param="model", code="model_not_found")


def test_unknown_route_and_method(client):
    res = client.get("/v1/nope")
    assert res.status_code == 404
    assert res.json() == error_body("no route GET /v1/nope; see GET /schema for the API",
                                    code="not_found")
    res = client.get("/v1/chat/completions")
    assert res.status_code == 405
    assert res.json()["error"]["code"] == "method_not_allowed"


# ---- 413 / 429 ------------------------------------------------------------------------------

def test_body_too_large(make_client, worker):
    client = make_client(max_body_bytes=2048)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
    res = client.post("/v1/chat/completions", json=big)
    assert res.status_code == 413
    assert res.json() == error_body("request body is larger than 2048 bytes; send a smaller request "
                                    "or raise SPECD_MAX_BODY_BYTES", code="request_too_large")
    assert worker.jobs == []


def test_queue_full(make_client, make_worker, keys, r):
    client = make_client(max_queue=2)
    make_worker(serve=False)   # alive, but takes nothing: the queue only grows
    queue = Queue(keys.queue("demo"), connection=r)
    for i in range(2):
        queue.enqueue("worker.jobs.run_generate", b"", job_id=f"{keys.prefix}-filler-{i}")
    res = post_chat(client)
    assert res.status_code == 429
    assert res.headers["retry-after"] == "1"
    assert res.json() == error_body("the queue of model 'demo' is full (2 requests waiting, limit 2); "
                                    "retry later or raise SPECD_MAX_QUEUE",
                                    type="rate_limit_error", code="queue_full")
    assert queue.count == 2


# ---- 503 ------------------------------------------------------------------------------------

def test_no_worker_at_all(client):
    res = post_chat(client)
    assert res.status_code == 503
    assert res.json() == error_body("no live worker is registered; start one with `specd worker` "
                                    "(or `specd up`) and retry", type="server_error", code="no_worker")


def test_model_whose_workers_are_gone(make_client, make_worker):
    client = make_client(worker_timeout_s=0.3)
    w = make_worker(model="demo")
    make_worker(model="other")
    assert post_chat(client).status_code == 200          # the gateway has seen 'demo' served
    w.stop()
    res = post_chat(client)
    assert res.status_code == 503
    err = res.json()["error"]
    assert err["code"] == "no_worker" and err["type"] == "server_error"
    # Refused at admission (fresh worker list) or, if a cached list still showed the worker,
    # after worker_timeout_s in the queue.
    assert err["message"].startswith("no live worker serves model 'demo' ")
    assert ("start one with `specd worker --model demo` or retry later" in err["message"]
            or "the request was not started; retry when a worker is up" in err["message"])


def test_redis_down(make_client):
    client = make_client(redis_url="redis://127.0.0.1:1/0")
    for res in (post_chat(client), client.get("/v1/models")):
        assert res.status_code == 503
        err = res.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("server_error", "redis_unavailable", None)
        assert err["message"].startswith("Redis is unavailable (ConnectionError: ")
        assert err["message"].endswith("check SPECD_REDIS_URL and that Redis is running")


# ---- errors from the worker after Started ------------------------------------------------------

def test_engine_error_after_started(client, make_worker):
    err = Error(message="engine failure: out of memory", code="engine_error", status=500)
    make_worker(script=events(Started(worker_id="w", prompt_tokens=2), Token(ids=[1], text="Hi"), err))
    res = post_chat(client)
    assert res.status_code == 500
    assert res.json() == error_body(err.message, type="server_error", code="engine_error")
    res = post_chat(client, stream=True)
    assert res.status_code == 200
    lines = sse_lines(res.text)
    assert [json.loads(x)["choices"][0]["delta"] for x in lines[:2]] == [
        {"role": "assistant", "content": ""}, {"content": "Hi"}]
    assert json.loads(lines[2]) == error_body(err.message, type="server_error", code="engine_error")
    assert len(lines) == 3   # no [DONE] after an error
