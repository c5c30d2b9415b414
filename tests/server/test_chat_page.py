"""The chat page's server side: `/` and its assets (all local, behind a strict CSP), the info
endpoint, and the `verispec` speculation field on streamed chat choices. The page itself is tested
in a real browser in test_chat_page_browser.py."""
from __future__ import annotations

import re

import httpx
import pytest

from paced_engine import PacedEngine, Piece
from server_helpers import SERVED_NAME, USER_MESSAGES, extra, live_server, sse_payloads
from verispec.engine.types import GenerationChunk, GenerationStats
from verispec.loading.tokenizer import Tokenizer
from verispec.server.app import create_app
from verispec.server.chat_page import PAGE_CSP, load_static_assets
from verispec.server.speculation import SpeculationTally


@pytest.fixture(scope="module")
def paced_engine(tiny_model_dir) -> PacedEngine:
    return PacedEngine(Tokenizer.from_dir(tiny_model_dir), method="mtp", num_drafts=2)


@pytest.fixture(scope="module")
def paced_server(paced_engine):
    with live_server(create_app(paced_engine, "paced", merge_chunks=False)) as srv:
        yield srv


def test_page_and_every_asset_it_names_come_from_this_server(http):
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == PAGE_CSP
    assert "script-src 'self'" in PAGE_CSP and "unsafe-inline" not in PAGE_CSP
    linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert linked and all(url.startswith("/static/") for url in linked), linked
    assert "<script>" not in page.text and "style=" not in page.text  # nothing inline: the CSP forbids it
    for url in linked:
        asset = http.get(url)
        assert asset.status_code == 200, url
        assert asset.headers["cache-control"] == "no-cache"
    for name, body in load_static_assets().items():
        text = body.decode()
        if name.endswith(".js"):  # modules import only their siblings
            assert all(m.startswith("./") for m in re.findall(r'from\s+"([^"]+)"', text)), name
            # model text reaches the DOM as text nodes only: no HTML-parsing sink anywhere
            assert not re.search(r"\.(inner|outer)HTML\b|insertAdjacentHTML|document\.write|\beval\(|new Function",
                                 text), name
        if name.endswith(".css"):
            assert "@import" not in text and "url(" not in text, name
    assert http.get("/static/chat.js").headers["content-type"].startswith("text/javascript")


def test_only_shipped_static_names_are_served(http):
    assert http.get("/static/nope.js").status_code == 404
    assert http.get("/static/..%2Fchat_page.py").status_code == 404
    assert http.get("/static/../app.py").status_code == 404


def test_info_describes_model_method_and_device(http, paced_server):
    plain = http.get("/v1/verispec/info").json()
    assert plain["model"] == SERVED_NAME and plain["method"] == "ar" and plain["method_label"] == "plain"
    assert plain["num_drafts"] == 0 and plain["device"] == "cpu" and plain["dtype"] == "float32"
    assert plain["max_model_len"] > 0 and plain["version"].startswith("verispec-")
    spec = httpx.get(paced_server.url + "/v1/verispec/info").json()
    assert (spec["method"], spec["method_label"], spec["num_drafts"]) == ("mtp", "MTP", 2)


def test_api_key_guards_info_but_not_the_page(paced_engine):
    with live_server(create_app(paced_engine, "paced", api_key="sekret", merge_chunks=False)) as srv:
        assert httpx.get(srv.url + "/").status_code == 200
        assert httpx.get(srv.url + "/static/chat.js").status_code == 200
        assert httpx.get(srv.url + "/v1/verispec/info").status_code == 401
        ok = httpx.get(srv.url + "/v1/verispec/info", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["model"] == "paced"


def stream_choices(url: str, **body) -> list[dict]:
    request = {"model": body.pop("model", "paced"), "messages": USER_MESSAGES, "stream": True, **body}
    with httpx.stream("POST", url + "/v1/chat/completions", json=request, timeout=30) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    return [p["choices"][0] for p in payloads[:-1] if p["choices"]]


def test_stream_field_counts_tokens_drafts_and_rounds(paced_engine, paced_server):
    paced_engine.script = [Piece("a", 1, 0), Piece("bcd", 3, 2), Piece("", 2, 1),  # text held back
                           Piece("efgh", 1, 0), Piece("ij", 3, 3)]
    choices = stream_choices(paced_server.url)
    # every choice carries the field but the role chunk and the finish choice (sent after the last text)
    assert ["verispec" in c for c in choices] == [False, True, True, True, True, False]
    sent = [c["verispec"] for c in choices if "verispec" in c]
    # the held-back round's counts ride on the next choice that is sent
    assert [(f["tokens"], f["drafted_tokens"], f["rounds"]) for f in sent] == [(1, 0, 0), (3, 2, 1), (3, 1, 2),
                                                                                 (3, 3, 1)]
    assert sum(f["tokens"] for f in sent) == 10
    assert sent[-1]["stats"]["method"] == "mtp" and sent[-1]["stats"]["accepted"] == 6
    assert "verispec" not in choices[0]  # the role chunk reports no tokens


def test_stream_field_with_the_real_engine_and_the_openai_client(client):
    stream = client.chat.completions.create(model=SERVED_NAME, messages=USER_MESSAGES, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    fields = [extra(c.choices[0], "verispec") for c in chunks if c.choices]
    fields = [f for f in fields if f]
    assert sum(f["tokens"] for f in fields) == chunks[-1].usage.completion_tokens == 12
    assert sum(f["drafted_tokens"] for f in fields) == 0  # plain decoding: every token is the target's
    assert sum(f["rounds"] for f in fields) == 11  # one token from prefill, then one per target pass
    assert fields[-1]["stats"]["method"] == "ar" and fields[-1]["stats"]["rounds"] == 11


def test_tally_reports_nothing_until_tokens_arrive():
    tally = SpeculationTally()
    assert tally.take() is None
    tally.add(GenerationChunk([7], "x"))
    tally.add(GenerationChunk([8, 9, 10], "", num_drafted=2, num_rounds=1))
    assert tally.take() == {"tokens": 4, "drafted_tokens": 2, "rounds": 1}
    assert tally.take() is None
    tally.add(GenerationChunk([], "", stats=GenerationStats(method="eagle3", drafted=3, accepted=2, rounds=1)))
    assert tally.take()["stats"]["accepted"] == 2


def test_browser_tests_skip_with_the_install_command_when_no_browser(monkeypatch):
    import browser

    monkeypatch.setattr(browser, "CHROMIUM_CANDIDATES", ["/nonexistent/chromium"])
    monkeypatch.setattr(browser, "DRIVER_CANDIDATES", ["/nonexistent/chromedriver"])
    monkeypatch.setattr(browser.shutil, "which", lambda name: None)
    reason = browser.find_browser()
    assert isinstance(reason, str) and "apt-get install -y chromium chromium-driver" in reason
    with pytest.raises(pytest.skip.Exception, match="no headless Chromium"):
        browser.chromium_or_skip()
