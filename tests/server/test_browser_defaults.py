"""What a web page on another site can do to a local server: nothing, unless the server is told.

DNS rebinding (a foreign Host) is refused, a POST without a JSON content type (what a page may send
without a CORS preflight) is a 415 before the body is read, CORS is off unless --cors-origins names
the page's origin, and the API key guards everything but the chat page and /health."""
from __future__ import annotations

import httpx
import pytest

from server_helpers import SERVED_NAME, USER_MESSAGES, live_server
from verispec import cli
from verispec.server.app import create_app

CHAT = {"model": SERVED_NAME, "messages": USER_MESSAGES, "max_tokens": 1}


def test_foreign_host_is_refused(server):
    for host in ("evil.example", "evil.example:9999", "127.0.0.1.evil.example"):
        response = httpx.get(server.url + "/v1/models", headers={"Host": host})
        assert response.status_code == 400, host
        assert response.json()["error"]["code"] == "invalid_host"
    for host in ("localhost", "127.0.0.1:1234", "[::1]:80", "app.localhost"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_extend_the_list(engine):
    app = create_app(engine, SERVED_NAME, allowed_hosts=["api.example", ".corp.example"])
    with live_server(app) as srv:
        for host in ("api.example", "a.corp.example:8000", "localhost"):
            assert httpx.get(srv.url + "/health", headers={"Host": host}).status_code == 200, host
        assert httpx.get(srv.url + "/health", headers={"Host": "other.example"}).status_code == 400


def test_wildcard_bind_answers_addresses_but_not_names(engine):
    with live_server(create_app(engine, SERVED_NAME, bind_host="0.0.0.0")) as srv:
        assert httpx.get(srv.url + "/health", headers={"Host": "192.168.1.20:9999"}).status_code == 200
        assert httpx.get(srv.url + "/health", headers={"Host": "rebind.example"}).status_code == 400


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_post_without_json_content_type_is_415(http, content_type):
    headers = {"content-type": content_type} if content_type else {}
    request = http.build_request("POST", "/v1/chat/completions", content=httpx.Request(
        "POST", "http://x", json=CHAT).content, headers=headers)
    assert request.headers.get("content-type") == content_type
    response = http.send(request)
    assert response.status_code == 415, response.text
    assert response.json()["error"]["code"] == "unsupported_media_type"
    ok = http.post("/v1/chat/completions", json=CHAT, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200  # and the server keeps serving


def test_wrong_method_is_still_405_whatever_the_content_type(http):
    assert http.post("/v1/models", content=b"x").status_code == 405


def test_cors_is_off_by_default(http):
    preflight = http.options("/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    simple = http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_cors_origins_allow_only_the_named_origins(engine):
    app = create_app(engine, SERVED_NAME, api_key="k", cors_origins=["https://app.example"])
    with live_server(app) as srv:
        def preflight(origin: str) -> httpx.Response:
            return httpx.options(srv.url + "/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})

        allowed = preflight("https://app.example")  # a preflight carries no key: answered all the same
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-origin" not in preflight("https://evil.example").headers
        reply = httpx.post(srv.url + "/v1/chat/completions", json=CHAT,
                           headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"


def test_head_health(http):
    response = http.head("/health")
    assert response.status_code == 200 and response.content == b""


def test_docs_are_not_served_from_a_cdn(http):
    for path in ("/docs", "/redoc"):
        assert http.get(path).status_code == 404
    assert http.get("/openapi.json").status_code == 200


def test_unknown_model_is_not_echoed_in_full(http):
    huge = "m" * 1_000_000
    response = http.post("/v1/chat/completions", json={**CHAT, "model": huge})
    assert response.status_code == 404 and len(response.content) < 1000
    assert "1000000 characters" in response.json()["error"]["message"]
    response = http.get("/v1/models/" + "m" * 5000)
    assert response.status_code == 404 and len(response.content) < 1000


@pytest.mark.parametrize("flag, value, message", [
    ("--cors-origins", "ftp://x", "--cors-origins"), ("--cors-origins", "https://a.example/path", "--cors-origins"),
    ("--allowed-hosts", "http://a.example", "--allowed-hosts"), ("--allowed-hosts", "a.example:80", "--allowed-hosts"),
    ("--api-key", "", "--api-key"), ("--api-key", " padded ", "--api-key")])
def test_bad_browser_flags_fail_before_the_model_loads(flag, value, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_engine_config", lambda args: pytest.fail("the model started loading"))
    assert cli.main(["serve", "--port", "1", flag, value]) == 2
    assert message in capsys.readouterr().err
