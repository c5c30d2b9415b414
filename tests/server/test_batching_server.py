"""The server over the batched engine: concurrent clients are served together, and /metrics
shows the scheduler (running / waiting / KV blocks / preemptions / drafts per round)."""
from __future__ import annotations

import threading

from verispec.sampling.params import SamplingParams


def test_concurrent_requests_run_in_one_batch_and_match_alone(engine, client):
    prompts = [f"def function_{i}(x):" for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [engine.generate_all(engine.tokenizer.encode(p), params).text for p in prompts]
    sizes = []
    real_round = engine._round

    def recording_round(seqs, k):
        sizes.append(len(seqs))
        return real_round(seqs, k)

    engine._round = recording_round
    try:
        got = [None] * len(prompts)

        def ask(i):
            r = client.completions.create(model=client.models.list().data[0].id, prompt=prompts[i], max_tokens=12,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            got[i] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        del engine._round
    assert got == alone
    assert max(sizes) > 1  # some steps decoded several clients' sequences together
    assert engine.blocks.num_used == 0


def test_metrics_show_the_scheduler(http, engine):
    text = http.get("/metrics").text
    for name in ("verispec_num_requests_running", "verispec_num_requests_waiting", "verispec_kv_cache_usage_ratio",
                 "verispec_num_preemptions_total", "verispec_spec_drafts_per_round",
                 "verispec_spec_sequences_drafting_zero"):
        assert name in text
    assert f'verispec_kv_cache_blocks{{state="total"}} {float(engine.blocks.num_usable)}' in text


def test_prefix_cache_reports_cached_tokens(engine, client, http):
    """A repeated long prompt reuses its cached blocks: usage says how many prompt tokens came from the
    cache (plain and streamed), /metrics counts them, and the text is what a cold run gives."""
    model = client.models.list().data[0].id
    prompt = "def prefix_cached_function(alpha, beta, gamma):\n    return alpha * beta - gamma\n" * 3
    num_prompt = len(engine.tokenizer.encode(prompt))
    block = engine.config.block_size
    first = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.0)
    expected = (num_prompt - 1) // block * block  # whole blocks, one token short of the prompt
    assert expected > 0 and second.usage.prompt_tokens_details.cached_tokens == expected
    assert second.choices[0].text == first.choices[0].text
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=4, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    list(stream)
    again = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=4, temperature=0.0, stream=True,
                                           stream_options={"include_usage": True})
    usage = [c.usage for c in again if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens >= expected
    text = http.get("/metrics").text
    hits = [line for line in text.splitlines() if line.startswith("verispec_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 2 * expected
    assert 'verispec_prefix_cache_requests_total{outcome="hit"}' in text
    assert 'verispec_prefix_cache_blocks{state="idle"}' in text
