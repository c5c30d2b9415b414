"""The prefix cache: output with a cache hit == output without it, token for token (float64, CPU),
for every architecture family and proposer, hits ending mid-prompt-block and on a block edge, a
repeated prompt, two requests sharing blocks while both run, and eviction under a tiny budget;
beside a drafter, requests that never draft keep no drafter features and share blocks without them.

The oracle is the same model in an engine with the prefix cache off (`prefix_cache=False`), which
the batch-identity tests tie to the sequence run alone.
"""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
import torch

from verispec.cache.paged import BlockAllocator
from verispec.cache.prefix import chain_hashes
from tools.tiny import (build_tiny_gemma3, build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5,
                                random_mtp_head, write_mtp_sidecar, write_random_eagle3)
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3
from verispec.spec.gemma4_assistant import AssistantProposer, load_assistant
from verispec.spec.mtp import MtpProposer, load_mtp_head

SHAPE = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
BLOCK = 16
NEW = 20


# ---- the allocator and the hashes -----------------------------------------------------------------
def test_chained_hashes_name_a_block_by_everything_before_it():
    a = chain_hashes(list(range(40)), 16)
    assert len(a) == 2  # the partial third block has none
    assert chain_hashes(list(range(32)), 16) == a
    b = chain_hashes([99] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]  # the same second block after a different first one
    assert chain_hashes(list(range(16, 32)), 16, parent=a[0]) == a[1:]


def test_allocator_shares_keeps_and_evicts_least_recent_first():
    alloc = BlockAllocator(num_blocks=5, block_size=4)  # 4 usable
    evicted = []
    alloc.on_evict = lambda block, h: evicted.append((block, h))
    first = alloc.allocate(2)
    assert alloc.register(first[0], b"h0") and alloc.register(first[1], b"h1")
    assert not alloc.register(first[1], b"other")  # one name per block
    alloc.share(first[0])
    assert alloc.refs(first[0]) == 2
    alloc.free(first)  # the first block is still held by the sharer
    assert alloc.num_free == 3 and alloc.num_cached_idle == 1 and alloc.num_cached == 2
    alloc.free([first[0]])
    assert alloc.num_free == 4 and alloc.num_cached_idle == 2
    # unregistered free blocks go first; then the least recently released cached one (the tail)
    fresh = alloc.allocate(2)
    assert set(fresh).isdisjoint(first) and not evicted
    assert alloc.allocate(1) == [first[1]] and evicted == [(first[1], b"h1")]
    assert alloc.lookup(b"h1") is None and alloc.lookup(b"h0") == first[0]
    alloc.share(first[0])  # a hit on an idle cached block takes it off the eviction list
    assert alloc.num_free == 0
    with pytest.raises(MemoryError):
        alloc.allocate(1)
    with pytest.raises(RuntimeError):
        alloc.free(fresh + fresh)


def test_allocator_renames_a_hash_without_evicting():
    """A registered hash moved to another block: the block that had it is unregistered, free at once
    when nobody holds it, else when its last holder lets it go; no eviction is counted."""
    alloc = BlockAllocator(num_blocks=6, block_size=4)  # 5 usable
    evicted = []
    alloc.on_evict = lambda block, h: evicted.append(block)
    idle, held, new_idle, new_held = alloc.allocate(4)
    assert alloc.register(idle, b"idle") and alloc.register(held, b"held")
    alloc.free([idle])
    alloc.rename(b"idle", new_idle)
    alloc.rename(b"held", new_held)
    assert alloc.lookup(b"idle") == new_idle and alloc.lookup(b"held") == new_held
    assert alloc.hash_of(idle) is None and alloc.hash_of(held) is None and alloc.num_cached == 2
    assert alloc.num_free == 2 and alloc.num_cached_idle == 0  # the idle one is free, not cached
    alloc.free([held, new_idle, new_held])
    assert alloc.num_free == 5 and alloc.num_cached_idle == 2 and not evicted


