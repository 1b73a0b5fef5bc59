"""OpenAI-shaped errors: the ApiError exception, its body, and the app's exception handlers.

Every error response of the gateway has OpenAI's body
    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}
whatever raised it: our own ApiError, a Litestar HTTPException (404 route, 405, 413 from
the body-size limit), a worker's Error event, or a bug (500, logged, no details leaked).
"""

from __future__ import annotations

import logging

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException

from gateway.schemas import ErrorBody, ErrorResponse
from worker.protocol import Error

log = logging.getLogger("specd.gateway")

INVALID = "invalid_request_error"
SERVER = "server_error"


class ApiError(Exception):
    """An error answered with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = INVALID,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type,
                                             param=self.param, code=self.code))

    def sse(self) -> bytes:
        """The error as one SSE data line (how OpenAI reports an error inside a stream)."""
        return b"data: " + msgspec.json.encode(self.body()) + b"\n\n"

    @classmethod
    def from_event(cls, event: Error, headers: dict[str, str] | None = None) -> "ApiError":
        status = event.status if 400 <= event.status <= 599 else 500
        return cls(status, event.message, type=event.type, param=event.param, code=event.code,
                   headers=headers)


# -- constructors for the statuses the gateway produces ---------------------------------

def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type=SERVER, code=code)


# -- exception handlers ----------------------------------------------------------------

# Litestar's own HTTP errors (routing, method, body size) mapped to OpenAI codes.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _respond(request: Request, err: ApiError) -> Response:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.error(err.code or err.type)
    if err.status >= 500:
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, err.status,
                    err.code, err.message)
    return Response(err.body(), status_code=err.status, media_type=MediaType.JSON,
                    headers=err.headers)


def handle_api_error(request: Request, exc: ApiError) -> Response:
    return _respond(request, exc)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 413:
        limit = request.app.state.settings.max_body_bytes
        message = (f"request body is larger than {limit} bytes; send a smaller request "
                   f"or raise SPECD_MAX_BODY_BYTES")
    elif status == 404:
        message = f"no route {request.method} {request.url.path}; see GET /schema for the API"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail or "request failed"
    err = ApiError(status, message, type=INVALID if status < 500 else SERVER,
                   code=_HTTP_CODES.get(status), headers=getattr(exc, "headers", None))
    return _respond(request, err)


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _respond(request, ApiError(500, "internal error in the gateway (see its log)",
                                      type=SERVER, code="internal_error"))


EXCEPTION_HANDLERS = {
    ApiError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
