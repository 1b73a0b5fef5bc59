"""Gateway test fixtures. They live in tests/helpers/gateway_fakes.py (with the helper
functions the test modules import) and are registered here by name."""

from helpers.gateway_fakes import (  # noqa: F401  (pytest finds fixtures by name)
    client, keys, live_url, make_client, make_worker, prefix, r, redis_url, shared_client, worker,
)