# ---- engine identity -------------------------------------------------------------------------------
def prompt_set(vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """A 37-token shared prefix (2 full blocks + 5) and prompts over it: a hit ending mid-prompt
    after 2 blocks, one of exactly 3 blocks sharing 2, one sharing exactly 2 blocks, a repeat of
    the first (its hit capped one token short), one sharing nothing, and a repeat of the 3-block
    prompt (a hit of the whole prompt: its last block copied and its last token recomputed where
    the cache allows that, else capped a block short)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    base = ids(37)
    a = base + ids(6)
    aligned = base + ids(3 * BLOCK - 37)
    return base, [a, aligned, base[:2 * BLOCK] + ids(4), list(a), ids(21), list(aligned)]


def expected_hits(prompts: list[list[int]], whole_prompt_hits: bool) -> list[int]:
    repeat_aligned = len(prompts[1]) - 1 if whole_prompt_hits else len(prompts[1]) - BLOCK
    return [0, 2 * BLOCK, 2 * BLOCK, (len(prompts[0]) - 1) // BLOCK * BLOCK, 0, repeat_aligned]


PARAMS = [
    SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=NEW, temperature=0.8, top_k=30, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
    SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
]


def with_proposer(engine: Engine, proposer, k: int, prefix_cache: bool = True) -> Engine:
    config = replace(engine.config, draft_schedule=f"1:{k}" if proposer is not None else None,
                     prefix_cache=prefix_cache)
    return Engine(engine.model, engine.tokenizer, config, engine.model_dir, proposer=proposer,
                  num_drafts=k if proposer is not None else 0)


def check_hits_change_nothing(base: Engine, make_proposer, k: int, label: str, seed: int = 5) -> None:
    """Requests one after another in a cached engine == the same requests with the cache off."""
    _, prompts = prompt_set(base.model.vocab_size, seed)
    cold = with_proposer(base, make_proposer(), k, prefix_cache=False)
    warm = with_proposer(base, make_proposer(), k)
    drafted = {id(cold): [], id(warm): []}
    for engine in (cold, warm):  # every round's drafts, request by request (they run one at a time)
        def recording(seqs, counts, engine=engine, real=engine.runner.propose):
            drafts = real(seqs, counts)
            drafted[id(engine)].append([d.token_ids for d in drafts])
            return drafts
        engine.runner.propose = recording
    want, got = [], []
    for p, q in zip(prompts, PARAMS):
        want.append(cold.generate_all(p, q))
        got.append(warm.generate_all(p, q))
    # a hit never changes what is drafted (the drafter saw the same state as after a full prefill)
    assert drafted[id(warm)] == drafted[id(cold)], f"{label}: drafts changed by a prefix hit"
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.token_ids == w.token_ids, f"{label}: request {i} changed by its prefix hit"
        assert (g.stats.drafted, g.stats.accepted) == (w.stats.drafted, w.stats.accepted), f"{label}: request {i}"
        if PARAMS[i].logprobs:
            assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-9)
    hits = expected_hits(prompts, not warm.prefix.hybrid and not warm.prefix.keep_features)  # every request drafts
    assert [g.stats.cached_tokens for g in got] == hits, label
    assert all(w.stats.cached_tokens == 0 for w in want)
    assert warm.blocks.num_used == 0 and warm.blocks.num_cached > 0, f"{label}: blocks leaked"
    stats = warm.prefix.stats
    assert stats.hits == 4 and stats.hit_tokens == sum(hits)


def eagle3_for(engine: Engine, directory):
    drafter = write_random_eagle3(directory, json.loads((engine.model_dir / "config.json").read_text()), seed=3)
    return lambda: Eagle3Proposer(load_eagle3(drafter, engine.model), engine.model.vocab_size)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_dense_families_plain_and_eagle3(tiny_models, family, tmp_path):
    d = tiny_models.get(f"prefix-{family}", family, **SHAPE)
    engine = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK)
    check_hits_change_nothing(engine, lambda: None, 0, f"{family} plain")
    check_hits_change_nothing(engine, eagle3_for(engine, tmp_path / "eagle3"), 3, f"{family} eagle3")


def test_qwen3_5_hybrid_plain_and_mtp(tmp_path, tokenizer_dir):
    """Recurrent state comes back from the snapshot at the hit's block edge."""
    d = tmp_path / "qwen3_5"
    build_tiny_qwen3_5(d, seed=31, tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(d / "mtp.safetensors", random_mtp_head(json.loads((d / "config.json").read_text()), seed=4))
    engine = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK)
    check_hits_change_nothing(engine, lambda: None, 0, "qwen3_5 plain")
    mtp = lambda: MtpProposer(load_mtp_head(d, engine.model), num_real_tokens=engine.num_real_tokens)  # noqa: E731
    check_hits_change_nothing(engine, mtp, 2, "qwen3_5 mtp")


def test_gemma3_sliding_window_with_eagle3(tmp_path, tokenizer_dir):
    # a window shorter than the shared prefix: the hit's K/V must be read through the window as before
    build_tiny_gemma3(tmp_path / "gemma3", seed=51, tokenizer_dir=tokenizer_dir, sliding_window=12)
    engine = load_engine(str(tmp_path / "gemma3"), dtype="float64", device="cpu", block_size=BLOCK)
    check_hits_change_nothing(engine, lambda: None, 0, "gemma3 plain")
    check_hits_change_nothing(engine, eagle3_for(engine, tmp_path / "eagle3"), 2, "gemma3 eagle3")


@pytest.mark.parametrize("moe", [False, True])
def test_gemma4_with_assistant(tmp_path, tokenizer_dir, moe):
    build_tiny_gemma4(tmp_path / "target", moe=moe, seed=41, tokenizer_dir=tokenizer_dir)
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    build_tiny_gemma4_assistant(tmp_path / "assistant", config, seed=42)
    engine = load_engine(str(tmp_path / "target"), dtype="float64", device="cpu", block_size=BLOCK)
    check_hits_change_nothing(engine, lambda: None, 0, "gemma4 plain")
    assistant = lambda: AssistantProposer(load_assistant(tmp_path / "assistant", engine.model),  # noqa: E731
                                          engine.model, engine.num_real_tokens)
    check_hits_change_nothing(engine, assistant, 2, "gemma4 assistant")


# ---- sharing while running, and eviction ---------------------------------------------------------
def test_two_running_requests_share_blocks(tiny_models, tmp_path):
    """B arrives while A decodes and takes A's prompt blocks (each held twice); both outputs equal
    the cache-off ones, with EAGLE3 drafting for both (its boundary row stays private)."""
    d = tiny_models.get("prefix-qwen3", "qwen3", **SHAPE)
    base = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK)
    make = eagle3_for(base, tmp_path / "eagle3")
    _, prompts = prompt_set(base.model.vocab_size, 9)
    a, b = prompts[0], prompts[1]
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    cold = with_proposer(base, make(), 2, prefix_cache=False)
    want_a, want_b = cold.generate_all(a, long), cold.generate_all(b, PARAMS[2])

    warm = with_proposer(base, make(), 2)
    got: dict[str, list] = {"a": [], "b": []}
    shared = []
    done = threading.Semaphore(0)

    def sink_for(name):
        def sink(item):
            got[name].append(item)
            if name == "a" and len(got["a"]) == 2:
                warm.submit(b, PARAMS[2], sink_for("b"))
            if name == "b" and len(got["b"]) == 1:
                shared.append(max(warm.blocks.refs(blk) for blk in range(1, warm.blocks.num_blocks)))
            if isinstance(item, BaseException) or item.finish_reason is not None:
                done.release()
        return sink

    warm.submit(a, long, sink_for("a"))
    assert done.acquire(timeout=120) and done.acquire(timeout=120)
    assert not any(isinstance(c, BaseException) for c in got["a"] + got["b"])
    assert [t for c in got["a"] for t in c.token_ids] == want_a.token_ids
    assert [t for c in got["b"] for t in c.token_ids] == want_b.token_ids
    assert got["b"][-1].stats.cached_tokens == 2 * BLOCK
    assert shared and shared[0] == 2  # A's first blocks were held by both
    assert warm.blocks.num_used == 0


