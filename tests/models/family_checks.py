"""What the model-family tests share: a loaded case (transformers' model, ours, an engine over the
same checkpoint), random prompts, and our logits for a prompt run as passes of given sizes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Loaded:
    name: str
    path: Path
    hf: torch.nn.Module
    ours: torch.nn.Module
    engine: object


def load_case(name: str, path: Path, hf: torch.nn.Module, prefill_step: int) -> Loaded:
    """Our model and an engine (float32, CPU, `prefill_step`-token prompt chunks) over `path`, beside `hf`."""
    from verispec.engine.engine import load_engine
    from verispec.loading.model_loader import load_model

    ours = load_model(path, torch.float32, torch.device("cpu"))
    engine = load_engine(str(path), dtype="float32", device="cpu", prefill_step_size=prefill_step)
    return Loaded(name, path, hf, ours, engine)


def random_ids(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@torch.inference_mode()
def run_passes(model, cache, ids: list[int], sizes: list[int], start: int = 0) -> torch.Tensor:
    """Run `ids` as consecutive passes of the given sizes, committing each whole; logits [T, V]."""
    out, pos = [], start
    device = next(model.parameters()).device
    for size in sizes:
        part = ids[pos - start:pos - start + size]
        positions = torch.arange(pos, pos + len(part), device=device)[None]
        out.append(model.logits(model(torch.tensor([part], device=device), positions, cache).hidden)[0])
        cache.commit(len(part))
        pos += len(part)
    return torch.cat(out)


def our_logits(model, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [T, V] for every prompt position, prefilled in chunks of `chunk` (None: at once)."""
    step = chunk or len(ids)
    sizes = [min(step, len(ids) - s) for s in range(0, len(ids), step)]
    return run_passes(model, model.make_cache(len(ids)), ids, sizes)


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]
