"""Prometheus metrics of one app (its own CollectorRegistry, so several apps can live in one
process, e.g. in tests) and the hook that counts requests.

    specd_requests_total{route,method,status}      HTTP requests by route template
    specd_time_to_first_token_seconds{model}       request received -> first token event
    specd_time_per_output_token_seconds{model}     (done - first token) / (tokens - 1)
    specd_prompt_tokens_total{model}, specd_completion_tokens_total{model}
    specd_queue_depth{model}                       jobs waiting on the model's RQ queue
    specd_live_workers{model}                      workers with a live heartbeat
    specd_errors_total{code}                       error responses and stream errors by code
    specd_redis_up                                 1 if Redis answered the last scrape
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from litestar.types import Message, Scope

# Seconds. TTFT spans queueing + prefill; TPOT spans one decode step on CPU..GPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specd_requests", "HTTP requests", ["route", "method", "status"],
                                registry=r)
        self.ttft = Histogram("specd_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token", ["model"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specd_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", ["model"],
                              buckets=_TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specd_prompt_tokens", "Prompt tokens processed", ["model"],
                                     registry=r)
        self.completion_tokens = Counter("specd_completion_tokens", "Tokens generated", ["model"],
                                         registry=r)
        self.queue_depth = Gauge("specd_queue_depth", "Jobs waiting on a model's queue", ["model"],
                                 registry=r)
        self.live_workers = Gauge("specd_live_workers", "Workers with a live heartbeat", ["model"],
                                  registry=r)
        self.errors = Counter("specd_errors", "Errors returned to clients, by code", ["code"],
                              registry=r)
        self.redis_up = Gauge("specd_redis_up", "1 if Redis answered the last scrape", registry=r)

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def completed(self, model: str, *, t_start: float, t_first: float | None, t_done: float,
                  prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.labels(model=model).inc(prompt_tokens)
        self.completion_tokens.labels(model=model).inc(completion_tokens)
        if t_first is not None:
            self.ttft.labels(model=model).observe(t_first - t_start)
            if completion_tokens > 1:
                self.tpot.labels(model=model).observe((t_done - t_first) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def before_send(self, message: Message, scope: Scope) -> None:
        """Litestar before_send hook: sees every response start, error responses included."""
        if message["type"] == "http.response.start":
            route = scope.get("path_template") or "unmatched"
            self.requests.labels(route=route, method=scope["method"],
                                 status=str(message["status"])).inc()