def test_eviction_under_a_tiny_budget_recomputes(tiny_models):
    """A cache of ~6 sequences' worth of blocks, many distinct prompts, then the first again: its
    blocks were evicted (LRU), it is recomputed, and every output equals the cache-off one."""
    d = tiny_models.get("prefix-qwen3", "qwen3", **SHAPE)
    roomy = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK, prefix_cache=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, roomy.model.vocab_size, (40,), generator=g).tolist() for _ in range(8)]
    prompts += [prompts[0], prompts[7]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [roomy.generate_all(p, params).token_ids for p in prompts]
    per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 16 * 8  # K+V, float64, head dim 16
    tight = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK, max_model_len=80,
                        kv_cache_gb=(16 * BLOCK + 8) * per_token / 2**30)
    assert tight.blocks.num_usable <= 16
    results = [tight.generate_all(p, params) for p in prompts]
    assert [r.token_ids for r in results] == want
    assert tight.blocks.num_evictions > 0
    assert results[-2].stats.cached_tokens == 0  # the first prompt's blocks were evicted long ago
    assert results[-1].stats.cached_tokens == 2 * BLOCK  # the last one's are still there
    # and a batch of all of them at once, preempting under the same budget, loses nothing either
    together = tight.generate_batch(prompts, params)
    assert [r.token_ids for r in together] == want
    assert tight.blocks.num_used == 0


