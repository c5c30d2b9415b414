"""The paged KV cache: fixed-size blocks shared by every running sequence.

Storage (`PagedPools`): for each attention layer one K and one V pool of `num_blocks * block_size`
rows ([slots, Hkv, D]; slot = block id * block_size + offset), and for each recurrent layer
(Gated DeltaNet) one conv and one SSM state per *state slot*. A sequence owns a block table (the
ids of its blocks, in order: position p lives in block table[p // block_size] at offset
p % block_size) and, on a hybrid model, one state slot. Block 0 and state slot 0 are scratch:
rows of a padded batch write there, and nothing reads them.

`BatchCache` is the cache a model's forward sees for one step: B sequences' block tables and the
positions of the step's tokens. It has the surface the model layers use on the contiguous
`KVCache` (write K/V, read them back, recurrent state, commit per row), so the models do not know
which cache they run on. Rolling back rejected drafts stays a pointer move: a sequence's
committed length lives in the engine's `Sequence`, and rows past it are overwritten next step.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

import torch

from verispec.cache.kv import LayerCacheSpec, RecurrentLayerSpec, _PendingRecurrent
from verispec.kernels import kv_fp8, kv_turboquant
from verispec.kernels.kv_write import KVDestination

SCRATCH = 0  # block id / state slot that padded rows use


class BlockAllocator:
    """Hands out block ids 1..num_blocks-1 (0 is scratch) and takes them back, with reference
    counts so that sequences can share blocks (the prefix cache).

    A full block whose K/V are committed can be *registered* under the chained hash of its tokens
    (verispec/cache/prefix.py). A registered block that no sequence holds any more is not freed
    but kept, least recently used first, until a new block is needed and no unregistered one is
    free: then it is evicted (its hash forgotten, `on_evict(block, hash)` called) and handed out.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a paged cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # unregistered, unreferenced; handed out last-freed first, so a server touches only the
        # blocks its peak load needed (first-freed first walked the whole pool, and a CPU process's
        # resident memory grew by its never-used pages request after request)
        self._free: deque[int] = deque(range(num_blocks - 1, 0, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.on_evict: Callable[[int, bytes], None] = lambda block, block_hash: None
        self.num_evictions = 0

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered blocks (held or not): what a new prompt can hit."""
        return len(self._by_hash)

    @property
    def num_cached_idle(self) -> int:
        """Registered blocks no sequence holds (kept until their memory is needed)."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise MemoryError(f"{count} KV blocks requested, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
                self.num_evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. A sequence's tail goes first, so under memory pressure
        its last blocks are evicted before its first ones (a shorter prefix stays cached)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if self._refs[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ---- the prefix cache -------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def share(self, block: int) -> None:
        """One more holder of a registered block (a prefix-cache hit)."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def register(self, block: int, block_hash: bytes) -> bool:
        """Name a held, full, committed block by its hash; False when another block already has it
        (two sequences computed the same prefix at once: the second copy stays private)."""
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def rename(self, block_hash: bytes, block: int) -> None:
        """Move a registered hash to `block` (held, full, committed, unregistered): the block that
        had it becomes unregistered, free once nobody holds it; nothing is evicted."""
        other = self._by_hash[block_hash]
        del self._hash_of[other]
        if self._refs[other] == 0:
            del self._evictable[other]
            self._free.append(other)
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        del self._by_hash[block_hash]
        self.on_evict(block, block_hash)


class SlotAllocator:
    """Recurrent-state slots 1..num_slots-1 (0 is scratch), one per running sequence."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free recurrent state slot")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        self._free.append(slot)


# --kv-cache-dtype: what the pools store (auto: the model's dtype; docs/serving.md#kv-cache-compression)
KV_CACHE_DTYPES = ("auto", "fp8", *kv_turboquant.FORMATS)


def kv_bytes_per_token(specs: list, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    if kv_cache_dtype == "fp8":
        return sum(kv_fp8.bytes_per_token(s.num_kv_heads, s.head_dim) for s in specs if isinstance(s, LayerCacheSpec))
    if kv_cache_dtype in kv_turboquant.FORMATS:
        fmt = kv_turboquant.FORMATS[kv_cache_dtype]
        return sum(fmt.bytes_per_token(s.num_kv_heads, s.head_dim) for s in specs if isinstance(s, LayerCacheSpec))
    item = torch.empty((), dtype=dtype).element_size()
    return sum(2 * s.num_kv_heads * s.head_dim * item for s in specs if isinstance(s, LayerCacheSpec))


def state_bytes_per_slot(specs: list, dtype: torch.dtype) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    ssm_item = max(item, 4)  # the SSM state is float32 at least
    return sum(s.conv_dim * (s.conv_kernel - 1) * item + s.num_heads * s.key_dim * s.value_dim * ssm_item
               for s in specs if isinstance(s, RecurrentLayerSpec))


class PagedPools:
    """One model's paged storage (a target's, or a drafter's own layers). Layers whose spec is
    None (K/V shared with another layer) get no pool. kv_cache_dtype "fp8": keys and values are
    stored as e4m3 codes with a scale exponent per (row, head) in key_scales / value_scales
    (kernels/kv_fp8.py). "tq4" / "tq3": packed codes of the layer's rotated rows ([slots, Hkv, D *
    bits / 8] uint8) with a float32 scale per (row, head) there, read and written through the
    layer's `codecs[layer]` (kernels/kv_turboquant.py). `dtype` stays the activations' dtype they
    decode to."""

    def __init__(self, specs: list, num_blocks: int, block_size: int, num_state_slots: int,
                 dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        self.specs = specs
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.device = torch.device(device)
        slots = num_blocks * block_size
        # On the CPU the pools are left unwritten (the OS maps pages on first touch, so only blocks in
        # use take memory) and each block is zeroed when handed out (zero_blocks): rows nobody wrote
        # must be finite, since masked attention still multiplies them by a zero weight.
        self.lazy = self.device.type == "cpu"
        alloc = torch.empty if self.lazy else torch.zeros
        self.keys: list[torch.Tensor | None] = []  # per layer [slots, Hkv, D]
        self.values: list[torch.Tensor | None] = []
        self.key_scales: list[torch.Tensor | None] = []  # fp8: per layer [slots, Hkv] uint8 exponents; tq: float32
        self.value_scales: list[torch.Tensor | None] = []
        self.codecs: list[kv_turboquant.LayerCodec | None] = []  # tq: each layer's rotation and codebooks
        self.conv_states: dict[int, torch.Tensor] = {}  # [state slots, conv_dim, kernel - 1]
        self.ssm_states: dict[int, torch.Tensor] = {}  # [state slots, H, Dk, Dv] float32
        fp8 = kv_cache_dtype == "fp8"
        tq = kv_turboquant.FORMATS.get(kv_cache_dtype)
        code_dtype = kv_fp8.CODE_DTYPE if fp8 else dtype
        for i, spec in enumerate(specs):
            if not isinstance(spec, LayerCacheSpec):
                for pools in (self.keys, self.values, self.key_scales, self.value_scales, self.codecs):
                    pools.append(None)
                continue
            heads, dim = spec.num_kv_heads, spec.head_dim
            if tq is not None:
                codec = kv_turboquant.LayerCodec.build(tq, i, dim, self.device)
                self.codecs.append(codec)
                self.keys.append(alloc(slots, heads, dim * tq.key_bits // 8, dtype=torch.uint8, device=device))
                self.values.append(alloc(slots, heads, dim * tq.value_bits // 8, dtype=torch.uint8, device=device))
                self.key_scales.append(alloc(slots, heads, dtype=torch.float32, device=device))
                self.value_scales.append(alloc(slots, heads, dtype=torch.float32, device=device))
                continue
            self.codecs.append(None)
            self.keys.append(alloc(slots, heads, dim, dtype=code_dtype, device=device))
            self.values.append(alloc(slots, heads, dim, dtype=code_dtype, device=device))
            self.key_scales.append(alloc(slots, heads, dtype=kv_fp8.SCALE_DTYPE, device=device) if fp8 else None)
            self.value_scales.append(alloc(slots, heads, dtype=kv_fp8.SCALE_DTYPE, device=device) if fp8 else None)
        # Recurrent layers of one shape share one stacked tensor ([layers, slots, ...]; each layer's
        # state is a view of it), so taking or restoring a slot's whole state (prefix-cache
        # snapshots) is one copy per stack, not two per layer.
        groups: dict[tuple, list[int]] = {}
        for i, spec in enumerate(specs):
            if isinstance(spec, RecurrentLayerSpec):
                key = (spec.conv_dim, spec.conv_kernel, spec.num_heads, spec.key_dim, spec.value_dim)
                groups.setdefault(key, []).append(i)
        self._state_stacks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (conv_dim, kernel, heads, key_dim, value_dim), layers in groups.items():
            conv = torch.zeros(len(layers), num_state_slots, conv_dim, kernel - 1, dtype=dtype, device=device)
            ssm = torch.zeros(len(layers), num_state_slots, heads, key_dim, value_dim,
                              dtype=torch.promote_types(dtype, torch.float32), device=device)
            self._state_stacks.append((conv, ssm))
            for j, i in enumerate(layers):
                self.conv_states[i], self.ssm_states[i] = conv[j], ssm[j]

        if self.lazy:
            self.zero_blocks([SCRATCH])

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    def _kv_pools(self) -> list[torch.Tensor | None]:
        return self.keys + self.values + self.key_scales + self.value_scales

    def decoded(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of pool rows `slots` [N] in the activations' dtype: [N, Hkv, D] each (fp8 rows
        decoded as the kernels decode them in registers; tq rows too, left in the layer's rotated
        basis, which attention's query and output are turned into and out of)."""
        k = self.keys[layer].index_select(0, slots)
        v = self.values[layer].index_select(0, slots)
        codec = self.codecs[layer]
        if codec is not None:
            return (kv_turboquant.decode_rows(k, self.key_scales[layer].index_select(0, slots), codec.key, self.dtype),
                    kv_turboquant.decode_rows(v, self.value_scales[layer].index_select(0, slots), codec.value,
                                              self.dtype))
        if not self.fp8:
            return k, v
        return (kv_fp8.decode_reference(k, self.key_scales[layer].index_select(0, slots), self.dtype),
                kv_fp8.decode_reference(v, self.value_scales[layer].index_select(0, slots), self.dtype))

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero newly handed-out blocks of lazily allocated (CPU) pools; a no-op otherwise."""
        if not self.lazy or not blocks:
            return
        size = self.block_size
        for pool in self._kv_pools():
            if pool is not None:
                for block in blocks:
                    pool[block * size:(block + 1) * size].zero_()

    @property
    def recurrent_layers(self) -> list[int]:
        return sorted(self.conv_states)

    def clear_state(self, slot: int) -> None:
        """A fresh sequence's recurrent state: zeros."""
        for conv, ssm in self._state_stacks:
            conv[:, slot].zero_()
            ssm[:, slot].zero_()

    def copy_state(self, src: int, dst: int) -> None:
        """Recurrent state slot src -> dst (a prefix-cache snapshot taken or restored)."""
        for conv, ssm in self._state_stacks:
            conv[:, dst].copy_(conv[:, src])
            ssm[:, dst].copy_(ssm[:, src])

    def copy_block(self, src: int, dst: int) -> None:
        """K/V rows of block src -> block dst, every layer (a shared block made private)."""
        size = self.block_size
        for pool in self._kv_pools():
            if pool is not None:
                pool[dst * size:(dst + 1) * size].copy_(pool[src * size:(src + 1) * size])


def slot_table(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_tables [B, N] (block ids), positions [B, T] -> pool row of each position [B, T].
    Positions past a table's end map into the scratch block (the table is padded with 0s)."""
    column = torch.clamp(positions // block_size, max=block_tables.shape[1] - 1)
    blocks = block_tables.gather(1, column)
    blocks = torch.where(positions // block_size < block_tables.shape[1], blocks, SCRATCH)
    return blocks * block_size + positions % block_size


class BatchCache:
    """The cache one forward pass sees: B sequences in the shared pools.

    block_tables [B, N] long (0-padded), positions [B, T] of this pass's tokens, state_slots [B]
    (recurrent layers; None without any), num_keys: one past the largest position any query reads
    (a host int, so the eager path gathers no more keys than needed).

    row_starts / row_lengths: a prompt pass (one sequence's chunk or several, engine/scheduler.py `prefill_groups`)
    gives each row's first position and real token count (host ints); rows are padded to T at
    their end. Attention then runs per sequence, the call it would make alone, and `valid_rows`
    marks the real tokens, so that recurrent layers make the padding a no-op (no decay, no write)
    and a row's final state is the one after its own tokens. row_lengths_on_device: a captured prompt
    pass's real row count, a static device buffer [B] (its host counts change at every replay:
    engine/prompt_graphs.py); the pass then has no host row_starts / row_lengths.
    """

    paged = True
    max_tracked_positions = 16  # passes up to this many tokens keep per-position recurrent states

    def __init__(self, pools: PagedPools, block_tables: torch.Tensor, positions: torch.Tensor,
                 state_slots: torch.Tensor | None, num_keys: int, use_kernel: bool = False,
                 row_starts: list[int] | None = None, row_lengths: list[int] | None = None,
                 prompt_kernel: bool = False, row_lengths_on_device: torch.Tensor | None = None):
        self.pools = pools
        self.block_tables = block_tables
        self.positions = positions
        self.state_slots = state_slots
        self.num_keys = num_keys
        self.use_kernel = use_kernel
        self.row_starts = row_starts
        self.row_lengths = row_lengths
        # exact numerics: prompt chunks attend as decode steps do (kernels/prompt_attention.py
        # `paged_chunk_attention` on CUDA, row by row on a CPU: models/layers/attention.py)
        self.prompt_kernel = prompt_kernel
        self._valid_rows: torch.Tensor | None = None
        self._row_lengths_tensor = row_lengths_on_device
        self.block_size = pools.block_size
        self.write_slots = slot_table(block_tables, positions, self.block_size).reshape(-1)  # [B * T]
        self._read_slots: torch.Tensor | None = None
        self._pending_recurrent: dict[int, _PendingRecurrent] = {}

    @property
    def valid_rows(self) -> torch.Tensor | None:
        """[B, T] bool, True at real tokens: None unless rows are padded (built on first use, by a
        recurrent layer; a drafter's observe pass has none and never builds it)."""
        t = self.positions.shape[1]
        if self._valid_rows is None and self.row_lengths is not None and any(n != t for n in self.row_lengths):
            lengths = torch.tensor(self.row_lengths, device=self.positions.device)
            self._valid_rows = torch.arange(t, device=self.positions.device)[None] < lengths[:, None]
        return self._valid_rows

    @property
    def prompt_pass(self) -> bool:
        """A prompt chunk's pass (rows padded at their ends), not a decode step or verify pass."""
        return self.row_lengths is not None or self._row_lengths_tensor is not None

    def padded_row_lengths(self) -> torch.Tensor | None:
        """row_lengths on the device when some row is padded (None: every row is real)."""
        t = self.positions.shape[1]
        if self._row_lengths_tensor is None and self.row_lengths is not None and any(n != t for n in self.row_lengths):
            self._row_lengths_tensor = torch.tensor(self.row_lengths, device=self.positions.device)
        return self._row_lengths_tensor

    # ---- attention layers -------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] into the pool rows of this pass's positions (capturable)."""
        self.kv_destination(layer).write(k, v)

    def kv_destination(self, layer: int) -> KVDestination:
        """Where `write` would put this pass's rows, for a kernel that writes them itself."""
        pools = self.pools
        return KVDestination(pools.keys[layer], pools.values[layer], self.write_slots, row_dim=0,
                             batch_dim=None, head_dim=1, k_scale=pools.key_scales[layer],
                             v_scale=pools.value_scales[layer], codec=pools.codecs[layer])

    def read_slots(self) -> torch.Tensor:
        """Pool rows of positions 0..num_keys-1 for every sequence: [B, num_keys] (built once a pass)."""
        if self._read_slots is None:
            b = self.block_tables.shape[0]
            key_positions = torch.arange(self.num_keys, device=self.block_tables.device).expand(b, -1)
            self._read_slots = slot_table(self.block_tables, key_positions, self.block_size)
        return self._read_slots

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions 0..num_keys-1 for every sequence: [B, Hkv, num_keys, D] each, in the
        activations' dtype (rows past a sequence's own positions are other data or scratch: queries
        mask them)."""
        slots = self.read_slots()
        # index_select: a plain row copy, 4x faster than indexing on a CPU
        k, v = self.pools.decoded(layer, slots.reshape(-1))
        return k.unflatten(0, slots.shape).transpose(1, 2), v.unflatten(0, slots.shape).transpose(1, 2)

    # ---- recurrent layers -------------------------------------------------------------------------
    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed (conv state [B, conv_dim, kernel-1], SSM state [B, H, Dk, Dv] float32)."""
        slots = self.state_slots
        return self.pools.conv_states[layer].index_select(0, slots), self.pools.ssm_states[layer].index_select(0, slots)

    def set_recurrent_pending(self, layer: int, conv_window: torch.Tensor, ssm_states: torch.Tensor,
                              per_position: bool) -> None:
        """conv_window [B, conv_dim, kernel-1+T], ssm_states [T or 1, B, H, Dk, Dv]."""
        self._pending_recurrent[layer] = _PendingRecurrent(conv_window, ssm_states, per_position)

    def pending_recurrent_snapshot(self) -> dict:
        return dict(self._pending_recurrent)

    def restore_pending_recurrent(self, snapshot: dict) -> None:
        self._pending_recurrent = dict(snapshot)

    def commit_on_device(self, counts: torch.Tensor) -> None:
        """commit() with the row counts already on the device (counts [B] long, each >= 1), with no
        host work: what a captured commit graph replays. Rows whose state slot is the scratch
        slot (padding) write there."""
        if self._pending_recurrent:
            self._write_states(torch.arange(counts.shape[0], device=counts.device), counts)

    def commit(self, num_rows: list[int]) -> None:
        """Keep the first num_rows[b] rows of this pass for sequence b: its recurrent state becomes
        the one after that many positions (K/V need nothing: lengths live in the sequences)."""
        if not self._pending_recurrent:
            return
        keep = [b for b, n in enumerate(num_rows) if n > 0]
        if not keep:
            return
        for layer, p in self._pending_recurrent.items():
            t = p.conv_window.shape[-1] - (self.pools.specs[layer].conv_kernel - 1)
            whole = self.row_lengths or [t] * len(num_rows)  # a padded row's final state is its own tokens'
            if not p.per_position and any(num_rows[b] != whole[b] for b in keep):
                raise ValueError(f"commit({num_rows}) of a {t}-token pass that kept only its final recurrent "
                                 f"state (passes over {self.max_tracked_positions} tokens keep no per-position states)")
        device = self.state_slots.device
        self._write_states(torch.tensor(keep, device=device),
                           torch.tensor([num_rows[b] for b in keep], device=device))
        self._pending_recurrent.clear()

    def _write_states(self, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Into the state slots of batch rows `rows` [R]: each one's recurrent state after counts [R]
        positions of this pass (a pass without per-position states has only its last)."""
        slots = self.state_slots.index_select(0, rows)
        for layer, p in self._pending_recurrent.items():
            kernel = self.pools.specs[layer].conv_kernel
            states = p.ssm_states  # [T or 1, B, H, Dk, Dv]
            if p.per_position:  # row b's state after counts[b] positions: flat index (n - 1) * B + b
                ssm = states.flatten(0, 1).index_select(0, (counts - 1) * states.shape[1] + rows)
            else:
                ssm = states[-1].index_select(0, rows)
            self.pools.ssm_states[layer].index_copy_(0, slots, ssm.to(self.pools.ssm_states[layer].dtype))
            # conv state after n rows: window[:, :, n : n + kernel - 1]
            index = counts[:, None] + torch.arange(kernel - 1, device=counts.device)[None]  # [R, K-1]
            window = p.conv_window.index_select(0, rows)  # [R, C, K-1+T]
            conv = window.gather(2, index[:, None, :].expand(-1, window.shape[1], -1))
            self.pools.conv_states[layer].index_copy_(0, slots, conv.to(self.pools.dtype))


@dataclass
class CacheBudget:
    """How the paged cache was sized (for the startup log and /metrics)."""

    num_blocks: int
    block_size: int
    num_state_slots: int
    bytes_total: int

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


def block_table_rows(seqs, width: int, pad_rows: int = 0) -> torch.Tensor:
    """Host [B + pad_rows, width] block tables (0 = the scratch block) for a pass's or a captured
    graph's input. Each sequence keeps its row as a tensor (`table_row`), rebuilt only when its
    table grew (every block_size tokens), so a step costs one stack, not B x width Python ints."""
    rows = []
    for s in seqs:
        cached = s.table_row
        if cached is None or cached[0] != len(s.block_table) or cached[1].shape[0] != width:
            row = torch.zeros(width, dtype=torch.long)
            row[:len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
            cached = s.table_row = (len(s.block_table), row)
        rows.append(cached[1])
    if pad_rows:
        rows.extend([torch.zeros(width, dtype=torch.long)] * pad_rows)
    return torch.stack(rows)
