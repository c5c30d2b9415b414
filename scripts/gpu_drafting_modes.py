"""On the GPU: the demo model's MTP and EAGLE3 drafters run per sequence (their own contiguous
cache, graphs for one sequence) vs batched (paged rows, graphs per batch bucket), one request at a
time on the same prompts: acceptance and decode tok/s per mode. Equal acceptance (up to bf16
near-ties) says the batched drafter sees the same state.

    python3 scripts/gpu_drafting_modes.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verispec.bench.prompts import tokenized_prompt  # noqa: E402
from verispec.engine.engine import Engine, load_engine  # noqa: E402
from verispec.sampling.params import SamplingParams  # noqa: E402
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "verispec" / "demo" / "model"


def run(engine: Engine, prompts) -> tuple[float, float]:
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    engine.generate_all(prompts[0], params)
    drafted = accepted = 0
    rates = []
    for ids in prompts:
        stats = engine.generate_all(ids, params).stats
        drafted += stats.drafted
        accepted += stats.accepted
        rates.append(stats.decode_tok_per_s)
    return accepted / max(drafted, 1), sorted(rates)[len(rates) // 2]


def main() -> int:
    for label, kwargs in (("mtp", {"mtp": True, "mtp_depth": 3, "num_mtp_tokens": 3}), ("eagle3", {})):
        base = load_engine(str(DEMO), device="cuda", max_num_seqs=8, **kwargs)
        prompts = [tokenized_prompt(base.tokenizer, "modes", 256, r) for r in range(6)]
        for batched in (False, True):
            if label == "eagle3":
                proposer = Eagle3Proposer(load_eagle3(DEMO / "eagle3", base.model), base.model.vocab_size)
            else:
                proposer = type(base.proposer).__new__(type(base.proposer))
                proposer.__dict__.update(base.proposer.__dict__)
            proposer.batched = batched
            eng = Engine(base.model, base.tokenizer, base.config, base.model_dir, proposer=proposer, num_drafts=3)
            eng.capture_graphs()
            acc, rate = run(eng, prompts)
            print(f"{label:7s} {'batched' if batched else 'per-seq':8s} acceptance {100 * acc:.1f}%  decode {rate:.0f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
