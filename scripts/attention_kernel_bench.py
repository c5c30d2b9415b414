"""Time the exact attention kernels on a GPU (Qwen3-8B's heads: 32 query / 8 kv heads of 128, bf16,
paged pools of 16-key blocks) and check the bits they rest on.

- prompt: `paged_chunk_attention` over a whole T-token prompt against torch's flash attention
  (`scaled_dot_product_attention`, causal, the kv heads repeated), and whether its rows are the
  bits a decode step, a 4-token verify pass and a second chunk give them;
- decode: `paged_decode_attention` (split-K and its combine) at 1 and 4 query tokens a sequence,
  timed inside a CUDA graph of 20 launches, as the engine's steps run it.

    python scripts/attention_kernel_bench.py [--block-n 128] [--stages 3] [--share-by-share]

--block-n / --stages try another key block (both kernels take it, so the bits still agree);
--share-by-share times the prompt kernel with a loop per share instead of its one walk.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from verispec.kernels import decode_attention as da  # noqa: E402
from verispec.kernels import prompt_attention  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
SCALE = D ** -0.5


def timed(fn, reps: int = 20) -> float:
    """Milliseconds a call, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def pools(batch: int, keys: int, seed: int):
    """K and V pools holding `keys` keys of each sequence in shuffled blocks, and their block tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-keys // PAGE)
    k = torch.randn(batch * blocks * PAGE + PAGE, HKV, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch * blocks * PAGE + PAGE, HKV, D, device="cuda", generator=gen).bfloat16()
    order = torch.randperm(batch * blocks, device="cuda", generator=gen) + 1
    return k, v, order.view(batch, blocks).to(torch.int32).contiguous()


def prompt(length: int) -> None:
    k, v, tables = pools(1, length, seed=0)
    q = torch.randn(1, HQ, length, D, device="cuda").bfloat16()
    pos = torch.arange(length, device="cuda")[None].contiguous()
    dense = torch.randn(1, HQ, length, D, device="cuda").bfloat16()
    flash = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, dense, dense, is_causal=True))
    whole = prompt_attention.paged_chunk_attention(q, k, v, tables, PAGE, pos, SCALE)
    ms = timed(lambda: prompt_attention.paged_chunk_attention(q, k, v, tables, PAGE, pos, SCALE))
    differ = []
    for p in (0, 63, 64, 511, 512, 513, length // 2 + 7, length - 1):
        step = da.paged_decode_attention(q[:, :, p:p + 1].contiguous(), k, v, tables, PAGE,
                                         torch.tensor([[p]], device="cuda"), SCALE)
        if not torch.equal(step, whole[:, :, p:p + 1]):
            differ.append(f"decode step {p}")
    first = length - 8
    verify = da.paged_decode_attention(q[:, :, first:first + 4].contiguous(), k, v, tables, PAGE,
                                       torch.arange(first, first + 4, device="cuda")[None], SCALE)
    if not torch.equal(verify, whole[:, :, first:first + 4]):
        differ.append(f"verify pass {first}")
    half = length // 2
    second = prompt_attention.paged_chunk_attention(q[:, :, half:].contiguous(), k, v, tables, PAGE, pos[:, half:].contiguous(), SCALE)
    if not torch.equal(second, whole[:, :, half:]):
        differ.append("second chunk")
    print(f"| prompt of {length:,} | {ms:.3f} ms | {flash:.3f} ms | {ms / flash:.2f}x | "
          f"{', '.join(differ) or 'none'} |", flush=True)


def decode(batch: int, context: int, tokens: int) -> None:
    k, v, tables = pools(batch, context + tokens, seed=1)
    q = torch.randn(batch, HQ, tokens, D, device="cuda").bfloat16()
    pos = (torch.arange(tokens, device="cuda") + context)[None].expand(batch, -1).contiguous()
    da.paged_decode_attention(q, k, v, tables, PAGE, pos, SCALE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            da.paged_decode_attention(q, k, v, tables, PAGE, pos, SCALE)
    us = timed(graph.replay, reps=5) / 20 * 1000
    print(f"| {batch} | {context:,} | {tokens} | {us:.1f} us |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-n", type=int, help="key block of both kernels (default: split_config's)")
    parser.add_argument("--stages", type=int, help="the split kernel's pipeline depth with --block-n")
    parser.add_argument("--share-by-share", action="store_true",
                        help="the prompt kernel's loop per share (prompt_attention.ONE_WALK off)")
    args = parser.parse_args()
    prompt_attention.ONE_WALK = not args.share_by_share
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernel_bench: needs a CUDA GPU")
    if args.block_n:
        chosen = da.split_config

        def split_config(d, element_size, coded=False):
            config = chosen(d, element_size, coded)
            if coded or element_size > 2:
                return config
            return dict(config, BLOCK_N=args.block_n, num_stages=args.stages or config["num_stages"])
        da.split_config = split_config
    print(f"key block {da.split_config(D, 2)['BLOCK_N']}, {torch.cuda.get_device_name()}\n")
    print("| pass | exact kernel | flash (sdpa) | ratio | rows whose bits differ |\n|---|---|---|---|---|")
    for length in (2048, 8192):
        prompt(length)
    print("\n| sequences | keys | query tokens | split-K + combine, a layer |\n|---|---|---|---|")
    for batch, context in ((1, 2048), (1, 8192), (1, 32768), (64, 512), (64, 2048), (16, 8192)):
        for tokens in (1, 4):
            decode(batch, context, tokens)


if __name__ == "__main__":
    main()
