"""On the lent GPU: where the time of a cached 16K-token prompt goes (issue #13: the repeated
prompt's TTFT was 54 ms against 679 ms cold on the Qwen3-8B shape, 12.5x; the target is 20x).
Sends a prompt cold, then again (a hit of all but its last block), and profiles the second
request: CUDA kernels by device time and the host's share, printed as tables.
  python3 scripts/gpu_prefix_profile.py [--shape qwen3-8b] [--context 16384] [--out DIR]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verispec.bench.build import random_target  # noqa: E402
from verispec.bench.shapes import get_shape  # noqa: E402
from verispec.config import EngineConfig  # noqa: E402
from verispec.engine.engine import Engine  # noqa: E402
from verispec.sampling.params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--out", default=None)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick check)")
    args = parser.parse_args()
    shape = get_shape(args.shape)
    config = dict(shape.config)
    if args.layers:
        config.update(num_hidden_layers=args.layers, layer_types=config.get("layer_types", [])[:args.layers] or None)
        config = {k: v for k, v in config.items() if v is not None}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = random_target(args.shape, config, device, torch.bfloat16, 0)
    engine = Engine(target.model, target.tokenizer, EngineConfig(model=args.shape, max_num_seqs=8,
                                                                 max_model_len=args.context * 2))
    if device.type == "cuda":
        engine.capture_graphs()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for trial in range(3):
        ids = [rng.randrange(3, target.model.vocab_size) for _ in range(args.context)]
        cold = engine.generate_all(ids, params).stats
        warm = engine.generate_all(ids, params).stats
        print(f"trial {trial}: cold TTFT {cold.ttft_ms:.1f} ms, cached TTFT {warm.ttft_ms:.1f} ms "
              f"({warm.cached_tokens} cached)", flush=True)
    ids = [rng.randrange(3, target.model.vocab_size) for _ in range(args.context)]
    engine.generate_all(ids, params)
    began = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        stats = engine.generate_all(ids, params).stats
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - began) * 1000
    print(f"profiled cached request: TTFT {stats.ttft_ms:.1f} ms, wall {wall:.1f} ms (profiler on)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=70))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.out) / "prefix_cached_trace.json"))


if __name__ == "__main__":
    main()
