"""The chained drafter: what EAGLE3 and the MTP head share, drafting for every sequence at once.

Both are a small model with its own one-layer cache whose rows live in paged pools indexed by
the *target's* block tables (drafter row p sits at position p, as the target's does), so a
drafter needs no allocator of its own and a sequence's drafter rows come and go with its blocks.
Per sequence it keeps only the last committed row's output and logits. One round: k chained
passes over [B, 1] (a token chosen per row from the last logits, fed back with the last output),
then, after verification, one observe pass over every sequence's accepted rows ([B, n_max],
padded: the step's tokens shifted by one, plus the next token, paired with the target's features
at those positions). On CUDA both kinds of pass replay CUDA graphs captured per (batch bucket,
T), as the target's verify passes do: eagerly a pass is ~100 PyTorch ops of Python and launch
overhead, more than a whole captured target step of a small model.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verispec.cache.kv import LayerCacheSpec
from verispec.cache.paged import BatchCache, PagedPools, block_table_rows
from verispec.kernels.cuda_graph import GraphedCall
from verispec.models.base import fuse_small_ops
from verispec.sampling.params import SamplingParams
from verispec.spec.proposer import Draft, Proposer, TargetCache, TargetStep, drafts_per_row


@dataclass
class _RowState:
    """A sequence's last committed drafter row: row `row` of an observe pass's outputs (kept whole,
    one copy per pass, so the next round can take them as they are when the batch is the same)."""

    outs: torch.Tensor  # [R, 1, F] the pass's outputs of each row's last committed position
    logits: torch.Tensor  # [R, V'] their logits (the first draft's distribution)
    row: int
    next_position: int  # the position of the token the first draft follows

    @property
    def last_out(self) -> torch.Tensor:  # [1, F]
        return self.outs[self.row]

    @property
    def last_logits(self) -> torch.Tensor:  # [V']
        return self.logits[self.row]


class ChainedDrafter(Proposer):
    """Subclasses give the drafter module and its cache specs, `_rows` (one pass, returning each
    row's output and logits at a given index), `_greedy_tokens` (every row's greedy draft, on the
    device), `_features` / `_batch_features` (the target features a pass pairs with its tokens)
    and `_choose` (one sampled draft and its distribution)."""

    def __init__(self, drafter: torch.nn.Module, cache_specs: list[LayerCacheSpec], feature_size: int):
        self.drafter = drafter
        self.cache_specs = cache_specs
        self.feature_size = feature_size
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.pools: PagedPools | None = None  # bound to the target's block geometry (bind)
        self._target: TargetCache | None = None
        self._states: dict[int, _RowState] = {}
        self._graphs: DrafterGraphs | None = None

    def bind(self, target: TargetCache) -> None:
        """Paged pools for the drafter's layers, indexed by the target's block tables."""
        self.pools = PagedPools(self.cache_specs, target.num_blocks, target.block_size, 1, self.dtype, self.device)
        self._target = target
        self._states = {}
        self._graphs = None

    def capture_graphs(self, batch_sizes: list[int], max_tokens: int, table_width: int) -> None:
        """CUDA: observe and chained passes (T = 1..max_tokens) as graphs per batch bucket, with the
        drafter's projections merged and small ops compiled as the target's are."""
        if self.device.type != "cuda" or self._graphs is not None:
            return
        fuse_small_ops(self.drafter)
        self._graphs = DrafterGraphs(self, batch_sizes, max_tokens, table_width, self.feature_size)

    def drop_graphs(self) -> None:
        self._graphs = None

    def start(self, seq) -> None:
        self._states.pop(seq.id, None)

    def release(self, seq) -> None:
        self._states.pop(seq.id, None)

    # ---- passes ---------------------------------------------------------------------------------
    def _batch_pass(self, seqs, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                    last: torch.Tensor, num_keys: int, rows: tuple[list[int], list[int]] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [B, T]; features [B, T, F]; last [B]: the index whose output and logits
        each row returns -> (out [B, 1, F], logits [B, V']). rows: each row's first position and
        real length when rows are contiguous runs padded at their ends (an observe pass): an
        eager pass then attends per sequence, causally, as a prompt chunk does (no masked call)."""
        graphs = self._graphs
        if graphs is not None:
            step = graphs.get(len(seqs), ids.shape[1])
            if step is not None:
                return step(seqs, ids, features, positions, last)
        starts, lengths = rows if rows is not None else (None, None)
        # rows of several sequences: on CUDA one chunk-attention kernel for them all (the kernel a
        # target prompt pass runs under exact numerics) rather than an attention call per sequence
        cache = BatchCache(self.pools, self._target.tables(seqs), positions, None, num_keys, self._target.use_kernel,
                           row_starts=starts, row_lengths=lengths, prompt_kernel=self._target.use_kernel)
        return self._rows(ids, features, positions, cache, last)

    @torch.inference_mode()
    def observe(self, rows: list[tuple[object, TargetStep]]) -> None:
        """Each sequence's committed step: the drafter runs over step.token_ids[1:] + [next_token]
        paired with the target features at the step's positions (one pass for all sequences)."""
        seqs = [seq for seq, _ in rows]
        steps = [step for _, step in rows]
        n_max = max(len(s.token_ids) for s in steps)
        device = self.device
        ids, positions = [], []
        for step in steps:
            n = len(step.token_ids)
            row_ids = step.token_ids[1:] + [step.next_token]
            ids.append(row_ids + [row_ids[-1]] * (n_max - n))
            positions.append([step.start_position + j for j in range(n_max)])
        features = self._pass_features(steps, n_max)
        if features is None:
            feats = []
            for step in steps:
                f = self._features(step)  # [n, F]
                if len(f) < n_max:
                    f = torch.cat([f, f[-1:].expand(n_max - len(f), -1)])
                feats.append(f)
            features = torch.stack(feats)
        # one host-to-device copy for ids, positions and row indices
        packed = torch.tensor([i + p + [len(step.token_ids) - 1] for i, p, step in zip(ids, positions, steps)],
                              dtype=torch.long).to(device, non_blocking=True)
        ids_t, pos_t, last = packed[:, :n_max], packed[:, n_max:2 * n_max], packed[:, -1]
        num_keys = max(s.start_position + n_max for s in steps)
        if self._graphs is not None:
            self._graphs.new_round()
        spans = ([step.start_position for step in steps], [len(step.token_ids) for step in steps])
        out, logits = self._batch_pass(seqs, ids_t, features.to(self.pools.dtype), pos_t, last, num_keys, spans)
        out, logits = out.clone(), logits.clone()  # graph outputs are reused by the next replay
        for b, (seq, step) in enumerate(rows):
            self._states[seq.id] = _RowState(out, logits, b, step.start_position + len(step.token_ids))

    def _pass_features(self, steps: list, n_max: int) -> torch.Tensor | None:
        """[B, n_max, F] features of steps that are rows of one verify pass (PassRowStep), read from
        the pass's tensors at once (a subset of its rows: one gather); None when they are not
        (prefill chunks, deferred rows). Rows past a step's own length hold the pass's other rows:
        finite, never attended to by a real row, and the drafter rows they write sit past the
        committed ones, rewritten before anything reads them."""
        sources = [getattr(step, "source", None) for step in steps]
        out = sources[0][0] if sources[0] is not None else None
        if out is None or any(s is None or s[0] is not out for s in sources):
            return None
        features = self._batch_features(out, n_max)
        rows = [b for _, b in sources]
        if features is None or rows == list(range(len(out.hidden))):
            return features
        return features.index_select(0, torch.tensor(rows, device=features.device))

    def _batch_features(self, out, n_max: int) -> torch.Tensor | None:
        """Every row of pass `out`, positions :n_max -> [B, n_max, F]; None: this drafter has no
        batched form (each step's features are taken one by one)."""
        return None

    @property
    def drafts_on_device(self) -> bool:
        """The chain's greedy drafts stay on the device, unless a subclass changed `propose` (a test's
        scripted drafts) without giving `propose_on_device` the same change."""
        cls = type(self)
        return cls.propose is ChainedDrafter.propose or cls.propose_on_device is not ChainedDrafter.propose_on_device

    @torch.inference_mode()
    def propose(self, seqs, num_drafts: list[int], params: list, generators: list) -> list[Draft]:
        """Up to num_drafts[b] drafts for each sequence, chained for all of them at once."""
        chosen, probs = self._chain(seqs, num_drafts, params, generators)
        return drafts_per_row(chosen, probs, num_drafts)

    @torch.inference_mode()
    def propose_on_device(self, seqs, num_drafts: list[int]) -> torch.Tensor:
        chain = self._graphs.chain(len(seqs), max(num_drafts)) if self._graphs is not None else None
        if chain is None:
            chosen, _ = self._chain(seqs, num_drafts, None, None)
            return torch.stack(chosen, dim=1)
        logits, out, base = self._last_rows(seqs)  # the k chained passes as one replay
        self._graphs.new_round()
        return chain(seqs, logits, out, base)

    def _last_rows(self, seqs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Each sequence's last committed drafter row: (logits [B, V'], outputs [B, 1, F], the
        position its first draft takes)."""
        states = [self._states[s.id] for s in seqs]
        first = states[0]
        if (len(first.logits) == len(states) and
                all(st.logits is first.logits and st.row == b for b, st in enumerate(states))):
            logits, out = first.logits, first.outs  # the last observe pass's rows, in this order
        else:
            logits = torch.stack([st.last_logits for st in states])
            out = torch.stack([st.last_out for st in states])  # [B, 1, F]
        return logits, out, [st.next_position for st in states]

    def _chain(self, seqs, num_drafts: list[int], params: list | None, generators: list | None
               ) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
        """The chained passes: each step's tokens [B] on the device and, per row, the distribution a
        sampled one came from (params None: every row greedy, nothing read back)."""
        k = max(num_drafts)
        logits, out, base = self._last_rows(seqs)
        base_t = torch.tensor(base, dtype=torch.long).to(self.device, non_blocking=True)[:, None]  # [B, 1]
        if self._graphs is not None:
            self._graphs.new_round()

        def sampled(i: int, logits: torch.Tensor):
            # a row past its own count draws nothing: its generator must advance as it would alone
            return self._choose_rows(logits, params, generators, [i < n for n in num_drafts])
        return self._chained_passes(k, logits, out, base_t, max(base) + 1, functools.partial(self._batch_pass, seqs),
                                    None if params is None else sampled)

    def _chained_passes(self, k: int, logits: torch.Tensor, out: torch.Tensor, base: torch.Tensor, num_keys: int,
                        run_pass, choose=None) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
        """k drafts from logits [B, V'], each fed back (but the last) with the last outputs at positions
        base + i through run_pass(ids, features, positions, last, num_keys); choose(i, logits) -> (tokens,
        distributions), None: greedy. The eager and the captured chain (DrafterGraphs) both run this loop,
        so a graph's drafts are the eager ones bit for bit."""
        zero = torch.zeros(base.shape[0], dtype=torch.long, device=base.device)
        chosen: list[torch.Tensor] = []
        probs: list[list[torch.Tensor | None]] = []
        for i in range(k):
            if choose is None:
                tokens, q = self._greedy_tokens(logits), [None] * base.shape[0]
            else:
                tokens, q = choose(i, logits)
            chosen.append(tokens)
            probs.append(q)
            if i + 1 == k:
                break
            out, logits = run_pass(tokens[:, None], out, base + i, zero, num_keys + i)
        return chosen, probs

    def _choose_rows(self, logits: torch.Tensor, params: list, generators: list, active: list[bool]
                     ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """logits [B, V'] -> (target token ids [B] on the device, per row the distribution it was
        sampled from [V], or None when greedy). Inactive sampling rows keep the greedy token."""
        tokens = self._greedy_tokens(logits)
        probs: list[torch.Tensor | None] = [None] * logits.shape[0]
        for b, p in enumerate(params):
            if not p.greedy and active[b]:
                token, q = self._choose(logits[b], p, generators[b])
                tokens[b] = token
                probs[b] = q
        return tokens, probs

    # ---- what a drafter provides ------------------------------------------------------------------
    def _rows(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: BatchCache,
              last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _features(self, step: TargetStep) -> torch.Tensor:
        """The target's features for the step's positions: [T, F]."""
        raise NotImplementedError

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
        """The drafter's logits [V'] -> (target token id, the distribution it was sampled from over
        the target vocabulary [V], or None when greedy)."""
        raise NotImplementedError


class DrafterGraphs:
    """A batched drafter's passes captured per (batch bucket, T) over its paged pools: static
    token ids, features, positions, block tables and row indices; padded rows use the scratch block."""

    def __init__(self, drafter: ChainedDrafter, batch_sizes: list[int], max_tokens: int, table_width: int,
                 feature_size: int):
        self.drafter = drafter
        self.batch_sizes = batch_sizes
        self.calls: dict[tuple[int, int], GraphedCall] = {}
        device, dtype = drafter.pools.device, drafter.pools.dtype
        self._last_tables = None
        pool = None
        for b in sorted(batch_sizes, reverse=True):  # largest first, so the shared pool fits the rest
            for t in range(max_tokens, 0, -1):
                example = [torch.zeros(b, t, dtype=torch.long, device=device),
                           torch.zeros(b, t, feature_size, dtype=dtype, device=device),
                           torch.arange(t, device=device)[None].repeat(b, 1),
                           torch.zeros(b, table_width, dtype=torch.long, device=device),
                           torch.zeros(b, dtype=torch.long, device=device)]
                call = GraphedCall(self._pass, example, pool)
                pool = call.pool()
                self.calls[(b, t)] = call
        # a greedy round's k chained passes (k = 2 .. max_tokens - 1 drafts) as one graph: a replay
        # a pass cost more host time than the pass (input copies, positions, the argmax, launches)
        self.chains: dict[tuple[int, int], GraphedCall] = {}
        for b in sorted(batch_sizes, reverse=True):
            one_pass_logits = self.calls[(b, 1)].outputs[1]  # [b, V']: a pass's logits, as the chain starts from
            for k in range(2, max_tokens):
                example = [torch.zeros_like(one_pass_logits),
                           torch.zeros(b, 1, feature_size, dtype=dtype, device=device),
                           torch.zeros(b, 1, dtype=torch.long, device=device),
                           torch.zeros(b, table_width, dtype=torch.long, device=device)]
                call = GraphedCall(functools.partial(self._greedy_chain, k), example, pool)
                pool = call.pool()
                self.chains[(b, k)] = call

    def _pass(self, ids, features, positions, tables, last) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass as the graphs run it: the attention kernel reads the tables, no key count."""
        cache = BatchCache(self.drafter.pools, tables, positions, None, 0, use_kernel=True)
        return self.drafter._rows(ids, features, positions, cache, last)

    def _greedy_chain(self, k: int, logits, out, base, tables) -> tuple[torch.Tensor]:
        """k greedy drafts: the loop `ChainedDrafter._chain` runs, its passes as the one-pass graphs'."""
        def run_pass(ids, features, positions, last, num_keys):
            return self._pass(ids, features, positions, tables, last)
        chosen, _ = self.drafter._chained_passes(k, logits, out, base, 0, run_pass)
        return (torch.stack(chosen, dim=1),)

    def chain(self, batch: int, k: int):
        """The replay of k greedy drafts for `batch` sequences (None: no graph holds it)."""
        bucket = next((b for b in self.batch_sizes if b >= batch), None)
        call = self.chains.get((bucket, k)) if bucket is not None else None
        if call is None:
            return None

        def replay(seqs, logits, out, base: list[int]) -> torch.Tensor:
            pad = bucket - len(seqs)
            tables = self._tables(seqs, call.inputs[3].shape[1], pad)
            if pad:
                logits = torch.cat([logits, logits.new_zeros(pad, logits.shape[1])])
                out = torch.cat([out, out.new_zeros(pad, *out.shape[1:])])
            positions = torch.tensor(base + [0] * pad, dtype=torch.long)[:, None]
            return call(logits, out, positions, tables)[0][:len(seqs)]

        return replay

    def new_round(self) -> None:
        """Forget the cached tables: blocks may have changed since (a preempted sequence gets new ones)."""
        self._last_tables = None

    def _tables(self, seqs, width: int, pad: int) -> torch.Tensor:
        """Host block tables for the graph's buffer; a round's chained passes reuse the first's
        (within one propose_rows call, see new_round)."""
        key = (width, pad, tuple((s.id, len(s.block_table)) for s in seqs))
        if self._last_tables is None or self._last_tables[0] != key:
            self._last_tables = (key, block_table_rows(seqs, width, pad))
        return self._last_tables[1]

    def get(self, batch: int, num_tokens: int):
        bucket = next((b for b in self.batch_sizes if b >= batch), None)
        call = self.calls.get((bucket, num_tokens)) if bucket is not None else None
        if call is None:
            return None

        def replay(seqs, ids, features, positions, last):
            pad = bucket - len(seqs)
            tables = self._tables(seqs, call.inputs[3].shape[1], pad)
            if pad:
                t = ids.shape[1]
                ids = torch.cat([ids, ids.new_zeros(pad, t)])
                features = torch.cat([features, features.new_zeros(pad, t, features.shape[2])])
                positions = torch.cat([positions, torch.arange(t, device=positions.device)[None].repeat(pad, 1)])
                last = torch.cat([last, last.new_zeros(pad)])
            out, logits = call(ids, features, positions, tables, last)
            return out[:len(seqs)], logits[:len(seqs)]

        return replay
