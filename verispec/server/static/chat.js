// The verispec chat page: streams /v1/chat/completions and shows which text came from accepted drafts.
//
// Model output is untrusted: it only ever reaches the DOM as text nodes (markdown.js), and the
// page's Content-Security-Policy allows no inline script besides.
import { renderMarkdown, renderPlain } from "./markdown.js";

const STORAGE_KEY = "verispec.chat.v1";      // conversation + settings, kept across reloads
const API_KEY_KEY = "verispec.apiKey";       // sessionStorage: the key lives as long as the tab
const $ = (id) => document.getElementById(id);

let info = null;            // GET /v1/verispec/info
let store = loadStore();    // {settings: {system, temperature, maxTokens}, messages: [...]}
let streaming = null;       // {controller, message, element} while a reply streams
let renderQueued = false;

function loadStore() {
  const fresh = { settings: { system: "", temperature: 0.7, maxTokens: 1024 }, messages: [] };
  try {
    const saved = JSON.parse(localStorage.getItem(STORAGE_KEY) || "null");
    if (saved && Array.isArray(saved.messages)) return { ...fresh, ...saved, settings: { ...fresh.settings, ...saved.settings } };
  } catch (_) { /* a corrupt entry: start over rather than break the page */ }
  return fresh;
}

function saveStore() {
  try { localStorage.setItem(STORAGE_KEY, JSON.stringify(store)); } catch (_) { /* full or disabled */ }
}

// ---- API access, with the --api-key dialog on 401 -------------------------------------------

function authHeaders() {
  const key = sessionStorage.getItem(API_KEY_KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

let keyWaiters = [];
function askForKey(message) {
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("key-dialog").hidden = false;
  $("api-key").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(API_KEY_KEY, key);
  $("key-dialog").hidden = true;
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((resolve) => resolve());
});

// fetch() that asks for the API key when the server answers 401, then tries again.
async function apiFetch(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: { ...(options.headers || {}), ...authHeaders() } });
    if (response.status !== 401) return response;
    const hadKey = Boolean(sessionStorage.getItem(API_KEY_KEY));
    sessionStorage.removeItem(API_KEY_KEY);
    await askForKey(hadKey ? "That key was refused; try again." : "");
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

// ---- header -----------------------------------------------------------------------------------

async function loadInfo() {
  try {
    const response = await apiFetch("/v1/verispec/info");
    if (!response.ok) throw new Error(await errorMessage(response));
    info = await response.json();
  } catch (error) {
    $("server-info").textContent = "server unreachable: " + error.message;
    return;
  }
  const method = info.method === "ar" ? "plain decoding"
    : `${info.method_label} · ${info.num_drafts} draft${info.num_drafts === 1 ? "" : "s"}/round`;
  const device = info.device_name ? `${info.device} (${info.device_name})` : info.device;
  $("server-info").textContent = "";
  for (const [cls, text] of [["model", info.model], ["method", method], ["device", device]]) {
    const span = document.createElement("span");
    span.className = cls;
    span.textContent = text;
    $("server-info").appendChild(span);
  }
  document.title = `${info.model} · verispec`;
  document.body.dataset.ready = "1";
}

// ---- messages ---------------------------------------------------------------------------------

// Adds [start, end) to a sorted list of disjoint ranges, merging with the last when they touch.
function addRange(ranges, start, end) {
  if (end <= start) return;
  const last = ranges[ranges.length - 1];
  if (last && last[1] >= start) last[1] = Math.max(last[1], end);
  else ranges.push([start, end]);
}

