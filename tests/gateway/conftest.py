"""Gateway test fixtures; they live in tests/helpers/gateway_fakes.py (with the helper
functions the test modules import), and are registered here."""

from helpers.gateway_fakes import *  # noqa: F401,F403  (fixtures register by name)
from helpers.gateway_fakes import (  # noqa: F401
    client, live_url, make_client, make_worker, prefix, r, keys, redis_url, shared_client, worker,
)
