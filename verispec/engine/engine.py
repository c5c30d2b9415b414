"""The engine: requests in, token chunks out, many sequences decoding at once.

The server and the Python API hand requests to `submit` (or iterate `generate`); a worker thread
runs steps while there is work. A step is three phases with plain data between them:
- the scheduler plans (engine/scheduler.py): which prompt chunks run in which passes, which
  sequences decode with how many drafts, and the cache operations its bookkeeping implies;
- the runner executes (engine/runner.py): the cache operations, the prompt passes, the drafts
  and one verify pass over every decoding sequence;
- the update applies (engine/update.py): acceptance, commit, the drafter's observation, output.
The speculative round is written once: k = 0 drafts is plain decoding. Overlapped plain decoding
(engine/overlap.py) is a loop over the same pieces. The paged KV cache is allocated once at
start, sized from the memory budget.
"""
from __future__ import annotations

import dataclasses

import atexit
import collections
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from verispec import log
from verispec.cache.prefix import PrefixCache
from verispec.cache.kv import RecurrentLayerSpec
from verispec.cache.paged import BlockAllocator, CacheBudget, PagedPools, SlotAllocator
from verispec.config import EngineConfig, env
from verispec.engine import cpu_threads, warmup
from verispec.engine.cache_sizing import size_cache
from verispec.engine.client import ServedEngine
from verispec.engine.draft_gate import ThroughputGate
from verispec.engine.draft_policy import MEASURE, AdaptiveDrafts, DraftPolicy, draft_policy
from verispec.engine.limits import RequestLimits
from verispec.engine.options import check_kv_cache_dtype, check_limits
from verispec.engine.output import OutputBuilder
from verispec.engine.overlap import OverlappedDecode
from verispec.engine.runner import ModelRunner
from verispec.engine.prefill_pacer import prefill_pacer_for
from verispec.engine.spec_round import SpeculativeRounds
from verispec.engine.scheduler import Scheduler, StepPlan, batches_prompts, default_token_budget
from verispec.engine.sequence import Sequence
from verispec.engine.tp_peers import MirroredPools, Peers, TensorParallelError
from verispec.engine.types import GenerationChunk, GenerationResult
from verispec.engine.update import StepUpdate, mark_first_scheduled
from verispec.errors import VerispecError
from verispec.grammar.constraint import GrammarCompiler
from verispec.kernels import decode_attention as split_k
from verispec.loading.model_loader import resolve_numerics
from verispec.loading.tokenizer import Tokenizer
from verispec.models.base import CausalLM
from verispec.sampling.params import SamplingParams
from verispec.sampling.sampler import TokenHistory, make_generator
from verispec.spec.proposer import Proposer

WORKER_IDLE_S = 0.5
SLOW_STEP_S = 0.2  # a step longer than this is logged under VERISPEC_DEBUG=1 with what it held
_live_workers: set[threading.Thread] = set()


@atexit.register
def _join_workers() -> None:
    """Let a worker finish its step before the interpreter tears torch down under it."""
    for thread in list(_live_workers):
        thread.join(timeout=5)


