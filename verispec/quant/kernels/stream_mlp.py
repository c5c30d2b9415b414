"""A gated MLP's 4-bit gate_up -> SiLU(gate) * up -> down as one launch of the streaming kernel
(quant/kernels/stream_chain.py) for decode and verify passes: the weights of both products stream into
every multiprocessor's shared memory without a break, where two launches each pay a start and a
tail (H200, Qwen3-8B's shape: 31-32 us against 35.5 at 1 row, 33-34 against 35.5 at 4;
docs/benchmarks.md).

Row independence: every row's sums run in one fixed order whatever the launch's rows are, and a
pass of more than 8 rows (up to `MAX_ROWS`) is launched 8 rows at a time, so a sequence's rows get
the same bits alone, in a verify pass or in a batch. The bits differ from two `frag_gemv` launches
with their own tiles (the warps split K differently): one MLP must take every decode and verify
pass on this path or none (GatedMLP does).
"""
from __future__ import annotations

import torch

from verispec.kernels import launch
from verispec.kernels.launch import gluon
from verispec.quant.kernels import frag, grid_sync, stream_chain

# Each product's step (row tiles, blocks a warp a step): every step fills one slot of 16 blocks (4
# warps x row tiles x blocks). Measured on Qwen3-8B's MLP (H200, us at 1 / 4
# rows, launched 35.7 / 35.4): gate_up 2 x 2 and down 1 x 4 30.3 / 32.8; gate_up 4 x 1 34.7 / 39.1;
# 1 x 4 33.9 / 36.0; down 2 x 2 36.3 / 38.2; 4 x 1 52.8 / 55.9. Other steps lose to the launches, so
# MLPs whose widths do not divide into these steps keep them.
PLAN = ((2, 2), (1, 4))
WARPS = 4  # in each of 2 consumer partitions
PARTS = 2
SLOTS = 3  # a partition's ring (2: 31.8 / 34.6 us; 4: 31.1 / 35.4)
MAX_ROWS = 32  # the widest pass launched in 8-row pieces (dispatch.FRAG_CHUNKED_MAX_ROWS)


def _step_values(blocks: int) -> int:
    """Input values a product's step covers: 4 warps x `blocks` 64-value blocks."""
    return frag.BLOCK * WARPS * blocks


def _steps_reason(gate_up_k: int, down_k: int) -> str | None:
    """Why these input widths have no whole steps of the measured plan (None: they have)."""
    for name, k, (_, kb) in (("gate_up", gate_up_k, PLAN[0]), ("down", down_k, PLAN[1])):
        if k % _step_values(kb):
            return f"{name} input features {k} (a multiple of {_step_values(kb)}: whole steps of the measured plan)"
    return None


def plan_for(gate_up_k: int, down_k: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(gate_up's step, down's step) for these input widths, or None where one has no whole steps."""
    return None if _steps_reason(gate_up_k, down_k) else PLAN


def unsupported_reason(gate_up: frag.FragWeights, down: frag.FragWeights, device: torch.device,
                       dtype: torch.dtype) -> str | None:
    """Why a gated MLP with these fragment-order products cannot run on the streaming kernel (None:
    it can)."""
    if gluon is None:
        return "no Triton Gluon"
    if device.type != "cuda":
        return f"a {device.type} device (the kernel is CUDA's)"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return (f"compute capability {torch.cuda.get_device_capability(device)} (the kernel's TMA copies and "
                f"warp roles are built and measured for sm_90)")
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} activations (bfloat16 / float16 only)"
    for name, fw in (("gate_up", gate_up), ("down", down)):
        if fw.group_size != frag.BLOCK:
            return f"{name} groups of {fw.group_size} values (64 only: one scale row a block)"
        if fw.zero_point:
            return f"{name} zero points (affine scale and bias only)"
    if reason := _steps_reason(gate_up.in_features, down.in_features):
        return reason
    if down.in_features * 2 != gate_up.out_features:
        return f"down's {down.in_features} inputs are not half of gate_up's {gate_up.out_features} outputs"
    return None


class StreamMLP:
    """gate_up (rows interleaved for SiLU(gate) * up, as frag.py's epilogue reads them) and down
    of one MLP on the streaming kernel. Made once after the weights are final: the TMA descriptors
    hold the fragment-order copies' addresses."""

    def __init__(self, gate_up: frag.FragWeights, down: frag.FragWeights, dtype: torch.dtype):
        device = gate_up.words.device
        if reason := unsupported_reason(gate_up, down, device, dtype):
            raise ValueError(f"StreamMLP: {reason}")
        self.fws = (gate_up, down)
        self.dtype = dtype
        self.plan = plan_for(gate_up.in_features, down.in_features)
        self.descs = stream_chain.descriptors(self.fws, self.plan, WARPS)
        self.programs = programs_for(device, dtype, self.fws, self.plan, self.descs)
        self.counter = grid_sync.counter_for(device, PARTS * self.programs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] (M <= MAX_ROWS) -> [M, N]
        rows = x.shape[0]
        if rows > MAX_ROWS or x.dtype != self.dtype:
            raise ValueError(f"StreamMLP: {rows} rows of {x.dtype} (at most {MAX_ROWS} of {self.dtype})")
        down = self.fws[1]
        x = x.contiguous()
        y = torch.empty(rows, down.out_features, dtype=x.dtype, device=x.device)
        pieces = zip(x.split(frag.MAX_ROWS), y.split(frag.MAX_ROWS))
        for part, out in pieces:
            h = torch.empty(part.shape[0], down.in_features, dtype=x.dtype, device=x.device)
            _launch(part, h, out, self.fws, self.plan, self.counter, self.programs, self.descs)
        return y


def _launch(x, h, y, fws, plan, counter, programs: int, descs, compile_only: bool = False):
    return stream_chain.stream_chain(x, x, h, y, fws, plan, counter, programs, SLOTS, WARPS, compile_only=compile_only,
                                     descs=descs, parts=PARTS, pdl=launch.pdl_enabled(x.device))


_PROGRAMS: dict[tuple, int] = {}


def programs_for(device: torch.device, dtype: torch.dtype, fws, plan, descs) -> int:
    """The launch's program count: every program resident at once (the grid barrier's condition), as
    many as the driver's occupancy query says fit (one a multiprocessor on the GPUs measured). Asked once per
    compiled kernel (its shapes, plan and dtype), not once per MLP of a model."""
    gate_up, down = fws
    key = (torch.device(device), dtype, plan, gate_up.out_features, gate_up.in_features, down.out_features,
           down.in_features)
    if key not in _PROGRAMS:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        x = torch.zeros(1, gate_up.in_features, dtype=dtype, device=device)
        h = torch.empty(1, down.in_features, dtype=dtype, device=device)
        y = torch.empty(1, down.out_features, dtype=dtype, device=device)
        # one program a multiprocessor (the count is compiled in): the driver must fit at least one
        kernel = _launch(x, h, y, fws, plan, grid_sync.counter_for(device, PARTS * sms), sms, descs,
                         compile_only=True)
        if grid_sync.resident_per_multiprocessor(kernel, kernel.metadata.num_warps) < 1:
            raise RuntimeError("StreamMLP: the streaming kernel does not fit on a multiprocessor")
        _PROGRAMS[key] = sms
    return _PROGRAMS[key]