def test_prefix_cache_off(tiny_models):
    d = tiny_models.get("prefix-qwen3", "qwen3", **SHAPE)
    engine = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK, prefix_cache=False)
    ids = list(range(3, 60))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate_all(ids, params)
    assert engine.generate_all(ids, params).stats.cached_tokens == 0
    assert engine.prefix is None and engine.blocks.num_cached == 0


def test_shared_prefixes_under_load_with_cancels_leak_nothing(tiny_models):
    """Twelve requests over three shared prefixes at once, a tight budget (preemption and eviction),
    every third one cancelled mid-way: the rest equal their cache-off outputs, and afterwards no
    block is held or referenced."""
    d = tiny_models.get("prefix-qwen3", "qwen3", **SHAPE)
    cold = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK, prefix_cache=False)
    g = torch.Generator().manual_seed(21)
    vocab = cold.model.vocab_size
    bases = [torch.randint(3, vocab, (36,), generator=g).tolist() for _ in range(3)]
    prompts = [bases[i % 3] + torch.randint(3, vocab, (5 + i,), generator=g).tolist() for i in range(12)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [cold.generate_all(p, params).token_ids for p in prompts]
    per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 16 * 8
    warm = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK, max_model_len=80,
                       kv_cache_gb=(14 * BLOCK + 8) * per_token / 2**30, prefill_step_size=16)
    got: list[list] = [[] for _ in prompts]
    cancels = [threading.Event() for _ in prompts]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(item):
            got[i].append(item)
            if i % 3 == 2 and len(got[i]) == 2:
                cancels[i].set()
            if isinstance(item, BaseException) or item.finish_reason is not None:
                done.release()
        return sink

    for i, p in enumerate(prompts):
        warm.submit(p, params, sink_for(i), cancels[i])
    for _ in prompts:
        assert done.acquire(timeout=120)
    for i, chunks in enumerate(got):
        assert not any(isinstance(c, BaseException) for c in chunks), chunks[-1]
        if i % 3 != 2:
            assert [t for c in chunks for t in c.token_ids] == want[i], f"request {i}"
    assert warm.blocks.num_used == 0
    assert all(warm.blocks.refs(b) == 0 for b in range(warm.blocks.num_blocks))
    assert warm.prefix.stats.hits > 0 and warm.scheduler.num_preemptions > 0


