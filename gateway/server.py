"""serve(settings): run the gateway under uvicorn (`specd gateway`, `python -m gateway`)."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.settings import Settings


def serve(settings: Settings) -> None:
    """Blocks until SIGINT/SIGTERM. The app is built (and the settings validated) first."""
    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()  # uvicorn's names
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                proxy_headers=True, timeout_graceful_shutdown=10)