class Engine(ServedEngine):  # describe(), default_seed, close(): engine/client.py
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 model_dir: Path | None = None, proposer: Proposer | None = None, num_drafts: int = 0,
                 peers: Peers | None = None):
        self.model = model
        # tensor parallelism: `model` is rank 0's share and `peers` runs the other ranks' (engine/tp_peers.py)
        self.peers = peers
        self.tokenizer = tokenizer
        # the numerics that run ("exact" or "fast"; Engine.load resolved them already, idempotently)
        config = dataclasses.replace(config, numerics=resolve_numerics(model, config.numerics)[0])
        self.config = config
        self.model_name = config.model
        self.model_dir = model_dir
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        limit = model.max_position_embeddings
        self.max_model_len = min(config.max_model_len, limit) if config.max_model_len else limit
        check_limits(config)
        self.eos_token_ids = tokenizer.eos_token_ids
        # Model vocabularies are often padded past the tokenizer's; those rows are never sampled.
        self.num_real_tokens = min(tokenizer.vocab_size, model.vocab_size)
        self.grammars = GrammarCompiler(tokenizer, model.vocab_size, self.eos_token_ids)
        self.proposer = proposer
        self.num_drafts = num_drafts if proposer is not None else 0
        if proposer is not None and num_drafts < 1:
            raise VerispecError(f"the number of drafts per round must be >= 1, got {num_drafts}")
        self.draft_policy: DraftPolicy = draft_policy(config, proposer, self.num_drafts, self.device.type)
        # --draft-costs measure: timed at the first step, after prewarm has captured the CUDA graphs
        self._costs_pending = config.draft_costs == MEASURE and isinstance(self.draft_policy, AdaptiveDrafts)
        # called with describe_drafts() when it changes (the engine process tells its parent)
        self.on_drafts_changed: Callable[[str], None] | None = None
        warmup.pin_triton_cache_dir(self.device)  # before anything compiles (see there)
        hybrid = any(isinstance(spec, RecurrentLayerSpec) for spec in model.cache_specs())
        self.use_graphs = warmup.graphs_possible(self.device, config.cuda_graphs, split_hybrid=hybrid and peers is not None)
        self._setup_cache()
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._worker_lock = threading.Lock()
        # per round: (sequences, tokens per sequence, draft+inputs ms, launch ms, device wait ms, host after ms)
        self.round_timings: collections.deque = collections.deque(maxlen=4096)
        self.update = StepUpdate(self.scheduler, self.runner, self.grammars)
        self.rounds = SpeculativeRounds(self.runner, self.update, self.grammars, self.draft_policy, self.round_timings,
                                        profile=env().eagle3_profile)  # VERISPEC_EAGLE3_PROFILE, read once
        overlap = self.use_graphs if config.overlap_decode is None else config.overlap_decode
        self.overlap = OverlappedDecode(self.scheduler, self.runner, self.update, overlap,
                                        new_work=lambda: not self._inbox.empty(), timings=self.round_timings,
                                        rest_drafters=self._rest_drafters)
        if isinstance(self.draft_policy, AdaptiveDrafts):
            self.draft_policy.gate = ThroughputGate()
        # every submitted request not yet ended, for failing them all from another thread
        self._open: set[Sequence] = set()
        self._open_lock = threading.Lock()
        if peers is not None:
            peers.on_lost = self._fail_open_requests
        self._release_caller_threads()

    def _fail_open_requests(self, reason: str) -> None:
        """A lost tensor-parallel rank ends every open request with the error now, from the thread
        that noticed: this engine's own may be blocked for good in a step waiting on that rank (a
        CUDA graph's all-reduce spinning on its signal). Whatever that step emits later is dropped
        (Sequence's sink ends once)."""
        with self._open_lock:
            open_now = list(self._open)
        for seq in open_now:
            seq.cancel.set()  # should the step ever return: finished there, its blocks freed
            seq.sink(TensorParallelError(reason))

    def _rest_drafters(self, batch: int) -> bool:
        """Whether the draft gate holds speculation off at this batch size for longer than a drafter's
        unseen rows are kept: its sequences then stop drafting rather than keep the drafter in step
        for rounds that will not draft. New requests start with a drafter, so the gate's rechecks
        still have sequences to speculate with."""
        gate = getattr(self.draft_policy, "gate", None)
        return gate is not None and (gate.plain_steps(batch) or 0) >= self.runner.deferred.max_rows

    def _release_caller_threads(self) -> None:
        """On a CPU, free the OpenMP pool of the thread that loaded the model or submitted work, so
        that the worker's is the only one (engine/cpu_threads.py: two pools halve decode speed)."""
        if self.device.type == "cpu" and threading.current_thread() is not self._thread:
            cpu_threads.release_thread_pool()

    # ---- the paged cache --------------------------------------------------------------------------
    def _setup_cache(self) -> None:
        specs = self.model.cache_specs()
        cfg = self.config
        check_kv_cache_dtype(specs, cfg.kv_cache_dtype)
        sizes = size_cache(specs, cfg, self.dtype, self.device, self.max_model_len, self.num_drafts)
        self.max_model_len = sizes.max_model_len
        num_blocks, block, num_slots, num_snapshots = (sizes.num_blocks, sizes.block_size, sizes.num_state_slots,
                                                       sizes.num_snapshots)
        self.pools = PagedPools(specs, num_blocks, block, max(num_slots + num_snapshots, 1), self.dtype, self.device,
                                kv_cache_dtype=cfg.kv_cache_dtype)
        if self.peers is not None:  # each rank holds its own heads' blocks, under the same block ids
            self.peers.make_pools(num_blocks, block, max(num_slots + num_snapshots, 1), cfg.kv_cache_dtype)
        self.budget = CacheBudget(num_blocks, block, num_slots, sizes.bytes_total)
        self.blocks = BlockAllocator(num_blocks, block)
        slots = SlotAllocator(num_slots) if num_slots else None
        self.prefix = None
        if cfg.prefix_cache:
            # under tensor parallelism the workers take its recurrent-state snapshots too
            pools = MirroredPools(self.pools, self.peers) if self.peers is not None else self.pools
            self.prefix = PrefixCache(self.blocks, pools, list(range(num_slots, num_slots + num_snapshots)),
                                      keep_features=False)
        batched = cfg.max_num_batched_tokens or default_token_budget(
            sum(p.numel() for p in self.model.parameters()), self.device.type, cfg.prefill_step_size)
        self.pacer = prefill_pacer_for(self.device, cfg.prefill_step_seconds)
        self.scheduler = Scheduler(self.blocks, slots, cfg.max_num_seqs, batched, cfg.prefill_step_size,
                                   prefix=self.prefix, pacer=self.pacer, starts_plain=self._starts_plain,
                                   batch_prefill=batches_prompts(cfg.batch_prefill, self.device.type))
        self.runner = ModelRunner(self.model, self.pools, self.num_real_tokens,
                                  use_kernel=self.use_graphs or split_k.available(self.device), proposer=self.proposer,
                                  prompt_kernel=cfg.numerics == "exact" and self._exact_prompts(), peers=self.peers)
        if self.prefix is not None:
            # a drafter with K/V rows of its own recomputes its row at a hit's last position
            self.prefix.keep_features = self.proposer is not None and self.proposer.pools is not None
        log.debug("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB%s); up to %d sequences at once; "
                  "prefix cache %s", num_blocks - 1, block, sizes.capacity, self.budget.bytes_total / 2**30,
                  f", {num_slots - 1} recurrent state slots" if num_slots else "", cfg.max_num_seqs,
                  "off" if self.prefix is None else
                  f"on ({num_snapshots} recurrent-state snapshots)" if num_slots else "on")

    def _exact_prompts(self) -> bool:
        """Prompt chunks attend as decode steps do: CUDA's chunk kernel (with Triton), a CPU row by row."""
        return self.device.type == "cpu" or split_k.available(self.device)

    @classmethod
    def load(cls, config: EngineConfig) -> "Engine":
        """The engine for config.model (a directory, hub id, .gguf file or alias), with its proposer."""
        from verispec.engine.loading import load_parts

        parts = load_parts(config)
        t0 = time.perf_counter()
        try:
            engine = cls(*parts)
        except BaseException:
            if parts[-1] is not None:  # the tensor-parallel peers: stopped, not left waiting on rank 0
                parts[-1].stop()
            raise
        log.startup_phase("allocating the KV cache", time.perf_counter() - t0)
        return engine

    # ---- request checks (engine/limits.py, shared with the engine process's proxy) ------------------
    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The number of new tokens this request may produce; raises on a request that cannot fit."""
        return self.limits.max_new_tokens(num_prompt_tokens, params)

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        self.limits.check_prompt_ids(prompt_ids)

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_model_len, self.model.vocab_size, self.config.default_max_tokens)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def method(self) -> str:
        """The speculation method ("ar": none)."""
        return self.proposer.method if self.proposer is not None else "ar"

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[object], None],
               cancel: threading.Event | None = None) -> Sequence:
        """Queue a request; `sink` is called (on the engine thread) with each GenerationChunk, the
        last one carrying finish_reason and stats, or with the exception that ended the request.
        Setting `cancel` stops it at the next step and frees its blocks. Bad requests raise here."""
        self.check_prompt_ids(prompt_ids)
        max_new = self.resolve_max_tokens(len(prompt_ids), params)
        if (failure := self.failure()) is not None:
            raise TensorParallelError(failure)
        history = TokenHistory(self.model.vocab_size, prompt_ids, self.device)
        out = OutputBuilder(self.tokenizer, params, max_new, history, self.eos_token_ids)
        seed = params.seed if params.seed is not None else self.config.seed
        generator = make_generator(seed, self.device)
        method = self.method
        seq = Sequence(prompt_ids, params, max_new, out, generator, method, sink, cancel, self.config.block_size,
                       seed=seed)
        if params.grammar is not None:  # one matcher per sequence (n choices each get their own)
            seq.constraint = self.grammars.constraint(params.grammar)
        self._track(seq)
        self._release_caller_threads()
        self._inbox.put(seq)
        self._ensure_worker()
        with self._wake:
            self._wake.notify()
        return seq

    def _track(self, seq: Sequence) -> None:
        """Keeps `seq` among the open requests until its sink has ended it."""

        def untrack() -> None:
            with self._open_lock:
                self._open.discard(seq)

        with self._open_lock:
            self._open.add(seq)
        seq.sink.on_end = untrack

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[GenerationChunk]:
        """Yield one chunk per target pass of this sequence; the last has finish_reason and stats.
        Closing the iterator early cancels the request."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        cancel = cancel or threading.Event()
        self.submit(prompt_ids, params, chunks.put, cancel)
        try:
            while True:
                item = chunks.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            cancel.set()  # a no-op once finished; stops the sequence when the consumer left early

    def generate_all(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        return self.generate_batch([prompt_ids], [params])[0]

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams
                       ) -> list[GenerationResult]:
        """Run every prompt together (one batch, continuously scheduled); results in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise VerispecError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        collected: list[list] = [[] for _ in prompts]
        done = threading.Semaphore(0)

        def sink_for(i: int):
            def sink(item) -> None:
                collected[i].append(item)
                if isinstance(item, BaseException) or item.finish_reason is not None:
                    done.release()
            return sink

        for i, (ids, p) in enumerate(zip(prompts, params)):
            self.submit(ids, p, sink_for(i))
        for _ in prompts:
            done.acquire()
        results = []
        for ids, p, items in zip(prompts, params, collected):
            if isinstance(items[-1], BaseException):
                raise items[-1]
            last = items[-1]
            token_ids = [t for c in items for t in c.token_ids]
            logprobs = [lp for c in items for lp in (c.logprobs or [])] if p.logprobs else None
            prompt_logprobs = next((c.prompt_logprobs for c in items if c.prompt_logprobs is not None), None)
            results.append(GenerationResult(list(ids), token_ids, "".join(c.text for c in items),
                                            last.finish_reason, last.stats, logprobs, prompt_logprobs))
        return results

    # ---- the worker -------------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        with self._worker_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="verispec-engine", daemon=True)
                self._thread.start()
                _live_workers.add(self._thread)

    def failure(self) -> str | None:
        """Why the engine can no longer run requests: a rank of its tensor-parallel group is gone."""
        return self.peers.failure() if self.peers is not None else None

    def close(self) -> None:
        """Cancel every request; a tensor-parallel engine's worker ranks then stop."""
        self.shutdown()
        if self.peers is not None:
            self.peers.stop()

    def shutdown(self) -> None:
        """Cancel every request (each stops at the next step, its blocks freed); the worker then
        goes idle and exits. The engine stays usable: a later submit starts a new worker."""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            seq.cancel.set()
        with self._wake:
            self._wake.notify()

    def _work(self) -> None:
        """Steps while there is work; exits after a short idle spell (the next submit starts a new
        worker), so an idle engine holds no thread."""
        while True:
            self._drain_inbox()
            if self.scheduler.has_work:
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - step() fails its own sequences; this is a bug in between
                    log.exception("engine step failed outside any sequence's work")
                continue
            with self._wake:
                if self._inbox.empty():
                    self._wake.wait(timeout=WORKER_IDLE_S)
            with self._worker_lock:
                if self._inbox.empty() and not self.scheduler.has_work:
                    self._thread = None  # decided under the lock: a submit now starts a new worker
                    _live_workers.discard(threading.current_thread())
                    return

    def _drain_inbox(self) -> None:
        while True:
            try:
                self.scheduler.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def load_stats(self) -> dict:
        """What /metrics shows about the scheduler and the cache."""
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting) + self._inbox.qsize(),
                "kv_blocks_used": self.blocks.num_used, "kv_blocks_total": self.blocks.num_usable,
                "preemptions": s.num_preemptions, "drafts": self.draft_policy.describe_choices(),
                "prefix_cache": self.prefix_cache_stats()}

    def prefix_cache_stats(self) -> dict | None:
        """Prefix-cache counters since start (None with --no-prefix-cache)."""
        if self.prefix is None:
            return None
        stats = self.prefix.stats
        return {"lookups": stats.lookups, "hits": stats.hits, "queried_tokens": stats.queried_tokens,
                "hit_tokens": stats.hit_tokens, "cached_blocks": self.blocks.num_cached,
                "idle_blocks": self.blocks.num_cached_idle, "evictions": self.blocks.num_evictions,
                "snapshots": self.prefix.num_snapshots}
    # ---- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Finish cancelled sequences; the scheduler plans, the runner executes, the update applies.
        A failing step fails its sequences (their clients get the error), frees their blocks, and
        the engine goes on. All of it in inference mode: tensors made inside it and outside it
        differ to torch.compile, whose functions would otherwise compile again for each kind."""
        self._drain_inbox()
        self._finish_cancelled()
        if self._costs_pending:
            self.measure_draft_costs()
        planned = time.perf_counter()
        plan = self.scheduler.schedule(self.draft_policy.choose)
        self.runner.apply(plan.cache_ops)
        if plan.empty:
            return
        start = time.perf_counter()
        try:
            prefill_s, rounds = self._run(plan, planned)
        except Exception as exc:  # noqa: BLE001 - handed to each affected request
            log.exception("engine step failed; failing its %d sequences", len(plan.prefills) + len(plan.decodes))
            self.update.fail([s for s, _ in plan.prefills] + plan.decodes, exc)
            return
        seconds = time.perf_counter() - start
        if self.pacer is not None and plan.prefill_groups:
            self.pacer.observe(sum(n for _, n in plan.prefills), seconds)
        # a stall a client sees (a compile, a long prompt): the prompt passes and the longest a decoding
        # sequence waited for a token (an overlapped run of many rounds is no stall)
        if prefill_s + (seconds - prefill_s) / max(rounds, 1) > SLOW_STEP_S:
            log.debug("slow step %.2fs: prompt chunks %s (%.2fs), %d decoding (%d rounds)", seconds,
                      [[n for _, n in group] for group in plan.prefill_groups], prefill_s, len(plan.decodes),
                      rounds)

    def _run(self, plan: StepPlan, planned: float) -> tuple[float, int]:
        """The plan's prompt passes, then its decode rounds. Returns the prompt passes' seconds and
        the number of decode rounds run."""
        prefill_start = time.perf_counter()
        for group in plan.prefill_groups:
            self._prefill(group)
        prefill_s = time.perf_counter() - prefill_start
        decodes = [s for s in plan.decodes if not s.finished]
        if not decodes:
            return prefill_s, 0
        counts = [k for s, k in zip(plan.decodes, plan.drafts) if not s.finished]
        gate = getattr(self.draft_policy, "gate", None)  # the adaptive choice's, where one runs
        if gate is not None:
            # timed from the step's planning on (the scheduler and the draft choice cost a
            # speculative round every round, an overlapped run once), its prompt passes left out
            start = planned + (time.perf_counter() - prefill_start)
            before = sum(s.num_tokens for s in decodes)
            epoch = gate.epoch
        steps = 0
        if self.overlap.eligible(decodes, counts):
            # the policy chose this round; the rounds after it that run unchosen are accounted to it
            steps = self.overlap.run(decodes, 1 + self.draft_policy.plain_rounds(decodes))
            if steps:
                self.draft_policy.skip(decodes, steps - 1)
        if not steps:
            self._round(decodes, counts)
        if gate is not None:  # what it weighs: this server's speculative rounds against its plain steps
            measuring = log.debug_enabled() and not steps and gate.measuring(len(decodes))
            tokens, seconds = sum(s.num_tokens for s in decodes) - before, time.perf_counter() - start
            gate.record(len(decodes), any(counts), tokens, seconds, max(steps, 1), epoch)
            if measuring and self.round_timings:
                log.debug("draft gate, batch %d: measured round of %d drafts, %d tokens in %.2f ms (draft+inputs,"
                          " launch, device, host after: %s ms)", len(decodes), sum(counts), tokens,
                          seconds * 1000, ", ".join(f"{t:.2f}" for t in self.round_timings[-1][2:]))
        return prefill_s, max(steps, 1)

    def _finish_cancelled(self) -> None:
        s = self.scheduler
        for seq in [q for q in list(s.running) + list(s.waiting) if q.cancel.is_set()]:
            self.update.finish(seq, seq.out.cancel())

    def _prefill(self, group: list[tuple[Sequence, int]]) -> None:
        """One target pass over a group of prompt chunks (rows padded at their ends; each row's
        bits are those of its chunk alone), then each sequence's bookkeeping."""
        if self.proposer is not None:
            self._start_drafters(group)
        mark_first_scheduled(group)
        seqs = [seq for seq, _ in group]
        starts = [seq.num_cached for seq in seqs]
        drafting = self.proposer is not None
        scored = [b for b, seq in enumerate(seqs) if seq.scores_prompt]  # SamplingParams.prompt_logprobs
        out = self.runner.prefill(seqs, [n for _, n in group], self.runner.capture_layers, keep_all_rows=drafting,
                                  every_row=scored)
        self.update.prefilled(group, starts, out)

    def _starts_plain(self, batch: int) -> bool:
        """Whether a new sequence joining `batch` running ones never drafts: the draft gate has
        speculation shut there, or the cost model would draft nothing there at the acceptance
        measured so far (its drafter's pass over the prompt would then buy nothing)."""
        if self.proposer is None:
            return False
        gate = getattr(self.draft_policy, "gate", None)
        if gate is not None and gate.shut(batch):
            return True
        return isinstance(self.draft_policy, AdaptiveDrafts) and self.draft_policy.drafts_nothing_at(batch)

    def _start_drafters(self, group: list[tuple[Sequence, int]]) -> None:
        """Each sequence's drafter starts at its first prompt pass (again after a preemption), unless
        the batch it joins is one where the draft gate has speculation shut: there it decodes plain to
        its end, and nobody waits for its drafter's pass over its prompt. (The scheduler marks such a
        sequence at its admission already, so its prefix hit needs no drafter features; a batch that
        grew past a shut size in the same step marks the rest here.)"""
        joining = [seq for seq, _ in group if seq.first_scheduled is None]
        if joining and self._starts_plain(len(self.scheduler.running)):
            for seq in joining:
                seq.plain_only = True
        plain = sum(seq.plain_only for seq in joining)
        if plain:
            log.debug("%d new %s without a drafter: a batch of %d, where the draft gate has speculation shut "
                      "or fresh sequences would draft nothing",
                      plain, "sequence starts" if plain == 1 else "sequences start", len(self.scheduler.running))
        for seq, _ in group:
            if not seq.drafting and not seq.plain_only:
                self.proposer.start(seq)
                seq.drafting = True

    def _round(self, seqs: list[Sequence], num_drafts: list[int]) -> None:
        """One speculative round over every decoding sequence (engine/spec_round.py)."""
        self.rounds.run(seqs, num_drafts)

    def measure_draft_costs(self) -> None:
        """Time this engine's verify and draft passes into the adaptive draft choice's cost table
        (engine/cost_measure.py); on the worker thread, before any request decodes."""
        from verispec.engine.cost_measure import measure_costs

        self._costs_pending = False
        t0 = time.perf_counter()
        try:
            costs = measure_costs(self)
        except RuntimeError as exc:  # e.g. a KV cache too small for the timed sequences
            log.warning("draft costs not measured (%s); the analytic model stays", exc)
            return
        self.draft_policy.costs = costs
        log.info("draft costs measured in %.1fs: %s", time.perf_counter() - t0, costs.describe())
        if self.on_drafts_changed is not None:
            self.on_drafts_changed(self.describe_drafts())

    # ---- warm-up (engine/warmup.py) -----------------------------------------------------------------
    def prewarm(self) -> float:
        """Capture CUDA graphs, then one short generation, so the first request pays no warm-up.
        Returns seconds taken."""
        return warmup.prewarm(self)

    def capture_graphs(self) -> float:
        """Capture verify passes (batch buckets x T = 1..k+1) as CUDA graphs. Returns seconds taken."""
        return warmup.capture_graphs(self)


def load_engine(model: str, **kwargs) -> Engine:
    return Engine.load(replace(EngineConfig(model=model), **kwargs))