def test_requests_arriving_together_compute_a_common_prefix_once(tiny_models, tmp_path):
    """Four requests with one 50-token prefix submitted at once (and n=2 of one prompt): the first
    computes the prefix, the others wait for its blocks and hit them; outputs equal the cache-off ones."""
    d = tiny_models.get("prefix-qwen3", "qwen3", **SHAPE)
    base = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK, prefill_step_size=16)
    make = eagle3_for(base, tmp_path / "eagle3")
    g = torch.Generator().manual_seed(8)
    shared = torch.randint(3, base.model.vocab_size, (50,), generator=g).tolist()
    prompts = [shared + torch.randint(3, base.model.vocab_size, (3 + i,), generator=g).tolist() for i in range(3)]
    prompts.append(list(prompts[0]))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    cold = with_proposer(base, make(), 2, prefix_cache=False)
    want = [cold.generate_all(p, params).token_ids for p in prompts]
    warm = with_proposer(base, make(), 2)
    results = warm.generate_batch(prompts, params)
    assert [r.token_ids for r in results] == want
    cached = [r.stats.cached_tokens for r in results]
    assert cached[0] == 0 and all(c >= 3 * BLOCK for c in cached[1:]), cached
    assert warm.blocks.num_used == 0


def test_whole_prompt_hit_copies_its_last_block_or_stops_a_block_short_without_room():
    """Admission of a prompt cached to its last token: with a free block, the last block becomes a
    private copy (on_copy called) and only the last token is left to compute; with none free (all
    held), the hit stops a block short instead, sharing nothing it cannot back."""
    from types import SimpleNamespace

    from verispec.cache.paged import BlockAllocator
    from verispec.cache.prefix import PrefixCache
    from verispec.engine.scheduler import CopyBlock, Scheduler
    from verispec.engine.sequence import Sequence

    prompt = list(range(100, 100 + 3 * BLOCK))

    def setup(num_blocks: int):
        blocks = BlockAllocator(num_blocks, BLOCK)
        prefix = PrefixCache(blocks, SimpleNamespace(recurrent_layers=[]), [], keep_features=False)
        scheduler = Scheduler(blocks, None, 4, 256, 256, prefix=prefix)
        seq = lambda: Sequence(prompt, SamplingParams(max_tokens=4), 4, SimpleNamespace(history=[], token_ids=[]),  # noqa: E731
                               None, "ar", lambda chunk: None, block_size=BLOCK)
        earlier = seq()
        cached = blocks.allocate(3)  # an earlier request computed the prompt and finished
        for block, block_hash in zip(cached, earlier.full_block_hashes(3)):
            blocks.register(block, block_hash)
        blocks.free(cached)
        return blocks, scheduler, cached, seq()

    def copies(scheduler: Scheduler) -> list[tuple[int, int]]:
        return [(op.src, op.dst) for op in scheduler.take_cache_ops() if isinstance(op, CopyBlock)]

    blocks, scheduler, cached, seq = setup(num_blocks=6)  # 5 usable: 3 cached + 2 free
    scheduler._take_prefix(seq)
    assert seq.num_cached == 3 * BLOCK - 1 and seq.prefix_hit.num_tokens == 3 * BLOCK - 1
    assert seq.block_table[:2] == cached[:2] and seq.block_table[2] not in cached
    assert copies(scheduler) == [(cached[2], seq.block_table[2])]
    assert blocks.refs(cached[2]) == 0 and blocks.num_cached_idle == 1  # the original stays cached

    blocks, scheduler, cached, seq = setup(num_blocks=4)  # 3 usable, all of them the cached prompt
    scheduler._take_prefix(seq)
    assert seq.num_cached == 2 * BLOCK and seq.block_table == cached[:2] and copies(scheduler) == []
    assert blocks.refs(cached[2]) == 0 and blocks.num_free == 1  # the last block given back, still cached


