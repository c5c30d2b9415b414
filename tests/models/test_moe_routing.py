"""The Qwen MoE MLP (models/layers/sparse_moe.py) and the fused experts under it, against a plain
torch reference written row by row: softmax over all experts, top-k, optional renormalisation,
each chosen expert's down(act(gate x) * up x) weighted and summed, plus the shared expert scaled by
sigmoid(shared_expert_gate x). At 1, 4, 8 and 64 rows, with random routings, routings that hit every
expert, and one expert chosen by every row. Float64, so any difference beyond summation order
(the experts' loop adds them in expert order, the reference in slot order) is a bug.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from verispec.models.layers import moe
from verispec.models.layers.sparse_moe import MoeSettings, SparseMoeBlock, softmax_top_k

ROWS = (1, 4, 8, 64)
NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 32, 16
# float64 results that differ only in the order of a handful of additions
ATOL, RTOL = 1e-12, 1e-12
# torch's grouped GEMM runs float32 only on the CPU: measured <= 2.4e-7 against the float64 reference
FLOAT32_ATOL, FLOAT32_RTOL = 2e-6, 1e-5
ROUTINGS = ("random", "every_expert", "one_expert_for_all")


def reference_experts(x, gate_up, down, index, weights):
    """x [N, H]; gate_up [E, 2I, H]; down [E, H, I]; index, weights [N, K] -> [N, H], one row and
    one slot at a time."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[n, slot])
            gate, up = (gate_up[e] @ x[n]).chunk(2)
            out[n] += weights[n, slot] * (down[e] @ (F.silu(gate) * up))
    return out


def routing(kind: str, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, K], weights [N, K]); K distinct experts per row, as top-k gives."""
    top_k = TOP_K
    if kind == "every_expert":  # enough slots that the rows together cover all experts
        top_k = min(NUM_EXPERTS, max(TOP_K, math.ceil(NUM_EXPERTS / rows)))
        index = torch.stack([(torch.arange(top_k) + n * top_k) % NUM_EXPERTS for n in range(rows)])
    else:
        index = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:top_k] for _ in range(rows)])
        if kind == "one_expert_for_all":
            shared = 3
            for n in range(rows):
                if shared not in index[n]:
                    index[n, int(torch.randint(0, top_k, (1,), generator=gen))] = shared
            assert bool((index == shared).any(dim=1).all())
    if kind == "every_expert":
        assert set(index.flatten().tolist()) == set(range(NUM_EXPERTS))
    return index, torch.rand(rows, top_k, generator=gen, dtype=torch.float64)


def random_experts(gen: torch.Generator, dtype=torch.float64) -> moe.FusedExperts:
    experts = moe.FusedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE, "silu").to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.3)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.3)
    return experts


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("rows", ROWS)
def test_fused_experts_match_reference(rows, kind):
    """Every CPU path of FusedExperts (loop: the default there; gathered: static shapes)."""
    gen = torch.Generator().manual_seed(rows * 10 + ROUTINGS.index(kind))
    experts = random_experts(gen)
    x = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64)
    index, weights = routing(kind, rows, gen)
    ref = reference_experts(x, experts.gate_up_proj, experts.down_proj, index, weights)
    for method in (moe.ExpertsMethod.LOOP, moe.ExpertsMethod.GATHERED):
        experts.method = method
        with torch.inference_mode():
            got = experts(x, index, weights)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{method.value}: {m}")


@pytest.mark.parametrize("rows", ROWS)
def test_grouped_experts_match_reference(rows):
    """The grouped GEMM (CUDA's prefill path) where torch runs it on the CPU: float32."""
    gen = torch.Generator().manual_seed(rows)
    experts = random_experts(gen, torch.float32)
    x = torch.randn(rows, HIDDEN, generator=gen)
    if not moe.grouped_mm_usable(x, 2 * INTERMEDIATE, INTERMEDIATE):
        pytest.skip("torch's grouped_mm does not run here")
    index, weights = routing("every_expert", rows, gen)
    experts.method = moe.ExpertsMethod.GROUPED
    with torch.inference_mode():
        got = experts(x, index, weights.float())
    ref = reference_experts(x.double(), experts.gate_up_proj.double(), experts.down_proj.double(), index, weights)
    torch.testing.assert_close(got.double(), ref, atol=FLOAT32_ATOL, rtol=FLOAT32_RTOL)


def reference_block(block: SparseMoeBlock, x: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """x [N, H]: per row, softmax over all experts, top-k, (renormalised), experts, shared expert."""
    out = torch.zeros_like(x)
    e = block.experts
    for n in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight @ x[n], dim=-1)
        weights, index = torch.topk(probs, block.top_k)
        if renormalize:
            weights = weights / weights.sum()
        out[n] = reference_experts(x[n:n + 1], e.gate_up_proj, e.down_proj, index[None], weights[None])[0]
        if block.shared_expert is not None:
            s = block.shared_expert
            shared = s.down_proj.weight @ (F.silu(s.gate_proj.weight @ x[n]) * (s.up_proj.weight @ x[n]))
            out[n] += torch.sigmoid(block.shared_expert_gate.weight @ x[n]) * shared
    return out


def random_block(gen: torch.Generator, renormalize: bool, shared: bool) -> SparseMoeBlock:
    s = MoeSettings(NUM_EXPERTS, TOP_K, INTERMEDIATE, renormalize, shared_intermediate_size=24 if shared else 0)
    block = s.block(HIDDEN, "silu").double()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


@pytest.mark.parametrize("shared, renormalize", [(False, True), (False, False), (True, True)],
                         ids=["qwen3_moe", "qwen3_moe-unnormalised", "qwen3_5_moe"])
@pytest.mark.parametrize("rows", ROWS)
def test_block_matches_reference(rows, shared, renormalize):
    gen = torch.Generator().manual_seed(100 + rows)
    block = random_block(gen, renormalize, shared)
    x = torch.randn(1, rows, HIDDEN, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        got = block(x)[0]
        _, index = block.route(x[0])
        if rows == 64:  # random routing over enough rows hits every expert
            assert set(index.flatten().tolist()) == set(range(NUM_EXPERTS))
    torch.testing.assert_close(got, reference_block(block, x[0], renormalize), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("rows", ROWS)
def test_block_with_one_expert_chosen_by_every_row(rows):
    """The router strongly prefers expert 5 along a direction every row shares."""
    gen = torch.Generator().manual_seed(200 + rows)
    block = random_block(gen, renormalize=True, shared=True)
    common = torch.randn(HIDDEN, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        block.gate.weight[5] = 4 * common / common.norm()
    x = torch.randn(1, rows, HIDDEN, generator=gen, dtype=torch.float64) * 0.3 + common
    with torch.inference_mode():
        got = block(x)[0]
        _, index = block.route(x[0])
    assert bool((index[:, 0] == 5).all())
    torch.testing.assert_close(got, reference_block(block, x[0], True), atol=ATOL, rtol=RTOL)


def test_softmax_top_k_dtypes():
    """Weights come back in the logits' dtype, rounded from a float32 softmax (float64 stays)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, NUM_EXPERTS, generator=gen)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        weights, index = softmax_top_k(logits.to(dtype), TOP_K, renormalize=True)
        assert weights.dtype == dtype and index.shape == (5, TOP_K)
        ref = torch.softmax(logits.to(dtype).to(torch.float64 if dtype == torch.float64 else torch.float32), -1)
        top, ref_index = torch.topk(ref, TOP_K)
        assert torch.equal(index, ref_index)
        torch.testing.assert_close(weights, (top / top.sum(-1, keepdim=True)).to(dtype), atol=0, rtol=0)
