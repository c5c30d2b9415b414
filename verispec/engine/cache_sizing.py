"""How big the paged cache is: blocks, recurrent-state slots and prefix-cache snapshots, from the
memory budget (`--kv-cache-gb`, or `--gpu-memory-utilization` of the free GPU memory; 2 GiB on
the CPU, where pools take memory only as blocks are used)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec import log
from verispec.cache.kv import RecurrentLayerSpec
from verispec.cache.paged import kv_bytes_per_token, state_bytes_per_slot
from verispec.config import EngineConfig
from verispec.errors import VerispecError

CPU_KV_CACHE_GB = 2.0
SNAPSHOT_BUDGET_FRACTION = 0.1  # of the KV budget, for the prefix cache's recurrent-state snapshots
SNAPSHOTS_PER_SEQUENCE = 4


@dataclass
class CacheSizes:
    num_blocks: int  # block 0 included (scratch)
    block_size: int
    num_state_slots: int  # running sequences' recurrent-state slots, slot 0 included (0: no recurrent layers)
    num_snapshots: int  # prefix-cache snapshot slots, after the running ones
    bytes_total: int
    max_model_len: int  # the context served: capped when the cache holds less

    @property
    def capacity(self) -> int:
        return (self.num_blocks - 1) * self.block_size


def size_cache(specs: list, config: EngineConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
               num_drafts: int) -> CacheSizes:
    per_token = max(kv_bytes_per_token(specs, dtype, config.kv_cache_dtype), 1)
    hybrid = any(isinstance(s, RecurrentLayerSpec) for s in specs)
    num_slots = config.max_num_seqs + 1 if hybrid else 0
    state_bytes = state_bytes_per_slot(specs, dtype)
    if config.kv_cache_gb is not None:
        budget = int(config.kv_cache_gb * 2**30)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int(CPU_KV_CACHE_GB * 2**30)
    num_snapshots = 0
    if hybrid and config.prefix_cache:
        num_snapshots = min(SNAPSHOTS_PER_SEQUENCE * config.max_num_seqs,
                            int(SNAPSHOT_BUDGET_FRACTION * budget) // max(state_bytes, 1))
    budget -= state_bytes * (num_slots + num_snapshots)
    block = config.block_size
    # never more than every sequence at full context needs (a small model would otherwise take GBs)
    most = config.max_num_seqs * (max_model_len + num_drafts + 1) + block
    num_blocks = min(budget // (per_token * block), -(-most // block) + 1)
    lookahead = num_drafts + 1
    if num_blocks < 2 or (num_blocks - 1) * block < lookahead + 1:
        raise VerispecError(f"the KV cache budget ({budget / 2**30:.2f} GiB after recurrent state) holds "
                            f"{max(num_blocks - 1, 0) * block} tokens, too few to serve one sequence; raise "
                            "--kv-cache-gb or --gpu-memory-utilization")
    capacity = (num_blocks - 1) * block
    if capacity - lookahead < max_model_len:
        log.info("the KV cache holds %d tokens, fewer than the %d-token context: the context is %d "
                 "tokens (raise --kv-cache-gb / --gpu-memory-utilization, or set --max-model-len)",
                 capacity, max_model_len, capacity - lookahead)
        max_model_len = capacity - lookahead
    return CacheSizes(num_blocks, block, num_slots, num_snapshots,
                      num_blocks * block * per_token + state_bytes * (num_slots + num_snapshots), max_model_len)
