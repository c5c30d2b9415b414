"""Acceptance of a drafter, measured by running the engine's speculative greedy decoding."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from verispec.config import EngineConfig
from verispec.engine import warmup
from verispec.engine.engine import Engine
from verispec.loading.model_loader import prepare_for_device
from verispec.sampling.params import SamplingParams
from verispec.loading.tokenizer import Tokenizer
from verispec.models.base import CausalLM
from verispec.spec.proposer import Proposer


@dataclass
class Acceptance:
    num_drafts: int  # drafts per round
    drafted: int
    accepted: int
    rounds: int
    generated: int
    seconds: float

    @property
    def rate(self) -> float:
        """Accepted drafts / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens each target pass produced: accepted drafts + the bonus token."""
        return (self.generated - 1) / self.rounds if self.rounds else 0.0

    def as_json(self) -> dict:
        out = asdict(self)
        out.update(acceptance=round(self.rate, 4), accepted_per_round=round(self.accepted_per_round, 3),
                   tokens_per_round=round(self.tokens_per_round, 3))
        return out

    def summary(self) -> str:
        return (f"acceptance {100 * self.rate:.1f}% ({self.accepted}/{self.drafted}), "
                f"{self.accepted_per_round:.2f} accepted + 1 per round at {self.num_drafts} drafts")


def eval_engine(model: CausalLM, tokenizer: Tokenizer, model_dir: Path, proposer: Proposer | None,
                num_drafts: int) -> Engine:
    """An engine over an already loaded target (no CUDA graphs or compiled ops: evaluation runs
    between training steps and must not pay their warm-up)."""
    config = EngineConfig(model=str(model_dir), cuda_graphs=False, fuse_small_ops=False)
    warmup.pin_triton_cache_dir(next(model.parameters()).device)  # before anything compiles
    prepare_for_device(model, config.fuse_small_ops)
    return Engine(model, tokenizer, config, model_dir, proposer=proposer, num_drafts=num_drafts)


def measure(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[Acceptance, list[list[int]]]:
    """Greedy generation of `new_tokens` per prompt; returns the totals and the token ids."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    drafted = accepted = rounds = generated = 0
    outputs = []
    t0 = time.perf_counter()
    for ids in prompts:
        result = engine.generate_all(ids, params)
        s = result.stats
        drafted, accepted, rounds = drafted + s.drafted, accepted + s.accepted, rounds + s.rounds
        generated += s.generated_tokens
        outputs.append(result.token_ids)
    return Acceptance(engine.num_drafts, drafted, accepted, rounds, generated, time.perf_counter() - t0), outputs
