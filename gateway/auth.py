"""Optional API keys (SPECD_API_KEYS): a Litestar guard on the /v1 routes.

Clients send `Authorization: Bearer <key>` (OpenAI SDKs) or `x-api-key: <key>`. With no
keys configured the guard lets everything through. /health, /ready, /metrics and the
OpenAPI schema stay public (probes and scrapers carry no keys), as in vLLM.
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from gateway.errors import ApiError


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    keys: tuple[bytes, ...] = connection.app.state.api_keys
    if not keys:
        return
    scheme, _sep, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    token = token.strip() or connection.headers.get("x-api-key", "").strip()
    if not token:
        raise ApiError(401, "missing API key; send the header 'Authorization: Bearer <key>' "
                            "with one of the keys set in SPECD_API_KEYS",
                       code="invalid_api_key")
    given = token.encode()
    # Compare against every key (constant time each) so timing does not reveal which matched.
    if not sum(hmac.compare_digest(given, key) for key in keys):
        raise ApiError(401, "invalid API key; use one of the keys set in SPECD_API_KEYS",
                       code="invalid_api_key")
