"""/v1/models, /health, /metrics and --api-key."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import SERVED_NAME, USER_MESSAGES, live_server, openai_client
from verispec.server.app import create_app


def test_models(client, http, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].object == "model" and models[0].owned_by == "verispec"
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == engine.max_model_len
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_health(http):
    response = http.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def metric_samples(http) -> dict:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_requests_tokens_and_latency(client, http):
    before = metric_samples(http)
    out = client.chat.completions.create(model=SERVED_NAME, messages=USER_MESSAGES, max_tokens=3)
    http.post("/v1/chat/completions", json={"model": "nope", "messages": USER_MESSAGES})
    after = metric_samples(http)

    ok = dict(endpoint="/v1/chat/completions", status="200")
    missing = dict(endpoint="/v1/chat/completions", status="404")
    assert value(after, "verispec_requests_total", **ok) == value(before, "verispec_requests_total", **ok) + 1
    assert value(after, "verispec_requests_total", **missing) == value(before, "verispec_requests_total", **missing) + 1
    assert (value(after, "verispec_prompt_tokens_total") - value(before, "verispec_prompt_tokens_total")
            == out.usage.prompt_tokens)
    assert (value(after, "verispec_generation_tokens_total") - value(before, "verispec_generation_tokens_total")
            == out.usage.completion_tokens)
    latency_count = "verispec_request_latency_seconds_count"
    assert value(after, latency_count, endpoint="/v1/chat/completions") >= 2
    assert value(after, "verispec_time_to_first_token_seconds_count") >= 1
    assert value(after, "verispec_generations_in_flight") == 0


@pytest.fixture(scope="module")
def keyed_server(engine):
    with live_server(create_app(engine, SERVED_NAME, api_key="sesame")) as srv:
        yield srv


def test_api_key_required_everywhere_but_the_page_and_health(keyed_server):
    url = keyed_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}, {"Authorization": "Basic sesame"},
                    {"Authorization": "Bearer"}, {"Authorization": "Bearersesame"}):
        response = httpx.post(url + "/v1/chat/completions", headers=headers,
                              json={"model": SERVED_NAME, "messages": USER_MESSAGES, "max_tokens": 2})
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/v1/chat/completions", content="{bad json").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/").status_code == 200
    for path in ("/metrics", "/openapi.json", "/docs"):  # what they tell is for key holders too
        assert httpx.get(url + path).status_code == 401, path
    keyed = {"Authorization": "Bearer sesame"}
    assert httpx.get(url + "/metrics", headers=keyed).status_code == 200
    assert httpx.get(url + "/openapi.json", headers=keyed).status_code == 200
    for scheme in ("bearer", "BEARER", "Bearer "):  # the scheme is case-insensitive (RFC 9110)
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"{scheme} sesame"}).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai_client(keyed_server, api_key="wrong").models.list()
    good = openai_client(keyed_server, api_key="sesame")
    assert good.chat.completions.create(model=SERVED_NAME, messages=USER_MESSAGES, max_tokens=2).choices
    assert 'status="401"' in httpx.get(url + "/metrics", headers=keyed).text


def test_metrics_name_what_the_kv_cache_stores(http):
    # --kv-cache-dtype auto: the model's dtype
    samples = metric_samples(http)
    stored = [dict(labels)["dtype"] for (name, labels), v in samples.items() if name == "verispec_kv_cache_dtype_info"]
    assert stored and all(d in ("float32", "float64", "bfloat16", "float16") for d in stored)