# ---- sequences that never draft (started where the draft gate had speculation shut) ------------------
def feature_keeping_cache(num_blocks: int = 16):
    """A prefix cache beside a drafter that keeps features, and its scheduler; a factory of sequences."""
    from types import SimpleNamespace

    from verispec.cache.prefix import PrefixCache
    from verispec.engine.scheduler import Scheduler
    from verispec.engine.sequence import Sequence

    blocks = BlockAllocator(num_blocks, BLOCK)
    prefix = PrefixCache(blocks, SimpleNamespace(recurrent_layers=[]), [], keep_features=True)
    scheduler = Scheduler(blocks, None, 4, 256, 256, prefix=prefix)

    def seq(prompt: list[int], drafting: bool = False, plain_only: bool = False) -> Sequence:
        s = Sequence(prompt, SamplingParams(max_tokens=4), 4, SimpleNamespace(history=[], token_ids=[]), None, "ar",
                     lambda chunk: None, block_size=BLOCK)
        s.drafting, s.plain_only = drafting, plain_only
        return s

    return blocks, prefix, scheduler, seq


def commit_prompt(blocks: BlockAllocator, prefix, seq) -> list[int]:
    """seq's whole prompt computed in one pass and committed; returns the drafter features asked for
    (pass rows), its blocks then given back (they stay cached)."""
    asked = []
    seq.block_table = blocks.allocate(blocks.blocks_for(len(seq.prompt_ids)))
    seq.num_cached = len(seq.prompt_ids)
    prefix.on_commit(seq, 0, lambda i: asked.append(i) or f"features at {i}")
    blocks.free(seq.block_table)
    return asked


def test_a_sequence_that_never_drafts_keeps_no_features_and_hits_blocks_without_them():
    """Beside a drafter that keeps features: a sequence that does not draft registers its full
    blocks without asking for any; one that never will (plain_only) hits them, its last block shared
    (nothing of a drafter's is rewritten there); a drafting one cannot resume from them. Its own
    blocks, with features, take their names, so the next drafting sequence hits those."""
    from verispec.engine.scheduler import CopyBlock

    blocks, prefix, scheduler, seq = feature_keeping_cache()
    prompt = list(range(100, 100 + 3 * BLOCK + 5))
    plain = seq(prompt)
    assert commit_prompt(blocks, prefix, plain) == [] and blocks.num_cached == 3
    featureless = plain.block_table[:3]

    reader = seq(prompt + [7], plain_only=True)
    scheduler._take_prefix(reader)
    assert reader.num_cached == 3 * BLOCK and reader.block_table == featureless
    assert reader.prefix_hit.features is None and scheduler.take_cache_ops() == []
    scheduler.release(reader)

    drafting = seq(prompt + [8], drafting=True)
    scheduler._take_prefix(drafting)
    assert drafting.prefix_hit is None and drafting.block_table == []
    assert commit_prompt(blocks, prefix, drafting) == [BLOCK - 1, 2 * BLOCK - 1, 3 * BLOCK - 1]
    assert [blocks.lookup(h) for h in drafting.full_block_hashes(3)] == drafting.block_table[:3]
    assert all(blocks.hash_of(b) is None for b in featureless)  # free again, nothing evicted
    assert blocks.num_cached == 3 and blocks.num_evictions == 0

    later = seq(prompt + [9], drafting=True)
    scheduler._take_prefix(later)
    assert later.num_cached == 3 * BLOCK and later.prefix_hit.features == f"features at {3 * BLOCK - 1}"
    [copy] = [op for op in scheduler.take_cache_ops() if isinstance(op, CopyBlock)]
    assert copy.src == drafting.block_table[2] and later.block_table[:2] == drafting.block_table[:2]


