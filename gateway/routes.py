"""HTTP routes: the OpenAI endpoints (/v1, behind the API-key guard) and the operational ones
(/health, /ready, /metrics).

A completion request goes: decode + validate (translate.py) -> route to a served model
(404 / 503) -> queue length check (429) -> enqueue -> wait for the first event, watching
for a client disconnect. Only then is the status decided: an Error first event becomes
its HTTP status (e.g. 400 context_length_exceeded); Started commits to a 200, either the
whole completion (non-streaming) or an SSE stream.

Streams end with `data: [DONE]` after Done. If the request fails mid-stream (worker died,
Redis lost, engine error) the stream carries one `data: {"error": {...}}` line, OpenAI's
in-stream error shape, and closes WITHOUT [DONE], so clients cannot mistake it for a
complete answer (the OpenAI SDK raises APIError on it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
from litestar.background_tasks import BackgroundTask
from litestar import Controller, MediaType, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from gateway.auth import require_api_key
from gateway.errors import ApiError
from gateway.events import Events, Subscription
from gateway.metrics import Metrics
from gateway.schemas import (
    ChatCompletion,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TextCompletion,
)
from gateway.settings import Settings
from gateway.translate import (
    Chunks,
    Plan,
    chat_plan,
    check_context,
    completion_body,
    completion_plan,
    decode_chat,
    decode_completion,
)
from worker.protocol import Done, Error, Event, Token

T = TypeVar("T")
# Dependencies provided by name (gateway/app.py).
EventsDep = NamedDependency[Events]
MetricsDep = NamedDependency[Metrics]
SettingsDep = NamedDependency[Settings]
_encode = msgspec.json.encode
CLIENT_CLOSED = 499   # nginx's status for "client closed the request" (never seen by a client)

_ERRORS = {
    400: ResponseSpec(ErrorResponse, description="Invalid request (wrong type, out of range, "
                                                 "context_length_exceeded)"),
    401: ResponseSpec(ErrorResponse, description="Missing or invalid API key"),
    404: ResponseSpec(ErrorResponse, description="Model not served (the message lists those served)"),
    413: ResponseSpec(ErrorResponse, description="Request body too large"),
    429: ResponseSpec(ErrorResponse, description="The model's queue is full"),
    503: ResponseSpec(ErrorResponse, description="No live worker for the model, or Redis down"),
    504: ResponseSpec(ErrorResponse, description="The worker stopped answering, or no worker "
                                                 "started the request in time"),
}
_SSE_NOTE = ("With `stream: true` the response is `text/event-stream`: `data: <chunk JSON>` "
             "lines, then `data: [DONE]`; an error after the stream began arrives as one "
             "`data: {\"error\": {...}}` line and the stream closes without [DONE].")


# ---- the OpenAI endpoints -----------------------------------------------------------------

class OpenAIController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/chat/completions", status_code=200, summary="Create a chat completion",
          description=_SSE_NOTE,
          responses={200: ResponseSpec(ChatCompletion, description="The completion (stream: "
                                       "false) or SSE chat.completion.chunk lines"), **_ERRORS})
    async def chat_completions(self, request: Request, events: EventsDep, metrics: MetricsDep,
                               settings: SettingsDep) -> Response:
        plan = chat_plan(decode_chat(await request.body()))
        return await _complete(request, events, metrics, settings, plan)

    @post("/completions", status_code=200, summary="Create a text completion",
          description=_SSE_NOTE,
          responses={200: ResponseSpec(TextCompletion, description="The completion (stream: "
                                       "false) or SSE text_completion lines"), **_ERRORS})
    async def completions(self, request: Request, events: EventsDep, metrics: MetricsDep,
                          settings: SettingsDep) -> Response:
        plan = completion_plan(decode_completion(await request.body()))
        return await _complete(request, events, metrics, settings, plan)

    @get("/models", summary="List the served models",
         responses={200: ResponseSpec(ModelList, description="Models with a live worker"),
                    401: _ERRORS[401], 503: _ERRORS[503]})
    async def models(self, events: EventsDep) -> Response:
        cards = [_card(m, ws) for m, ws in sorted((await events.served(max_age_s=0)).items())]
        return _json(ModelList(data=cards))

    @get("/models/{model_id:str}", summary="Retrieve a served model",
         responses={200: ResponseSpec(ModelCard, description="The model"),
                    401: _ERRORS[401], 404: _ERRORS[404], 503: _ERRORS[503]})
    async def model(self, model_id: FromPath[str], events: EventsDep) -> Response:
        return _json(_card(model_id, await events.route(model_id)))


def _card(model: str, workers: list) -> ModelCard:
    created = min((int(w.started_at) for w in workers if w.started_at), default=0)
    return ModelCard(id=model, created=created)


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(obj), status_code=status, media_type=MediaType.JSON, headers=headers)


async def _complete(request: Request, events: Events, metrics: Metrics, settings: Settings,
                    plan: Plan) -> Response:
    t_start = time.monotonic()
    job = plan.job
    workers = await events.route(job.model)
    check_context(plan, max(w.n_ctx for w in workers))
    depth = await events.queue_depth(job.model)
    if depth >= settings.max_queue:
        raise ApiError(429, f"the queue of model '{job.model}' is full ({depth} requests waiting, "
                            f"limit {settings.max_queue}); retry later or raise SPECD_MAX_QUEUE",
                       type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    sub = await events.submit(job)
    headers = {"x-request-id": job.request_id}
    try:
        first = await _unless_disconnected(request, sub.next)
    except BaseException:
        await sub.aclose()
        raise
    if first is None:                       # the client left while the job was queued
        await sub.aclose()
        return Response(b"", status_code=CLIENT_CLOSED)
    if isinstance(first, Error):
        await sub.aclose()
        raise ApiError.from_event(first, headers)

    if plan.stream:
        headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        gen = _sse(sub, first, plan, metrics, t_start)

        async def close_stream() -> None:
            # Litestar does not close the iterator when the client drops mid-send, so the
            # generator's `finally` (which sets the cancel flag) would never run.
            await gen.aclose()

        return Stream(gen, media_type="text/event-stream", headers=headers,
                      background=BackgroundTask(close_stream))
    try:
        result = await _unless_disconnected(request,
                                            lambda: _collect(sub, first, plan, metrics, t_start))
    except ApiError as exc:
        exc.headers = headers
        raise
    finally:
        await sub.aclose()
    if result is None:
        return Response(b"", status_code=CLIENT_CLOSED)
    return _json(result, headers=headers)


async def _collect(sub: Subscription, first: Event, plan: Plan, metrics: Metrics,
                   t_start: float) -> ChatCompletion | TextCompletion:
    parts: list[str] = []
    t_first = None
    event = first
    while True:
        if isinstance(event, Token):
            t_first = t_first or time.monotonic()
            parts.append(event.text)
        elif isinstance(event, Done):
            _record(metrics, plan, event, t_start, t_first)
            return completion_body(plan, "".join(parts), event)
        elif isinstance(event, Error):
            raise ApiError.from_event(event)
        event = await sub.next()


async def _sse(sub: Subscription, first: Event, plan: Plan, metrics: Metrics,
               t_start: float) -> AsyncIterator[bytes]:
    chunks = Chunks(plan)
    t_first = None
    event = first
    try:
        if (line := chunks.first()) is not None:
            yield line
        while True:
            if isinstance(event, Token):
                t_first = t_first or time.monotonic()
                if event.text:
                    yield chunks.text(event.text)
            elif isinstance(event, Done):
                _record(metrics, plan, event, t_start, t_first)
                yield chunks.finish(event)
                if (line := chunks.usage(event)) is not None:
                    yield line
                yield chunks.done()
                return
            elif isinstance(event, Error):
                metrics.error(event.code or event.type)
                yield ApiError.from_event(event).sse()
                return
            event = await sub.next()
    finally:   # also runs when the client disconnects (the stream task is cancelled)
        await sub.aclose()


def _record(metrics: Metrics, plan: Plan, done: Done, t_start: float, t_first: float | None) -> None:
    metrics.completed(plan.job.model, t_start=t_start, t_first=t_first, t_done=time.monotonic(),
                      prompt_tokens=done.usage.prompt_tokens,
                      completion_tokens=done.usage.completion_tokens)


async def _unless_disconnected(request: Request, fn: Callable[[], Awaitable[T]]) -> T | None:
    """fn()'s result, or None if the client disconnected first (fn is then cancelled).
    The request body must have been read: the next ASGI receive() waits for a disconnect."""
    result: T | None = None
    error: BaseException | None = None

    async with anyio.create_task_group() as tg:
        async def run() -> None:
            nonlocal result, error
            try:
                result = await fn()
            except Exception as exc:   # re-raised below, unwrapped from the task group
                error = exc
            finally:
                tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    if error is not None:
        raise error
    return result


# ---- operational endpoints --------------------------------------------------------------

class OpsController(Controller):
    tags = ["Operations"]

    @get("/health", summary="Liveness: 200 while the process is up (public)")
    async def health(self) -> Health:
        return Health(status="ok")

    @get("/ready", summary="Readiness: Redis answers and at least one worker is live (public)",
         responses={503: ResponseSpec(Health, description="Not ready; `reason` says why")})
    async def ready(self, events: EventsDep) -> Response:
        try:
            await events.ping()
            served = await events.served(max_age_s=0)
        except ApiError as exc:
            return _json(Health(status="unavailable", reason=exc.message), status=503)
        n = sum(len(ws) for ws in served.values())
        if n == 0:
            return _json(Health(status="unavailable", reason="no live worker; start one with "
                                "`specd worker --model M`", workers=0, models=[]), status=503)
        return _json(Health(status="ready", workers=n, models=sorted(served)))

    @get("/metrics", summary="Prometheus metrics (public)", media_type=MediaType.TEXT)
    async def metrics(self, events: EventsDep, metrics: MetricsDep) -> Response:
        try:
            served = await events.served(max_age_s=0)
            models = sorted(set(served) | set(events.known_models()))
            depths = [await events.queue_depth(m) for m in models]
        except ApiError:
            metrics.redis_up.set(0)
        else:
            metrics.redis_up.set(1)
            for m, depth in zip(models, depths):
                metrics.queue_depth.labels(model=m).set(depth)
                metrics.live_workers.labels(model=m).set(len(served.get(m, [])))
        return Response(metrics.render(), media_type=metrics.content_type)