function copyText(text, button) {
  const done = (label) => { button.textContent = label; setTimeout(() => { button.textContent = "Copy"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(() => done("Copied"), () => fallbackCopy(text, done));
  } else {
    fallbackCopy(text, done);  // plain http on a LAN address is not a secure context
  }
}

function fallbackCopy(text, done) {
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.appendChild(area);
  area.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch (_) { ok = false; }
  area.remove();
  done(ok ? "Copied" : "Copy failed");
}

function formatRate(value, digits = 1) {
  return Number.isFinite(value) ? value.toFixed(digits) : "–";
}

// The numbers of one reply: live while it streams, exact from the server's stats at the end.
function describeSpeculation(spec, live) {
  if (!spec || !spec.tokens) return "";
  const parts = [`${spec.tokens} tokens`];
  const final = spec.stats;
  const tokPerS = final && final.decode_ms > 0 ? (spec.tokens - 1) / (final.decode_ms / 1000) : spec.tokPerS;
  if (tokPerS) parts.push(`${formatRate(tokPerS)} tok/s`);
  const speculating = final ? final.method !== "ar" : info && info.method !== "ar";
  if (speculating && spec.rounds > 0) {
    let acceptance;
    if (final && final.drafted > 0) acceptance = `${formatRate((100 * final.accepted) / final.drafted, 0)}%`;
    else if (info && info.num_drafts > 0) {
      // live: drafts proposed per round are at most num_drafts, so this is an estimate until the end
      acceptance = `≈${formatRate((100 * spec.drafted) / (spec.rounds * info.num_drafts), 0)}%`;
    }
    if (acceptance) parts.push(`acceptance ${acceptance}`);
    parts.push(`${formatRate((spec.tokens - 1) / spec.rounds, 2)} tok/round`);
    parts.push(`${spec.drafted} of ${spec.tokens} tokens drafted`);
  }
  if (live) parts.unshift("generating");
  return parts.join(" · ");
}

function messageElement(message) {
  const element = document.createElement("article");
  element.className = "message " + message.role;
  element.dataset.role = message.role;
  if (message.role === "assistant") {
    const reasoning = document.createElement("details");
    reasoning.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const body = document.createElement("div");
    body.className = "reasoning-text";
    reasoning.append(summary, body);
    reasoning.open = true;
    const content = document.createElement("div");
    content.className = "content";
    const meta = document.createElement("div");
    meta.className = "meta";
    element.append(reasoning, content, meta);
  } else {
    const content = document.createElement("div");
    content.className = "content plain";
    element.appendChild(content);
  }
  fillMessage(element, message);
  return element;
}

function fillMessage(element, message) {
  const content = element.querySelector(".content");
  if (message.role !== "assistant") {
    content.textContent = message.content;
    return;
  }
  element.dataset.state = message.state || "done";
  element.dataset.events = String(message.events || 0);
  const reasoning = element.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  const reasoningText = reasoning.querySelector(".reasoning-text");
  reasoningText.replaceChildren(renderPlain(message.reasoning || "", message.reasoningDrafted));
  content.replaceChildren(renderMarkdown(message.content || "", message.contentDrafted, copyText));
  const meta = element.querySelector(".meta");
  const notes = [];
  if (message.state === "stopped") notes.push("stopped");
  if (message.finishReason === "length") notes.push("hit max tokens");
  // while streaming the live numbers sit in the bar above the composer (visible however far you scroll)
  const stats = message.state === "streaming" ? "" : describeSpeculation(message.spec, false);
  if (stats) notes.push(stats);
  meta.textContent = notes.join(" · ");
  if (message.error) {
    const error = document.createElement("div");
    error.className = "error-text";
    error.textContent = message.error;
    content.appendChild(error);
  }
}

function renderAll() {
  const list = $("messages");
  list.replaceChildren(...store.messages.map(messageElement));
  if (!store.messages.length) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "Start a conversation below.";
    list.appendChild(empty);
  }
  list.scrollTop = list.scrollHeight;
}

// Redraws the streaming reply at most once per frame, however fast events arrive.
function queueStreamingRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    if (!streaming) return;
    const list = $("messages");
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
    fillMessage(streaming.element, streaming.message);
    $("live-stats").textContent = describeSpeculation(streaming.message.spec, true);
    if (atBottom) list.scrollTop = list.scrollHeight;
    saveStore();  // a reload mid-reply keeps what has arrived so far
  });
}

// ---- one streamed reply ------------------------------------------------------------------------

