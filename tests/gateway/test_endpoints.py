"""Operational endpoints and auth: /health, /ready, /metrics, the OpenAPI schema, API keys."""

from __future__ import annotations

import re

import pytest

from helpers.gateway_fakes import CHAT, error_body


# ---- /health and /ready -----------------------------------------------------------------------

def test_health_is_always_200(make_client):
    for client in (make_client(), make_client(redis_url="redis://127.0.0.1:1/0")):
        res = client.get("/health")
        assert res.status_code == 200
        assert res.json() == {"status": "ok", "reason": None, "workers": None, "models": None}


def test_ready_needs_redis_and_a_live_worker(client, make_worker):
    res = client.get("/ready")
    assert res.status_code == 503
    assert res.json() == {"status": "unavailable", "workers": 0, "models": [],
                          "reason": "no live worker; start one with `specd worker --model M`"}
    w = make_worker()
    res = client.get("/ready")
    assert res.status_code == 200
    assert res.json() == {"status": "ready", "reason": None, "workers": 1, "models": ["demo"]}
    w.stop()
    assert client.get("/ready").status_code == 503


def test_ready_without_redis(make_client):
    res = make_client(redis_url="redis://127.0.0.1:1/0").get("/ready")
    assert res.status_code == 503
    body = res.json()
    assert body["status"] == "unavailable"
    assert body["reason"].startswith("Redis is unavailable (ConnectionError: ")


# ---- /metrics ---------------------------------------------------------------------------------

def test_metrics_after_requests(client, worker):
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.post("/v1/chat/completions", json={**CHAT, "stream": True}).status_code == 200
    assert client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}).status_code == 404
    assert client.post("/v1/chat/completions", json={**CHAT, "n": 3}).status_code == 400
    res = client.get("/metrics")
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/plain")
    text = res.text

    def value(sample: str) -> float:
        m = re.search("^" + re.escape(sample) + r" (\S+)$", text, re.M)
        assert m, f"{sample} not in metrics:\n{text}"
        return float(m.group(1))

    assert value('specd_requests_total{method="POST",route="/v1/chat/completions",status="200"}') == 2
    assert value('specd_requests_total{method="POST",route="/v1/chat/completions",status="404"}') == 1
    assert value('specd_requests_total{method="POST",route="/v1/chat/completions",status="400"}') == 1
    assert value('specd_time_to_first_token_seconds_count{model="demo"}') == 2
    assert value('specd_time_per_output_token_seconds_count{model="demo"}') == 2
    assert value('specd_prompt_tokens_total{model="demo"}') == 14
    assert value('specd_completion_tokens_total{model="demo"}') == 8
    assert value('specd_queue_depth{model="demo"}') == 0
    assert value('specd_live_workers{model="demo"}') == 1
    assert value('specd_errors_total{code="model_not_found"}') == 1
    assert value('specd_errors_total{code="invalid_request_error"}') == 1
    assert value("specd_redis_up") == 1
    assert 'specd_time_to_first_token_seconds_bucket{le="0.005",model="demo"}' in text


def test_metrics_without_redis(make_client):
    res = make_client(redis_url="redis://127.0.0.1:1/0").get("/metrics")
    assert res.status_code == 200
    assert "specd_redis_up 0.0" in res.text


# ---- OpenAPI ------------------------------------------------------------------------------------

def test_openapi_schema_documents_the_api(client):
    res = client.get("/schema/openapi.json")
    assert res.status_code == 200
    doc = res.json()
    assert doc["info"]["title"] == "specd"
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}",
            "/health", "/ready", "/metrics"} <= set(doc["paths"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert chat["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletion"}
    assert chat["responses"]["404"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ChatMessageIn", "ChatCompletion",
                 "ChatCompletionChunk", "TextCompletion", "ModelList", "ErrorResponse", "Usage"):
        assert name in schemas, name
    req = schemas["ChatCompletionRequest"]
    assert set(req["required"]) == {"model", "messages"}
    assert {"temperature", "top_k", "min_p", "stop", "stream_options", "max_completion_tokens"} <= set(
        req["properties"])


# ---- API keys -----------------------------------------------------------------------------------

@pytest.fixture
def keyed(make_client):
    return make_client(api_keys=("k-one", "k-two"))


def test_api_keys_required_on_v1(keyed, worker):
    res = keyed.post("/v1/chat/completions", json=CHAT)
    assert res.status_code == 401
    assert res.json() == error_body("missing API key; send the header 'Authorization: Bearer <key>' "
                                    "with one of the keys set in SPECD_API_KEYS", code="invalid_api_key")
    for headers in ({"Authorization": "Bearer nope"}, {"Authorization": "Basic k-one"},
                    {"x-api-key": "k-onex"}):
        res = keyed.get("/v1/models", headers=headers)
        assert res.status_code == 401, headers
        body = res.json()
        if "Basic" in str(headers):
            assert body["error"]["message"].startswith("missing API key")
        else:
            assert body == error_body("invalid API key; use one of the keys set in SPECD_API_KEYS",
                                      code="invalid_api_key")
    assert worker.jobs == []
    assert keyed.post("/v1/chat/completions", json=CHAT,
                      headers={"Authorization": "Bearer k-two"}).status_code == 200
    assert keyed.get("/v1/models", headers={"x-api-key": "k-one"}).status_code == 200


def test_auth_runs_before_the_body_is_read(make_client):
    client = make_client(api_keys=("k",), max_body_bytes=1024)
    res = client.post("/v1/chat/completions", content=b"x" * 4096)
    assert res.status_code == 401


def test_public_endpoints_with_keys(keyed, worker):
    for path in ("/health", "/ready", "/metrics", "/schema/openapi.json"):
        assert keyed.get(path).status_code == 200, path


def test_no_keys_means_no_auth(client, worker):
    assert client.get("/v1/models").status_code == 200
