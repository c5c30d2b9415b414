"""The chat page in headless Chromium against live servers: the tiny test model for a real
conversation, PacedEngine for scripted replies (slow ones to stop, hostile ones to render).

Skipped, naming the install command, where Chromium, chromedriver or selenium is missing."""
from __future__ import annotations

import time

import pytest

from browser import chromium, chromium_or_skip, console_errors
from paced_engine import PacedEngine, Piece, rounds_of
from server_helpers import SERVED_NAME, live_server
from verispec.engine.types import FinishReason
from verispec.loading.tokenizer import Tokenizer
from verispec.server.app import create_app

HOSTILE = ('<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
           '[click](javascript:window.__pwned=3) <b>bold?</b>')


@pytest.fixture(scope="module")
def web():
    browser, driver = chromium_or_skip()
    with chromium(browser, driver) as driver_session:
        yield driver_session


@pytest.fixture(scope="module")
def paced_engine(tiny_model_dir) -> PacedEngine:
    return PacedEngine(Tokenizer.from_dir(tiny_model_dir), method="eagle3", num_drafts=3)


@pytest.fixture(scope="module")
def paced_server(paced_engine):
    with live_server(create_app(paced_engine, "paced", merge_chunks=False)) as srv:
        yield srv


def wait_for(web, script: str, timeout_s: float = 20.0, what: str = ""):
    """Polls a JavaScript expression until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = web.execute_script("return " + script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or script}")
        time.sleep(0.05)


def open_fresh(web, url: str) -> None:
    """The page with empty storage, ready (its header loaded from /v1/verispec/info)."""
    web.get(url + "/")
    web.execute_script("localStorage.clear(); sessionStorage.clear();")
    web.get(url + "/")
    wait_for(web, "document.body.dataset.ready === '1'", what="the page to load the server info")


def set_field(web, element_id: str, value: str) -> None:
    field = web.find_element("id", element_id)
    field.clear()
    field.send_keys(value)
    web.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def send(web, text: str) -> None:
    web.find_element("id", "prompt").send_keys(text)
    web.find_element("id", "send").click()


def last_reply_state(web) -> str:
    return web.execute_script("return document.querySelector('.message.assistant:last-of-type')?.dataset.state")


def wait_reply_done(web, timeout_s: float = 60.0) -> None:
    wait_for(web, "document.querySelector('.message.assistant:last-of-type')?.dataset.state === 'done'",
             timeout_s, "the reply to finish")


def reply_text(web) -> str:
    return web.execute_script("return document.querySelector('.message.assistant:last-of-type .content')"
                              ".textContent")


def test_conversation_with_the_tiny_model_streams_and_survives_a_reload(web, server):
    console_errors(web)
    open_fresh(web, server.url)
    header = web.find_element("id", "server-info").text
    assert SERVED_NAME in header and "plain decoding" in header and "cpu" in header
    assert web.title == f"{SERVED_NAME} · verispec"
    web.find_element("id", "toggle-settings").click()
    set_field(web, "max-tokens", "24")
    set_field(web, "temperature", "0")
    send(web, "Hello there")
    wait_reply_done(web)
    first_reply = reply_text(web)
    events = int(web.execute_script("return document.querySelector('.message.assistant').dataset.events"))
    assert first_reply.strip() and events > 2  # the role chunk, then text in several streamed pieces
    meta = web.find_element("css selector", ".message.assistant .meta").text
    assert "tokens" in meta and "tok/s" in meta

    send(web, "And again")  # a second turn: the history goes with it
    wait_for(web, "document.querySelectorAll('.message.assistant').length === 2")
    wait_reply_done(web)
    web.refresh()
    wait_for(web, "document.querySelectorAll('.message').length === 4", what="the conversation after a reload")
    texts = web.execute_script("return [...document.querySelectorAll('.message .content')].map(e => e.textContent)")
    assert texts[0] == "Hello there" and texts[1] == first_reply and texts[2] == "And again"
    assert web.find_element("id", "max-tokens").get_attribute("value") == "24"  # settings kept too
    assert console_errors(web) == []  # no script error, no CSP violation, nothing failed to load


def test_stop_cancels_the_tiny_model_mid_reply(web, server, spy):
    spy.step_delay_s = 0.03  # 600 slowed steps take 18 s or more: a reply that ends early was stopped
    open_fresh(web, server.url)
    web.find_element("id", "toggle-settings").click()
    set_field(web, "max-tokens", "600")
    set_field(web, "temperature", "0")
    send(web, "Write a long essay")
    wait_for(web, "document.querySelector('.message.assistant .content')?.textContent.length > 10",
             what="streamed text")
    from selenium.webdriver.common.keys import Keys  # here: without selenium the module must still import

    web.find_element("tag name", "body").send_keys(Keys.ESCAPE)  # Esc stops too
    last = spy.wait_finished(timeout_s=5)
    assert last.finish_reason is FinishReason.CANCELLED and last.stats.generated_tokens < 600
    wait_for(web, "document.querySelector('.message.assistant').dataset.state === 'stopped'")
    assert len(reply_text(web)) > 10


def test_text_appears_while_streaming_and_stop_cancels_on_the_server(web, paced_engine, paced_server):
    paced_engine.script = [Piece(f"word{i} ", 1, 0) for i in range(400)]
    paced_engine.delay_s = 0.03  # 12 s if nobody stops it
    open_fresh(web, paced_server.url)
    send(web, "Tell me a long story")
    wait_for(web, "document.querySelector('.message.assistant .content')?.textContent.includes('word3')",
             what="streamed text")
    assert last_reply_state(web) == "streaming"
    early = reply_text(web)
    wait_for(web, f"document.querySelector('.message.assistant .content').textContent.length > {len(early)}")
    assert web.find_element("id", "stop").is_displayed() and not web.find_element("id", "send").is_displayed()
    assert "tok/s" in wait_for(web, "document.getElementById('live-stats').textContent.includes('tok/s') && "
                                    "document.getElementById('live-stats').textContent")

    web.find_element("id", "stop").click()
    assert paced_engine.cancelled.wait(5), "the server did not cancel the generation"
    assert not paced_engine.finished.is_set()
    wait_for(web, "document.querySelector('.message.assistant').dataset.state === 'stopped'")
    stopped_text = reply_text(web)
    assert "word3" in stopped_text and "word399" not in stopped_text
    assert "stopped" in web.find_element("css selector", ".message.assistant .meta").text
    assert web.find_element("id", "send").is_displayed()
    web.refresh()  # the partial reply was kept
    wait_for(web, "document.querySelectorAll('.message').length === 2")
    assert reply_text(web) == stopped_text


def test_model_markup_renders_as_text(web, paced_engine, paced_server):
    paced_engine.delay_s = 0.0
    paced_engine.script = [Piece(HOSTILE[i:i + 7], 2, 1) for i in range(0, len(HOSTILE), 7)]
    console_errors(web)
    open_fresh(web, paced_server.url)
    send(web, "Say something nasty")
    wait_reply_done(web)
    assert reply_text(web) == HOSTILE
    inside = web.execute_script("return document.querySelectorAll('#messages script, #messages img, #messages b,"
                                " #messages a').length")
    assert inside == 0
    assert web.execute_script("return window.__pwned") is None
    web.refresh()  # and again when the stored conversation is rendered
    wait_for(web, "document.querySelectorAll('.message').length === 2")
    assert reply_text(web) == HOSTILE and web.execute_script("return window.__pwned") is None
    assert console_errors(web) == []  # not even a blocked attempt: nothing was parsed as markup


def test_reasoning_markdown_copy_and_draft_tint(web, paced_engine, paced_server):
    paced_engine.delay_s = 0.0
    paced_engine.script = [
        Piece("<think>weighing it", 3, 3), Piece(" up</think>", 2, 0),
        Piece("Use **this**:\n\n", 4, 0), Piece("```python\nprint('hi')\n```\n", 4, 4),
        Piece("- see [docs](https://example.org/x)", 2, 0),
    ]
    open_fresh(web, paced_server.url)
    header = web.find_element("id", "server-info").text
    assert "EAGLE3" in header and "3 drafts/round" in header
    send(web, "Show me")
    wait_reply_done(web)
    reasoning = web.find_element("css selector", ".message.assistant details.reasoning")
    assert reasoning.text.startswith("Reasoning") and "weighing it up" in reasoning.text
    web.find_element("css selector", ".message.assistant details.reasoning summary").click()
    assert reasoning.get_attribute("open") is None  # collapsed
    assert web.find_element("css selector", ".content strong").text == "this"
    code = web.find_element("css selector", ".code-block pre code").text
    assert code == "print('hi')"
    copy = web.find_element("css selector", ".code-block button.copy")
    copy.click()
    wait_for(web, "document.querySelector('.code-block button.copy').textContent !== 'Copy'")
    assert copy.text in ("Copied", "Copy failed")
    link = web.find_element("css selector", ".content li a")
    assert link.get_attribute("href") == "https://example.org/x" and link.get_attribute("rel") == "noopener noreferrer nofollow"
    # wholly drafted rounds are tinted, wholly target rounds are not (fences are markup, not text)
    tinted = web.execute_script("return [...document.querySelectorAll('.message.assistant .drafted')]"
                                ".map(e => e.textContent).join('|')")
    assert tinted == "weighing it|print('hi')"
    meta = web.find_element("css selector", ".message.assistant .meta").text
    assert "acceptance" in meta and "tok/round" in meta and "7 of 15 tokens drafted" in meta


def test_system_prompt_settings_and_new_chat(web, paced_engine, paced_server):
    paced_engine.delay_s = 0.0
    paced_engine.script = [Piece("ok", 1, 0)]
    open_fresh(web, paced_server.url)
    web.find_element("id", "toggle-settings").click()
    set_field(web, "system-prompt", "You are terse.")
    set_field(web, "temperature", "0.3")
    set_field(web, "max-tokens", "77")
    send(web, "Hi")
    wait_reply_done(web)
    prompt = paced_engine.tokenizer.decode(paced_engine.last_prompt_ids)
    assert "You are terse." in prompt and "Hi" in prompt
    assert paced_engine.last_params.max_tokens == 77 and abs(paced_engine.last_params.temperature - 0.3) < 1e-6
    web.find_element("id", "new-chat").click()
    wait_for(web, "document.querySelectorAll('.message').length === 0")
    web.refresh()
    wait_for(web, "document.body.dataset.ready === '1'")
    assert web.execute_script("return document.querySelectorAll('.message').length") == 0
    assert web.find_element("id", "system-prompt").get_attribute("value") == "You are terse."


def test_api_key_is_asked_once_per_tab(web, paced_engine):
    paced_engine.delay_s = 0.0
    paced_engine.script = [Piece("secret answer", 2, 1)]
    with live_server(create_app(paced_engine, "guarded", api_key="sekret", merge_chunks=False)) as srv:
        web.get(srv.url + "/")
        web.execute_script("localStorage.clear(); sessionStorage.clear();")
        web.get(srv.url + "/")
        wait_for(web, "!document.getElementById('key-dialog').hidden", what="the API key dialog")
        web.find_element("id", "api-key").send_keys("wrong")
        web.find_element("css selector", "#key-form button").click()
        wait_for(web, "document.getElementById('key-error').textContent.includes('refused')")
        field = web.find_element("id", "api-key")
        field.clear()
        field.send_keys("sekret")
        web.find_element("css selector", "#key-form button").click()
        wait_for(web, "document.body.dataset.ready === '1'")
        assert "guarded" in web.find_element("id", "server-info").text
        send(web, "Hi")
        wait_reply_done(web)
        assert reply_text(web) == "secret answer"
        web.refresh()  # same tab: the key is still there, nothing is asked
        wait_for(web, "document.body.dataset.ready === '1'")
        assert not web.find_element("id", "key-dialog").is_displayed()
        assert web.execute_script("return sessionStorage.getItem('verispec.apiKey')") == "sekret"
        assert "sekret" not in web.execute_script("return JSON.stringify(localStorage)")


def test_fits_a_phone_screen(web, paced_engine, paced_server):
    paced_engine.delay_s = 0.0
    paced_engine.script = rounds_of("A long answer " * 20 + "\n\n```\n" + "x = 1  # " + "long code " * 30 + "\n```",
                                    [2, 0, 3])
    # device emulation: a headless window cannot be made narrower than 500 px
    web.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
    try:
        open_fresh(web, paced_server.url)
        assert web.execute_script("return window.innerWidth") == 390
        send(web, "Hi from a phone")
        wait_reply_done(web)
        sizes = web.execute_script("const e = document.documentElement; return [e.scrollWidth, e.clientWidth]")
        assert sizes[0] <= sizes[1], f"the page scrolls sideways: {sizes}"
        for element_id in ("prompt", "send", "new-chat", "toggle-settings"):
            box = web.execute_script("const r = document.getElementById(arguments[0]).getBoundingClientRect();"
                                     "return [r.left, r.right, window.innerWidth]", element_id)
            assert 0 <= box[0] and box[1] <= box[2], (element_id, box)
        pre = web.execute_script("const p = document.querySelector('.code-block pre');"
                                 "return [p.scrollWidth > p.clientWidth, getComputedStyle(p).overflowX]")
        assert pre == [True, "auto"]  # long code scrolls inside its block, not the page
    finally:
        web.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


MARKDOWN_FUZZ = r"""
const done = arguments[arguments.length - 1];
import("/static/markdown.js").then((md) => {
  let seed = 20261123;
  const rand = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; };
  const atoms = ["<", ">", "&", '"', "'", "*", "**", "`", "```", "~~~", "[", "]", "(", ")", "](", "#", "# ",
                 "- ", "1. ", "> ", "---", "\n", "\n\n", " ", "a", "b", "javascript:", "https://x.y/", "data:",
                 "<script>", "</script>", "<img src=x onerror=alert(1)>", "_", "&lt;", "[a](https://x.y/)",
                 "[a](javascript:alert(1))", "[b](https://x.y/\"onclick=\"alert(1))"];
  const tags = new Set(["P", "BR", "STRONG", "EM", "CODE", "PRE", "A", "H3", "H4", "H5", "H6", "UL", "OL",
                        "LI", "BLOCKQUOTE", "HR", "SPAN", "DIV", "BUTTON"]);
  const attributes = new Set(["class", "href", "target", "rel", "type"]);
  const problems = [];
  for (let n = 0; n < 3000 && problems.length < 5; n++) {
    let text = "";
    const length = 1 + Math.floor(rand() * 30);
    for (let i = 0; i < length; i++) text += atoms[Math.floor(rand() * atoms.length)];
    const ranges = [];
    for (let at = Math.floor(rand() * 4); at < text.length; ) {
      const end = Math.min(text.length, at + 1 + Math.floor(rand() * 6));
      ranges.push([at, end]);
      at = end + 1 + Math.floor(rand() * 6);
    }
    const root = document.createElement("div");
    root.appendChild(md.renderMarkdown(text, ranges, () => {}));
    for (const el of root.querySelectorAll("*")) {
      if (!tags.has(el.tagName)) problems.push([text, "tag " + el.tagName]);
      for (const attr of el.attributes) if (!attributes.has(attr.name)) problems.push([text, "attribute " + attr.name]);
      if (el.tagName === "A" && !/^https?:\/\/[^\s]+$/.test(el.getAttribute("href"))) problems.push([text, "href"]);
    }
    // nothing invented: the shown text is the source minus markup, in order (code labels aside)
    root.querySelectorAll(".code-head").forEach((e) => e.remove());
    let at = 0;
    for (const ch of root.textContent) {
      at = text.indexOf(ch, at);
      if (at === -1) { problems.push([text, "text not from the source: " + root.textContent]); break; }
      at++;
    }
    // tinting changes no text: the same source without ranges shows the same characters
    const plain = document.createElement("div");
    plain.appendChild(md.renderMarkdown(text, [], () => {}));
    plain.querySelectorAll(".code-head").forEach((e) => e.remove());
    if (plain.textContent !== root.textContent) problems.push([text, "tinting changed the text"]);
  }
  done(problems);
}).catch((error) => done([["import failed", String(error)]]));
"""


def test_markdown_subset_never_turns_text_into_markup(web, paced_server):
    """3,000 random strings of Markdown and HTML fragments: only the subset's own elements and
    attributes appear, links are http(s) only, and every shown character comes from the source."""
    open_fresh(web, paced_server.url)
    web.set_script_timeout(60)
    assert web.execute_async_script(MARKDOWN_FUZZ) == []
