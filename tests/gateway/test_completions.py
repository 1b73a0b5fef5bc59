"""The OpenAI endpoints against a fake worker: exact response shapes, the exact SSE chunk
sequence, the job the worker receives, and unknown fields being ignored."""

from __future__ import annotations

import json

import pytest

from helpers.gateway_fakes import CHAT, reply, sse_lines
from worker.protocol import SamplingParams


def test_chat_completion_shape(client, worker):
    res = client.post("/v1/chat/completions", json=CHAT)
    assert res.status_code == 200, res.text
    assert res.headers["content-type"] == "application/json"
    body = res.json()
    assert body["id"].startswith("chatcmpl-") and res.headers["x-request-id"] == body["id"]
    assert isinstance(body["created"], int)
    assert body == {
        "id": body["id"], "object": "chat.completion", "created": body["created"], "model": "demo",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello world!"},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11},
    }
    # The RQ job id and the stream are the request id; the stream is gone once read.
    assert worker.jobs[0].request_id == body["id"]


def test_text_completion_shape(client, make_worker):
    make_worker(script=reply([" Paris", "."], finish="length", prompt_tokens=5))
    res = client.post("/v1/completions", json={"model": "demo", "prompt": "The capital is"})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["id"].startswith("cmpl-")
    assert body == {
        "id": body["id"], "object": "text_completion", "created": body["created"], "model": "demo",
        "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_exact_chunk_sequence(client, worker, include_usage):
    req = {**CHAT, "stream": True}
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    res = client.post("/v1/chat/completions", json=req)
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/event-stream")
    lines = sse_lines(res.text)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    cid, created = chunks[0]["id"], chunks[0]["created"]
    assert cid.startswith("chatcmpl-") and res.headers["x-request-id"] == cid

    def chunk(choices, **extra):
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": "demo",
             "choices": choices}
        if include_usage:
            c["usage"] = None
        return {**c, **extra}

    def delta(d, finish=None):
        return [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]

    expected = [
        chunk(delta({"role": "assistant", "content": ""})),
        chunk(delta({"content": "Hello"})),
        chunk(delta({"content": " world"})),   # the worker's '' token sends no chunk
        chunk(delta({"content": "!"})),
        chunk(delta({}, "stop")),
    ]
    if include_usage:
        expected.append(chunk([], usage={"prompt_tokens": 7, "completion_tokens": 4,
                                         "total_tokens": 11}))
    assert chunks == expected
    # Usage equals the non-streamed one (both come from the worker's Done).
    plain = client.post("/v1/chat/completions", json=CHAT).json()
    if include_usage:
        assert chunks[-1]["usage"] == plain["usage"]


def test_text_completion_stream(client, make_worker):
    make_worker(script=reply([" Pa", "ris"], prompt_tokens=4))
    res = client.post("/v1/completions", json={"model": "demo", "prompt": ["Capital:"], "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert res.status_code == 200
    lines = sse_lines(res.text)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    cid, created = chunks[0]["id"], chunks[0]["created"]
    assert cid.startswith("cmpl-")
    base = {"id": cid, "object": "text_completion", "created": created, "model": "demo"}

    def text(t, finish=None):
        return {**base, "choices": [{"index": 0, "text": t, "logprobs": None,
                                     "finish_reason": finish}], "usage": None}

    assert chunks == [
        text(" Pa"), text("ris"), text("", "stop"),
        {**base, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}},
    ]


def test_request_fields_reach_the_job(client, worker):
    req = {
        "model": "demo",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "name": "calc"},
        ],
        "max_tokens": 50, "max_completion_tokens": 20,
        "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": -3,
        "stop": "END", "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "user": "u1", "n": 1,
        # Unknown / unsupported-but-harmless fields are ignored.
        "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "text"},
        "parallel_tool_calls": False, "metadata": {"x": 1}, "some_future_field": [1, 2, 3],
        "logprobs": False,
    }
    assert client.post("/v1/chat/completions", json=req).status_code == 200
    job = worker.jobs[0]
    assert [(m.role, m.content, m.name) for m in job.messages] == [
        ("system", "Be brief.", None), ("user", "a\nb", None), ("assistant", None, None),
        ("tool", "42", "calc")]
    assert job.prompt is None and job.model == "demo"
    assert job.max_tokens == 20          # max_completion_tokens wins over max_tokens
    assert job.stop == ["END"]
    assert job.sampling == SamplingParams(temperature=0.0, top_p=0.9, top_k=40, min_p=0.05, seed=-3,
                                          presence_penalty=0.5, frequency_penalty=-0.5,
                                          repetition_penalty=1.1)
    assert job.created > 0


def test_defaults_reach_the_job(client, worker):
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.post("/v1/completions", json={"model": "demo", "prompt": "x",
                                                "stop": ["a", "b"]}).status_code == 200
    chat, text = worker.jobs
    assert chat.max_tokens is None and chat.stop == [] and chat.sampling == SamplingParams()
    assert text.prompt == "x" and text.messages is None
    assert text.max_tokens == 16         # OpenAI's default for /v1/completions
    assert text.stop == ["a", "b"]


def test_models_list_and_retrieve(client, make_worker):
    w = make_worker()
    make_worker()                              # a second worker of the same model: listed once
    make_worker(model="other")
    res = client.get("/v1/models")
    assert res.status_code == 200
    created = int(w.info.started_at)
    body = res.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["demo", "other"]
    assert body["data"][0] == {"id": "demo", "object": "model",
                               "created": body["data"][0]["created"], "owned_by": "specd"}
    assert abs(body["data"][0]["created"] - created) <= 1
    assert client.get("/v1/models/other").json()["id"] == "other"
    res = client.get("/v1/models/nope")
    assert res.status_code == 404
    assert res.json()["error"]["code"] == "model_not_found"