// Applies one SSE payload to the reply. The `verispec` field counts the tokens since the last one
// and how many were accepted drafts; drafts come first in a round, so the first drafted/tokens
// share of this event's characters is tinted (exact in count, proportional within the event).
function applyEvent(message, payload) {
  if (payload.error) {
    message.error = payload.error.message || "the server reported an error";
    return;
  }
  const choice = payload.choices && payload.choices[0];
  if (!choice) return;  // the usage chunk
  message.events = (message.events || 0) + 1;
  const delta = choice.delta || {};
  const reasoning = delta.reasoning_content || "";
  const content = delta.content || "";
  const spec = choice.verispec;
  let drafted = 0;
  if (spec && spec.tokens > 0) {
    drafted = Math.round(((reasoning.length + content.length) * spec.drafted_tokens) / spec.tokens);
    const live = message.spec;
    const now = performance.now();
    if (!live.tokens) live.firstAt = now;
    live.tokens += spec.tokens;
    live.drafted += spec.drafted_tokens;
    live.rounds += spec.rounds;
    if (live.tokens > 1 && now > live.firstAt) live.tokPerS = ((live.tokens - 1) * 1000) / (now - live.firstAt);
    if (spec.stats) live.stats = spec.stats;
  }
  const draftedReasoning = Math.min(drafted, reasoning.length);
  addRange(message.reasoningDrafted, message.reasoning.length, message.reasoning.length + draftedReasoning);
  message.reasoning += reasoning;
  addRange(message.contentDrafted, message.content.length, message.content.length + drafted - draftedReasoning);
  message.content += content;
  if (choice.finish_reason) message.finishReason = choice.finish_reason;
}

async function readEvents(response, onPayload) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let boundary;
    while ((boundary = buffer.indexOf("\n\n")) !== -1) {
      const event = buffer.slice(0, boundary);
      buffer = buffer.slice(boundary + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onPayload(JSON.parse(data));
      }
    }
  }
}

function requestMessages() {
  const messages = [];
  if (store.settings.system.trim()) messages.push({ role: "system", content: store.settings.system });
  for (const m of store.messages) {
    if (m.role === "assistant" && !m.content) continue;  // a reply that failed or was stopped at once
    messages.push({ role: m.role, content: m.content });
  }
  return messages;
}

async function send(text) {
  if (streaming || !text.trim()) return;
  if (!info) await loadInfo();
  store.messages.push({ role: "user", content: text });
  const body = {
    model: info ? info.model : undefined,
    messages: requestMessages(),
    stream: true,
  };
  // an empty field means "the server's default", not 0
  if (String(store.settings.temperature).trim() !== "") body.temperature = Number(store.settings.temperature);
  if (Number(store.settings.maxTokens) > 0) body.max_tokens = Number(store.settings.maxTokens);
  const message = {
    role: "assistant", content: "", reasoning: "", contentDrafted: [], reasoningDrafted: [],
    state: "streaming", events: 0, spec: { tokens: 0, drafted: 0, rounds: 0 },
  };
  store.messages.push(message);
  saveStore();
  renderAll();
  const element = $("messages").lastElementChild;
  streaming = { controller: new AbortController(), message, element };
  setStreamingControls(true);
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: streaming.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (payload) => { applyEvent(message, payload); queueStreamingRender(); });
    message.state = "done";
  } catch (error) {
    if (error.name === "AbortError") message.state = "stopped";
    else { message.state = "done"; message.error = "Error: " + error.message; }
  }
  delete message.spec.firstAt;  // a performance.now() time means nothing after a reload
  streaming = null;
  setStreamingControls(false);
  fillMessage(element, message);
  saveStore();
}

function setStreamingControls(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("live-stats").hidden = !on;
  $("live-stats").textContent = on ? "waiting for the first token…" : "";
}

// Aborting the fetch closes the connection; the server notices and cancels the generation.
function stop() {
  if (streaming) streaming.controller.abort();
}

// ---- controls ---------------------------------------------------------------------------------

function bindSettings() {
  const fields = [["system-prompt", "system"], ["temperature", "temperature"], ["max-tokens", "maxTokens"]];
  for (const [id, key] of fields) {
    $(id).value = store.settings[key];
    $(id).addEventListener("change", () => { store.settings[key] = $(id).value; saveStore(); });
  }
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });
}

function bindComposer() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || streaming) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (event) => { if (event.key === "Escape" && streaming) stop(); });
  $("new-chat").addEventListener("click", () => {
    stop();
    store.messages = [];
    saveStore();
    renderAll();
    $("prompt").focus();
  });
}

// A reply that was streaming when the page went away is only as complete as what was saved.
for (const m of store.messages) if (m.state === "streaming") m.state = "stopped";
bindSettings();
bindComposer();
renderAll();
loadInfo();
