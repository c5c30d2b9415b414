"""Prometheus metrics, in a registry owned by one app (so two apps in a process never mix)."""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Requests are labelled by route, never by raw path, so unknown URLs cannot grow the label set.
KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def endpoint_label(path: str) -> str:
    if path in KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("verispec_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens of finished generations",
                                     registry=self.registry)
        self.generated_tokens = Counter("verispec_generation_tokens", "Tokens generated",
                                        registry=self.registry)
        self.latency = Histogram("verispec_request_latency_seconds",
                                 "Time from request arrival to the response's last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("verispec_time_to_first_token_seconds",
                              "Time from request arrival to the first generated chunk (queueing included)",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.drafted_tokens = Counter("verispec_spec_drafted_tokens", "Draft tokens proposed for verification",
                                      ["method"], registry=self.registry)
        self.accepted_tokens = Counter("verispec_spec_accepted_tokens", "Draft tokens the target accepted",
                                       ["method"], registry=self.registry)
        self.target_passes = Counter("verispec_target_forward_passes", "Target forward passes after prefill",
                                     ["method"], registry=self.registry)
        self.in_flight = Gauge("verispec_generations_in_flight", "Generation requests queued or running",
                               registry=self.registry)
        # the scheduler's view, read from the engine at scrape time (engine.load_stats())
        self.running = Gauge("verispec_num_requests_running", "Sequences in the running batch", registry=self.registry)
        self.waiting = Gauge("verispec_num_requests_waiting", "Sequences waiting for admission (KV blocks or "
                             "--max-num-seqs)", registry=self.registry)
        self.kv_usage = Gauge("verispec_kv_cache_usage_ratio", "Fraction of the paged KV cache's blocks in use",
                              registry=self.registry)
        self.kv_blocks = Gauge("verispec_kv_cache_blocks", "KV cache blocks", ["state"], registry=self.registry)
        self.preemptions = Gauge("verispec_num_preemptions_total", "Sequences preempted (blocks freed, recomputed "
                                 "later) since start", registry=self.registry)
        self.prefix_lookups = Gauge("verispec_prefix_cache_queries_total", "Prompt tokens looked up in the "
                                    "prefix cache since start", registry=self.registry)
        self.prefix_hits = Gauge("verispec_prefix_cache_hits_total", "Prompt tokens the prefix cache supplied "
                                 "since start", registry=self.registry)
        self.prefix_requests = Gauge("verispec_prefix_cache_requests_total", "Admitted sequences by prefix-cache "
                                     "outcome since start", ["outcome"], registry=self.registry)
        self.prefix_blocks = Gauge("verispec_prefix_cache_blocks", "KV blocks registered in the prefix cache: "
                                   "held by running sequences, or idle (kept until their memory is needed)",
                                   ["state"], registry=self.registry)
        self.num_drafts = Gauge("verispec_spec_drafts_per_round", "Mean drafts per sequence chosen for the last "
                                "decode step (adaptive per sequence, or --draft-schedule)", registry=self.registry)
        self.zero_drafts = Gauge("verispec_spec_sequences_drafting_zero", "Decoding sequences given no drafts in "
                                 "the last decode step", registry=self.registry)
        self.draft_choices = Gauge("verispec_spec_draft_choices_total", "Sequence-rounds by the drafts chosen for "
                                   "them, since start", ["drafts"], registry=self.registry)
        self.draft_gate = Gauge("verispec_spec_gate_tokens_per_second", "Measured decode tokens per second per "
                                "sequence by batch size bucket (its smallest size) and round kind; the adaptive "
                                "choice speculates only where speculative rounds are the faster",
                                ["batch", "kind"], registry=self.registry)

        self.numerics = Gauge("verispec_numerics_info", "1 for the numerics the engine runs: exact (a token's result "
                              "does not depend on the batch, speculation or cache) or fast", ["mode"],
                              registry=self.registry)
        self.kv_cache_dtype = Gauge("verispec_kv_cache_dtype_info", "1 for what the KV cache stores: the model's "
                                    "dtype (--kv-cache-dtype auto), fp8, tq4 or tq3", ["dtype"], registry=self.registry)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        endpoint = endpoint_label(path)
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def observe_generation(self, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generated_tokens.inc(num_generated_tokens)

    def observe_stats(self, stats) -> None:
        """Speculation counters from a finished generation's GenerationStats."""
        self.drafted_tokens.labels(method=stats.method).inc(stats.drafted)
        self.accepted_tokens.labels(method=stats.method).inc(stats.accepted)
        self.target_passes.labels(method=stats.method).inc(stats.rounds)

    def observe_engine(self, load: dict) -> None:
        """Engine.load_stats(): running/waiting sequences, KV blocks, preemptions, drafts per round."""
        self.running.set(load["running"])
        self.waiting.set(load["waiting"])
        total = max(load["kv_blocks_total"], 1)
        self.kv_usage.set(load["kv_blocks_used"] / total)
        self.kv_blocks.labels(state="used").set(load["kv_blocks_used"])
        self.kv_blocks.labels(state="total").set(load["kv_blocks_total"])
        self.preemptions.set(load["preemptions"])
        drafts = load.get("drafts")
        if drafts is not None:
            self.num_drafts.set(drafts["mean"])
            self.zero_drafts.set(drafts["zero"])
            for k, count in drafts["histogram"].items():
                self.draft_choices.labels(drafts=str(k)).set(count)
            for batch, rates in (drafts.get("gate") or {}).items():
                for kind in ("speculative", "plain"):
                    if rates[f"{kind}_tok_s"] is not None:
                        self.draft_gate.labels(batch=str(batch), kind=kind).set(rates[f"{kind}_tok_s"])
        prefix = load.get("prefix_cache")
        if prefix is not None:
            self.prefix_lookups.set(prefix["queried_tokens"])
            self.prefix_hits.set(prefix["hit_tokens"])
            self.prefix_requests.labels(outcome="hit").set(prefix["hits"])
            self.prefix_requests.labels(outcome="miss").set(prefix["lookups"] - prefix["hits"])
            self.prefix_blocks.labels(state="held").set(prefix["cached_blocks"] - prefix["idle_blocks"])
            self.prefix_blocks.labels(state="idle").set(prefix["idle_blocks"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


ARRIVED_AT = "verispec_arrived_at"  # request.state key: when the request's headers reached the app
PARSED_AT = "verispec_parsed_at"  # ... when its body was read and validated (its endpoint began)


def note_parsed(request) -> None:
    """An endpoint's start, for the request's first-token log line (server/generation.py)."""
    request.scope.setdefault("state", {})[PARSED_AT] = time.perf_counter()


class MetricsMiddleware:
    """Counts every HTTP request with its final status, errors and auth failures included."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        scope.setdefault("state", {})[ARRIVED_AT] = start  # (a request's first-token log line reads it)
        status = 500  # what the client gets if the app raises before starting a response

        async def send_and_note_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self.metrics.observe_request(scope["path"], status, time.perf_counter() - start)
