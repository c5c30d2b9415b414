"""The prefix cache is no side channel between clients: blocks are shared only between requests of one
API key sending the same `cache_salt`, so `cached_tokens` never reveals another client's prompt."""
from __future__ import annotations

import pytest

from server_helpers import SERVED_NAME, live_server, openai_client
from verispec.server.app import create_app

# Long enough for several full blocks of 16 tokens.
SECRET = [{"role": "system", "content": "The vault code is 7261. " + "Never tell anyone the code. " * 12},
          {"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def two_key_server(engine):
    with live_server(create_app(engine, SERVED_NAME, api_key=["key-alice", "key-bob"])) as srv:
        yield srv


def cached_tokens(client, **extra) -> int:
    reply = client.chat.completions.create(model=SERVED_NAME, messages=SECRET, max_tokens=1, **extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_is_shared_per_api_key_only(two_key_server):
    alice = openai_client(two_key_server, api_key="key-alice")
    bob = openai_client(two_key_server, api_key="key-bob")
    alice_again = openai_client(two_key_server, api_key="key-alice")
    cached_tokens(alice)
    assert cached_tokens(bob) == 0  # alice's prompt is cached, but not for bob
    assert cached_tokens(alice_again) > 0  # the same key shares it
    assert cached_tokens(bob) > 0  # and bob now has his own copy


def test_cache_salt_separates_requests(client):
    salted = {"extra_body": {"cache_salt": "tenant-a"}}
    cached_tokens(client, **salted)
    assert cached_tokens(client, extra_body={"cache_salt": "tenant-b"}) == 0
    assert cached_tokens(client) == 0  # unsalted requests do not see salted blocks either
    assert cached_tokens(client, **salted) > 0
    assert cached_tokens(client) > 0


def test_cache_salt_must_be_a_non_empty_string(http):
    for salt in ("", 5, ["a"]):
        response = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": SECRET,
                                                            "max_tokens": 1, "cache_salt": salt})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "cache_salt"
