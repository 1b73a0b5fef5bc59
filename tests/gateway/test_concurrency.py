"""Many concurrent streams through one gateway (real HTTP) and two workers: every client gets
its own text, whole and in order, and its own usage."""

from __future__ import annotations

import asyncio
import json

import httpx

from helpers.gateway_fakes import CHAT
from worker.protocol import Done, Started, Token, Usage

N = 64


def echo(w, job):
    """Streams the user's message back word by word (so a mix-up between requests shows)."""
    words = job.messages[-1].content.split()
    w.emit(job, Started(worker_id=w.worker_id, prompt_tokens=len(words)))
    for i, word in enumerate(words):
        w.emit(job, Token(ids=[i], text=word + " "))
    w.emit(job, Done(finish_reason="stop",
                     usage=Usage(prompt_tokens=len(words), completion_tokens=len(words))))


async def _one(http: httpx.AsyncClient, i: int) -> tuple[str, dict]:
    words = [f"r{i}w{j}" for j in range(i % 7 + 3)]
    req = {**CHAT, "messages": [{"role": "user", "content": " ".join(words)}], "stream": True,
           "stream_options": {"include_usage": True}}
    text, usage = "", None
    async with http.stream("POST", "/v1/chat/completions", json=req) as res:
        assert res.status_code == 200, await res.aread()
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content", "")
            else:
                usage = chunk["usage"]
    assert text == "".join(w + " " for w in words), (i, text)
    return text, usage


def test_64_concurrent_streams_two_workers(live_url, make_worker):
    a, b = make_worker(script=echo), make_worker(script=echo)

    async def main():
        limits = httpx.Limits(max_connections=N)
        async with httpx.AsyncClient(base_url=live_url, timeout=30, limits=limits) as http:
            return await asyncio.gather(*(_one(http, i) for i in range(N)))

    results = asyncio.run(main())
    for i, (_text, usage) in enumerate(results):
        n = i % 7 + 3
        assert usage == {"prompt_tokens": n, "completion_tokens": n, "total_tokens": 2 * n}
    assert len(a.jobs) + len(b.jobs) == N
    assert a.jobs and b.jobs   # both workers served
