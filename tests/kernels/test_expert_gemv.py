"""The MoE decode kernels (routing, the union of experts' products, the weighted sum) against
torch's own operations, and the MoE layer's `gemv` method against transformers' reference experts
loop. Runs on CUDA, and on CPU through Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.kernels import expert_gemv as kernel
from verispec.models.layers.moe import ExpertsMethod, FusedExperts

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routings(tokens: int, top_k: int, experts: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[tokens, top_k] distinct experts per token: random, every expert hit (tokens * top_k >= experts),
    or one expert (0) chosen by every token."""
    rows = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    if kind == "all-hit":
        order = torch.randperm(experts, generator=gen)
        rows = [torch.roll(order, -t * top_k)[:top_k] for t in range(tokens)]
    if kind == "one-for-all":
        rows = [torch.cat([torch.tensor([0]), torch.randperm(experts - 1, generator=gen)[:top_k - 1] + 1])[
            torch.randperm(top_k, generator=gen)] for _ in range(tokens)]
    return torch.stack(rows).to(DEVICE)


def _reference(x, weight, ids, x_per_pair, act=None):
    t, k = ids.shape
    rows = [x[p] if x_per_pair else x[p // k] for p in range(t * k)]
    y = torch.stack([F.linear(rows[p].double(), weight[ids.reshape(-1)[p]].double()) for p in range(t * k)])
    if act is not None:
        gate, up = y.chunk(2, dim=-1)
        y = act(gate) * up
    return y


@pytest.mark.parametrize("tokens,kind", [(1, "random"), (4, "random"), (8, "all-hit"), (16, "one-for-all")])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_union_products_match_per_pair_products(tokens, kind, dtype, tol):
    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, n, kd = 8, 2, 40, 96
    weight = torch.randn(experts, n, kd, generator=gen).to(dtype).to(DEVICE)
    ids = _routings(tokens, top_k, experts, kind, gen)
    for x_per_pair in (False, True):
        x = torch.randn(tokens * top_k if x_per_pair else tokens, kd, generator=gen).to(dtype).to(DEVICE)
        y = kernel.union_products(x, weight, ids, x_per_pair=x_per_pair)
        ref = _reference(x, weight, ids, x_per_pair)
        assert y.dtype == dtype and y.shape == (tokens * top_k, n)
        assert float((y.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("act_name", ["silu", "gelu_pytorch_tanh"])
def test_gated_products_apply_the_activation(act_name):
    gen = torch.Generator().manual_seed(3)
    experts, top_k, inter, hidden = 6, 3, 24, 64
    weight = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3).to(DEVICE)
    ids = _routings(5, top_k, experts, "random", gen)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE)
    act = {"silu": F.silu, "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh")}[act_name]
    y = kernel.union_products(x, weight, ids, x_per_pair=False, gated_act=act_name)
    torch.testing.assert_close(y.double(), _reference(x, weight, ids, False, act), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,block_m", [(3, 16), (40, 16), (40, 64)])
def test_grouped_products_match_per_pair_products(tokens, block_m):
    gen = torch.Generator().manual_seed(tokens + block_m)
    experts, top_k, inter, hidden = 6, 2, 24, 64
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3).to(DEVICE)
    ids = _routings(tokens, top_k, experts, "random", gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    h = kernel.grouped_products(x, gate_up, ids, x_per_pair=False, gated_act="silu", block_m=block_m, block_n=16)
    torch.testing.assert_close(h.double(), _reference(x, gate_up, ids, False, F.silu), rtol=1e-5, atol=1e-5)
    down = torch.randn(experts, hidden, inter, generator=gen).to(DEVICE)
    y = kernel.grouped_products(h, down, ids, x_per_pair=True, block_m=block_m, block_n=16)
    torch.testing.assert_close(y.double(), _reference(h, down, ids, True), rtol=1e-5, atol=1e-5)


def test_expert_blocks_cover_every_pair_once_one_expert_a_block():
    gen = torch.Generator().manual_seed(2)
    ids = _routings(30, 3, 8, "one-for-all", gen)  # expert 0 has 30 pairs: three blocks of 12
    order, expert, start, rows = kernel.expert_blocks(ids, 8, block_m=12)
    flat = ids.reshape(-1).cpu()
    seen = []
    for b in range(rows.numel()):
        pairs = order[start[b]:start[b] + rows[b]].cpu()
        assert rows[b] <= 12 and bool((flat[pairs] == expert[b].cpu()).all())
        seen += pairs.tolist()
    assert sorted(seen) == list(range(flat.numel()))
    assert int((rows[expert == 0]).sum()) == 30 and int((rows == 12).sum()) >= 2


def test_a_pair_gets_the_same_bits_from_the_union_and_the_grouped_kernels():
    """Exact numerics runs decode steps on the union kernel and prompts on the grouped one."""
    gen = torch.Generator().manual_seed(8)
    experts, top_k, inter, hidden = 8, 2, 32, 64
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    down = torch.randn(experts, hidden, inter, generator=gen).to(torch.bfloat16).to(DEVICE)
    ids = _routings(12, top_k, experts, "random", gen)
    x = torch.randn(12, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    for block_m in (16, 64):
        grouped = kernel.grouped_products(x, gate_up, ids, x_per_pair=False, gated_act="silu", block_m=block_m)
        union = kernel.union_products(x, gate_up, ids, x_per_pair=False, gated_act="silu")
        assert torch.equal(grouped, union)
        assert torch.equal(kernel.grouped_products(union, down, ids, x_per_pair=True, block_m=block_m),
                           kernel.union_products(union, down, ids, x_per_pair=True))


def test_a_tokens_products_do_not_depend_on_the_other_tokens():
    gen = torch.Generator().manual_seed(5)
    experts, top_k, inter, hidden = 8, 2, 32, 64
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    ids = _routings(16, top_k, experts, "random", gen)
    x = torch.randn(16, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    together = kernel.union_products(x, gate_up, ids, x_per_pair=False, gated_act="silu")
    for t in (0, 7, 15):
        alone = kernel.union_products(x[t:t + 1], gate_up, ids[t:t + 1], x_per_pair=False, gated_act="silu")
        assert torch.equal(alone, together[t * top_k:(t + 1) * top_k])


def test_rejects_what_it_cannot_compute():
    w = torch.zeros(2, 4, 8, device=DEVICE)
    ids = torch.zeros(2, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="one x row per token"):
        kernel.union_products(torch.zeros(3, 8, device=DEVICE), w, ids, x_per_pair=False)
    with pytest.raises(ValueError, match="K"):
        kernel.union_products(torch.zeros(2, 9, device=DEVICE), w, ids, x_per_pair=False)
    with pytest.raises(ValueError, match="one x row per token"):
        kernel.grouped_products(torch.zeros(3, 8, device=DEVICE), w, ids, x_per_pair=False)
    with pytest.raises(ValueError, match="at most 16"):
        kernel.union_products(torch.zeros(17, 8, device=DEVICE), w, torch.zeros(17, 1, dtype=torch.long,
                                                                                  device=DEVICE), x_per_pair=False)
    with pytest.raises(ValueError, match="not fused"):
        kernel.union_products(torch.zeros(2, 8, device=DEVICE), w, ids, x_per_pair=False, gated_act="relu")


@pytest.mark.parametrize("experts,top_k,renormalize,scaled", [(128, 8, True, False), (20, 3, False, False),
                                                               (64, 4, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_torch(experts, top_k, renormalize, scaled, dtype):
    gen = torch.Generator().manual_seed(experts)
    # distinct logits exact in bfloat16 (no ties for the top-k to break differently)
    logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(6)]).float() / 16 - 4
    logits = logits.to(dtype).to(DEVICE)
    scale = (torch.rand(experts, generator=gen) + 0.5).to(DEVICE) if scaled else None
    weights, ids = kernel.softmax_top_k(logits, top_k, renormalize, scale, torch.float32)
    ref_w, ref_ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    if scaled:
        ref_w = ref_w * scale[ref_ids]
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    narrow, _ = kernel.softmax_top_k(logits, top_k, renormalize, scale)
    assert narrow.dtype == dtype


def test_combine_sums_the_weighted_products():
    gen = torch.Generator().manual_seed(9)
    y = torch.randn(3 * 4, 50, generator=gen).to(torch.bfloat16).to(DEVICE)
    for weights in (torch.rand(3, 4, generator=gen).to(torch.bfloat16).to(DEVICE),
                    torch.rand(3, 4, generator=gen).to(DEVICE)):
        got = kernel.combine(y, weights, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == (3, 50)
        # within bfloat16's rounding of the products and the sum (Triton's interpreter truncates
        # where the GPU rounds to nearest, so the CPU run cannot hold torch's exact bits)
        exact = (y.double() * weights.double().reshape(-1, 1)).view(3, 4, -1).sum(dim=1)
        torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens,method", [(1, "gemv"), (4, "gemv"), (8, "gemv"), (16, "gemv"), (8, "blocks"),
                                           (64, "blocks")])
def test_moe_triton_methods_match_reference_loop(tokens, method):
    torch.manual_seed(tokens)
    experts = FusedExperts(num_experts=8, hidden=48, intermediate=24, act="gelu_pytorch_tanh").to(DEVICE)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(tokens, 48, device=DEVICE)
    index = _routings(tokens, 2, 8, "random", torch.Generator().manual_seed(tokens))
    weights = torch.rand(tokens, 2, device=DEVICE)
    with torch.no_grad():
        experts.method = ExpertsMethod.LOOP
        ref = experts(x, index, weights)
        experts.method = ExpertsMethod(method)
        got = experts(x, index, weights)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
