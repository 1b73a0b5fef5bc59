"""create_app(settings): the Litestar application, its resources and its OpenAPI document.

Resources, one lifespan each: the async Redis client (events, liveness), the sync Redis
client (rq's enqueue API is synchronous) and the Events facade built on both. Neither
client connects before the first command, so the app starts (and /health answers) while
Redis is down; /ready and the API then answer 503 until it is back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import redis
import redis.asyncio as aredis
from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import OpenAPIMediaType, RequestBody
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from gateway.errors import EXCEPTION_HANDLERS
from gateway.events import Events
from gateway.metrics import Metrics
from gateway.routes import OpenAIController, OpsController
from gateway.schemas import ChatCompletionChunk, ChatCompletionRequest, CompletionRequest
from gateway.settings import Settings

VERSION = "0.1.0"
_CONNECT_TIMEOUT_S = 2.0


def _redis_options(settings: Settings) -> dict:
    # Fail fast when Redis is down (one quick retry covers a stale pooled connection);
    # reads may block for poll_s (XREAD BLOCK), hence the socket timeout above it.
    return {"socket_connect_timeout": _CONNECT_TIMEOUT_S,
            "socket_timeout": settings.poll_s + 5.0,
            "health_check_interval": 30}


@asynccontextmanager
async def _redis(app: Litestar) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    client = aredis.Redis.from_url(settings.redis_url, **_redis_options(settings),
                                   retry=AsyncRetry(ExponentialBackoff(cap=0.2, base=0.05), 1))
    app.state.redis = client
    try:
        yield
    finally:
        await client.aclose()


@asynccontextmanager
async def _redis_sync(app: Litestar) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    client = redis.Redis.from_url(settings.redis_url, **_redis_options(settings),
                                  retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1))
    app.state.redis_sync = client
    try:
        yield
    finally:
        client.close()


@asynccontextmanager
async def _events(app: Litestar) -> AsyncIterator[None]:
    events = app.state.events = Events(app.state.redis, app.state.redis_sync, app.state.settings)
    try:
        yield
    finally:
        await events.aclose()


def _provide_events(state: State) -> Events:
    return state.events


def _provide_metrics(state: State) -> Metrics:
    return state.metrics


def _provide_settings(state: State) -> Settings:
    return state.settings


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or Settings.from_env()
    metrics = Metrics()
    app = Litestar(
        route_handlers=[OpenAIController, OpsController],
        lifespan=[_redis, _redis_sync, _events],
        state=State({"settings": settings, "metrics": metrics,
                     "api_keys": tuple(k.encode() for k in settings.api_keys)}),
        dependencies={"events": Provide(_provide_events, sync_to_thread=False),
                      "metrics": Provide(_provide_metrics, sync_to_thread=False),
                      "settings": Provide(_provide_settings, sync_to_thread=False)},
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[metrics.before_send],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="specd", version=VERSION, path="/schema",
            description="OpenAI-compatible gateway of specd (speculative LLM inference serving).",
        ),
    )
    _document_request_bodies(app)
    return app


def _document_request_bodies(app: Litestar) -> None:
    """The completion handlers decode their bodies themselves (to answer type errors with
    OpenAI's error body), so Litestar does not see their request types: add them, and the
    stream chunk, to the OpenAPI document from msgspec's own JSON schema."""
    types = [ChatCompletionRequest, CompletionRequest, ChatCompletionChunk]
    refs, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    openapi = app.openapi_schema            # built once and cached by Litestar's OpenAPI plugin
    schemas = openapi.components.schemas = openapi.components.schemas or {}
    for name, schema in components.items():
        schemas.setdefault(name, schema)
    for path, ref in (("/v1/chat/completions", refs[0]), ("/v1/completions", refs[1])):
        operation = openapi.paths[path].post
        operation.request_body = RequestBody(
            content={"application/json": OpenAPIMediaType(schema=ref)}, required=True)