def test_a_drafting_hit_backs_off_to_the_last_block_with_features():
    """A prefix whose first block a drafting sequence registered and the rest one that did not draft:
    a drafting sequence resumes after the first block (its last block a private copy), a plain_only
    one after all three, and the prompt cached to its last token hits whole for it."""
    blocks, prefix, scheduler, seq = feature_keeping_cache()
    prompt = list(range(200, 200 + 3 * BLOCK))
    assert commit_prompt(blocks, prefix, seq(prompt[:BLOCK + 3], drafting=True)) == [BLOCK - 1]
    assert commit_prompt(blocks, prefix, seq(prompt)) == [] and blocks.num_cached == 3

    drafting = seq(prompt + [5], drafting=True)
    scheduler._take_prefix(drafting)
    assert drafting.num_cached == BLOCK and drafting.prefix_hit.features == f"features at {BLOCK - 1}"
    scheduler.release(drafting)
    plain = seq(prompt + [5], plain_only=True)
    scheduler._take_prefix(plain)
    assert plain.num_cached == 3 * BLOCK
    scheduler.release(plain)
    whole = seq(list(prompt), plain_only=True)
    scheduler._take_prefix(whole)
    assert whole.num_cached == 3 * BLOCK - 1  # only the last token is computed, in a copy of the last block


def shut_gate():
    """A draft gate that measured plain steps faster than speculation for one sequence."""
    from verispec.engine import draft_gate

    gate = draft_gate.ThroughputGate()
    for _ in range(draft_gate.MIN_SPEC):
        gate.record(1, True, tokens=1, seconds=1.0)
    assert not gate.allows(1)  # the plain trial
    gate.record(1, False, tokens=1, seconds=0.01, steps=draft_gate.TRIAL_STEPS)
    assert gate.shut(1)
    return gate


def test_requests_started_without_a_drafter_share_blocks_without_features(tiny_models, tmp_path, monkeypatch):
    """Requests that join where the draft gate has speculation shut never draft: their prompt passes
    keep no drafter features, and they hit each other's blocks as a plain engine's requests would
    (a repeated prompt whole). A drafting request does not resume from those blocks: it computes
    them, drafts what it drafts with the cache off, and a later drafting request hits its blocks.
    Every output is the cache-off one."""
    from verispec.engine.prefix_rows import KeptRows

    d = tiny_models.get("prefix-qwen3", "qwen3", **SHAPE)
    base = load_engine(str(d), dtype="float64", device="cpu", block_size=BLOCK)
    make = eagle3_for(base, tmp_path / "eagle3")
    g = torch.Generator().manual_seed(17)
    ids = lambda n: torch.randint(3, base.model.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(3 * BLOCK + 2)
    first, second, third, aligned = shared + ids(4), shared + ids(6), shared + ids(5), shared[:3 * BLOCK]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    cold = with_proposer(base, make(), 3, prefix_cache=False)
    warm = with_proposer(base, make(), 3)
    drafted = {id(cold): [], id(warm): []}
    for engine in (cold, warm):
        def recording(seqs, counts, engine=engine, real=engine.runner.propose):
            drafts = real(seqs, counts)
            drafted[id(engine)].append([d.token_ids for d in drafts])
            return drafts
        engine.runner.propose = recording

    def run(engine, prompt):
        drafted[id(engine)].clear()
        return engine.generate_all(prompt, params), list(drafted[id(engine)])

    want = {tuple(p): run(cold, p) for p in (first, second, third, aligned)}
    asked = []
    at = KeptRows.at
    monkeypatch.setattr(KeptRows, "at", lambda self, b, i: asked.append(i) or at(self, b, i))

    warm.draft_policy.gate = shut_gate()
    for prompt, cached in [(first, 0), (second, 3 * BLOCK), (aligned, 3 * BLOCK - 1)]:
        result, _ = run(warm, prompt)
        assert result.token_ids == want[tuple(prompt)][0].token_ids
        assert result.stats.cached_tokens == cached and result.stats.drafted == 0
    assert asked == [], "a request that never drafts kept drafter features"

    del warm.draft_policy.gate  # requests draft again, with the schedule alone
    for prompt, cached in [(first, 0), (third, 3 * BLOCK)]:
        result, drafts = run(warm, prompt)
        want_result, want_drafts = want[tuple(prompt)]
        assert result.token_ids == want_result.token_ids and result.stats.cached_tokens == cached
        assert result.stats.drafted > 0 and drafts == want_drafts, "a prefix hit changed the drafts"
    assert asked and warm.blocks.num_used == 0
