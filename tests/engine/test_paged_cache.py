"""The paged cache's pieces: the block allocator, slot tables, and the two recurrent commits."""
from __future__ import annotations

import pytest
import torch

from verispec.cache.kv import LayerCacheSpec, RecurrentLayerSpec
from verispec.cache.paged import SCRATCH, BatchCache, BlockAllocator, PagedPools, slot_table


def test_allocator_hands_out_each_block_once_and_never_the_scratch_block():
    blocks = BlockAllocator(9, 4)
    got = blocks.allocate(5) + blocks.allocate(3)
    assert sorted(got) == list(range(1, 9)) and SCRATCH not in got and blocks.num_free == 0
    with pytest.raises(MemoryError):
        blocks.allocate(1)
    blocks.free(got[:2])
    assert blocks.num_free == 2 and blocks.num_used == 6 and blocks.blocks_for(9) == 3


def test_freed_blocks_are_handed_out_again_before_untouched_ones():
    """Last-freed first: a server that serves one request after another reuses the same few blocks,
    so a CPU process's pool pages are touched only as far as its peak load needed."""
    alloc = BlockAllocator(num_blocks=64, block_size=4)
    first = alloc.allocate(3)
    assert first == [1, 2, 3]
    alloc.free(first)
    assert alloc.allocate(3) == first
    more = alloc.allocate(2)
    assert more == [4, 5]


def test_slot_table_maps_positions_through_block_tables_and_past_the_end_to_scratch():
    tables = torch.tensor([[3, 1, 0], [2, 0, 0]])
    positions = torch.tensor([[0, 5, 9, 12], [1, 3, 4, 13]])
    # block size 4: row 0 position 5 -> block 1 offset 1 = 5; position 9 -> third column = 0 (scratch)
    assert slot_table(tables, positions, 4).tolist() == [[12, 5, 1, 0], [9, 11, 0, 1]]


def test_lazy_cpu_pools_zero_the_blocks_they_hand_out():
    pools = PagedPools([LayerCacheSpec(2, 4)], 4, 2, 1, torch.float32, "cpu")
    pools.keys[0][2:4].fill_(float("nan"))
    pools.zero_blocks([1])
    assert torch.equal(pools.keys[0][2:4], torch.zeros(2, 2, 4)) and torch.equal(pools.keys[0][0:2], torch.zeros(2, 2, 4))


def test_commit_on_device_equals_the_host_commit():
    spec = RecurrentLayerSpec(conv_dim=6, conv_kernel=4, num_heads=2, key_dim=3, value_dim=5)
    gen = torch.Generator().manual_seed(0)
    b, t = 3, 4
    window = torch.randn(b, 6, 3 + t, generator=gen)
    states = torch.randn(t, b, 2, 3, 5, generator=gen)
    results = []
    for on_device in (False, True):
        pools = PagedPools([spec], 2, 4, 5, torch.float32, "cpu")
        cache = BatchCache(pools, torch.zeros(b, 1, dtype=torch.long), torch.zeros(b, t, dtype=torch.long),
                           torch.tensor([4, 1, 3]), 1)
        cache.set_recurrent_pending(0, window, states, True)
        if on_device:
            cache.commit_on_device(torch.tensor([2, 1, 4]))
        else:
            cache.commit([2, 1, 4])
        results.append((pools.conv_states[0].clone(), pools.ssm_states[0].clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    conv, ssm = results[0]
    assert torch.equal(ssm[4], states[1, 0]) and torch.equal(ssm[1], states[0, 1]) and torch.equal(ssm[3], states[3, 2])
    assert torch.equal(conv[4], window[0, :, 2:5]) and torch.equal(conv[3], window[2, :, 4:7])
    assert not ssm[2].any()  # a slot no sequence holds is untouched
