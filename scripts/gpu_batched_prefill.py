#!/usr/bin/env python3
"""Batched prefill on the GPU (engine/prefill.py): prompt chunks of several sequences in one padded
pass against each sequence's own pass, on the demo model (Qwen3.5 hybrid: fla's variable-length
chunk kernel for the padded rows, our recurrent kernel for short tails, per-sequence attention).

Per dtype: the last-token logits and every recurrent state slot after one batched pass vs the lone
passes (max abs difference, argmax agreement), then greedy generation of each prompt alone vs all
together (identical outputs / prompts).

  python3 scripts/gpu_batched_prefill.py [--lengths 552,556,300,100,40,17,12,5] [--new 64]
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    from verispec.config import EngineConfig
    from verispec.demo.default import require_demo_model
    from verispec.engine.engine import Engine
    from verispec.engine.output import OutputBuilder
    from verispec.sampling.params import SamplingParams
    from verispec.sampling.sampler import TokenHistory
    from verispec.engine.sequence import Sequence

    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="552,556,300,100,40,17,12,5")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    chunk_attention_first_calls()
    lengths = [int(x) for x in args.lengths.split(",")]
    for dtype in args.dtypes.split(","):
        engine = Engine.load(EngineConfig(model=str(require_demo_model()), dtype=dtype, prefix_cache=False,
                                          max_model_len=4096))
        v = engine.num_real_tokens
        prompts = [[(7919 * i + 31 * j + 11) % v for j in range(n)] for i, n in enumerate(lengths)]

        def sequences() -> list[Sequence]:
            out = []
            for ids in prompts:
                greedy = SamplingParams(max_tokens=1, temperature=0.0)
                builder = OutputBuilder(engine.tokenizer, greedy, 1, TokenHistory(engine.model.vocab_size, ids,
                                                                                   engine.device), engine.eos_token_ids)
                seq = Sequence(ids, greedy, 1, builder, None, "check", sink=lambda chunk: None)
                assert engine.scheduler._grow(seq, len(ids))
                seq.state_slot = engine.scheduler.slots.allocate()
                engine.pools.clear_state(seq.state_slot)
                out.append(seq)
            return out

        def states(seqs) -> list[torch.Tensor]:
            return [torch.cat([engine.pools.ssm_states[layer][s.state_slot].flatten().float()
                               for layer in engine.pools.ssm_states]) for s in seqs]

        alone_seqs = sequences()
        alone = [engine.runner.prefill([s], [len(ids)], (), False).logits[0, -1] for s, ids in zip(alone_seqs, prompts)]
        alone_states = states(alone_seqs)
        batch_seqs = sequences()
        together = engine.runner.prefill(batch_seqs, lengths, (), False).logits[:, -1]
        together_states = states(batch_seqs)
        for s in alone_seqs + batch_seqs:
            engine.scheduler.release(s)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        logit_diff = max(float((a - t).abs().max()) for a, t in zip(alone, together))
        state_diff = max(float((a - t).abs().max()) for a, t in zip(alone_states, together_states))
        argmax = sum(int(a.argmax()) == int(t.argmax()) for a, t in zip(alone, together))
        print(f"{dtype}: one batched pass over {lengths} vs lone passes: logits max abs {logit_diff:.3g}, "
              f"SSM states max abs {state_diff:.3g}, argmax equal {argmax}/{len(lengths)}", flush=True)
        greedy = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
        alone_out = [engine.generate_all(ids, greedy).token_ids for ids in prompts]
        together_out = [r.token_ids for r in engine.generate_batch(prompts, [greedy] * len(prompts))]
        same = sum(a == t for a, t in zip(alone_out, together_out))
        print(f"{dtype}: greedy {args.new} tokens, alone vs together: {same}/{len(prompts)} identical", flush=True)


def chunk_attention_first_calls() -> None:
    """A prompt chunk's causal attention (models/layers/attention.py sdpa(causal=True)) at shapes
    the process has not seen, as a batched prefill meets them (a per-sequence slice of a padded
    pass): the first call's time shows whether a backend plans per shape (cuDNN: 13-50 ms)."""
    import time

    from verispec.models.layers.attention import sdpa

    for heads, kv_heads, dim in ((6, 2, 64), (32, 8, 128)):
        for t_pad, t, start in ((544, 544, 0), (549, 545, 0), (13, 9, 544), (16, 11, 548), (300, 300, 4000)):
            q = torch.randn(3, heads, t_pad, dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(3, kv_heads, start + t_pad, dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            call = lambda: sdpa(q[1:2, :, :t], k[1:2, :, :start + t], v[1:2, :, :start + t], None, dim ** -0.5,  # noqa: E731
                                causal=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            print(f"chunk attention {heads}/{kv_heads}x{dim}, {t} queries after {start}: first call {first:.2f} ms, "
                  f"then {(time.perf_counter() - t0) / 20 * 1000:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
