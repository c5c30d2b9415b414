"""Small all-reduces of a tensor-parallel group on one machine's GPUs as one kernel: each rank
copies its part into a buffer every rank can read over NVLink (torch's symmetric memory), then
sums every rank's buffer in rank order (`symm_mem.one_shot_all_reduce_copy`).

Why: a decode step of a split model makes two all-reduces per layer of a few kilobytes each, where
NCCL's latency, not the bytes, sets the time. The sum runs in the same order on every rank, so all
ranks hold the same bits; larger messages (prompt chunks) keep NCCL. NVLink multicast is not used.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from verispec import log

MAX_BYTES = 4 << 20  # the buffer each rank shares, per dtype: decode and verify passes fit, prompt chunks do not


class P2PAllReduce:
    """`fits(x)` -> whether `x` goes this way; `__call__(x)` -> the sum over the ranks (a new tensor).
    Buffers are made at the first all-reduce of each dtype, which every rank makes at the same point."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.numel() * x.element_size() <= MAX_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(x.dtype)
        if buffer is None:
            buffer = self.buffers[x.dtype] = self._make(x.dtype)
        x = x.contiguous()
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[:x.numel()].view(x.shape), x, "sum",
                                                           self.group.group_name)

    def _make(self, dtype: torch.dtype) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=self.device)
        symm_mem.rendezvous(buffer, self.group.group_name)
        return buffer


def make(group, device: torch.device, enabled: bool, one_machine: bool) -> P2PAllReduce | None:
    """The group's small all-reduce over NVLink, or None (NCCL for all), with the reason logged."""
    reason = None
    if not enabled:
        reason = "VERISPEC_P2P_ALL_REDUCE=0"
    elif not one_machine:
        reason = "the ranks span machines"
    elif device.type != "cuda":
        reason = "not on CUDA"
    elif not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        reason = "this torch has no symmetric-memory one-shot all-reduce"
    elif not _peers_reachable(device, dist.get_world_size(group)):
        reason = "the GPUs cannot read each other's memory (no peer access)"
    if reason:
        log.debug("tensor parallel: every all-reduce goes through NCCL: %s", reason)
        return None
    return P2PAllReduce(group, device)


def _peers_reachable(device: torch.device, world_size: int) -> bool:
    """This rank's GPU can read every other rank's (one machine: rank r on GPU r)."""
    index = device.index or 0
    return all(torch.cuda.can_device_access_peer(index, other) for other in range(world_size) if other != index)
