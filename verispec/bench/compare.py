"""A peer measured in the same run: Hugging Face transformers `generate` on the same model.

For a --shape the transformers model is built from the equivalent transformers config with
random weights on the device; for -m the checkpoint is loaded with AutoModelForCausalLM.
Greedy, the model's default attention implementation and dynamic KV cache, no eos (exactly
gen-tokens new tokens). One generate call per run, timed by a streamer: TTFT = call start to the
first new token; decode tok/s = (n - 1) / (end - first token). (generate already syncs with the
host every step for its stopping check, so the streamer adds no sync of its own.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from verispec.bench.build import Target
from verispec.errors import VerispecError


@dataclass
class PeerRun:
    ttft_ms: float
    decode_ms: float  # from the first new token to the last
    gen_tokens: int

    @property
    def decode_tok_s(self) -> float:
        return (self.gen_tokens - 1) / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0


class _TokenClock:
    """A transformers streamer that only notes when the first new token and the end arrive."""

    def __init__(self):
        self.puts = 0
        self.first: float | None = None
        self.end_time: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        self.end_time = time.perf_counter()


def transformers_model(target: Target, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if target.model_dir is not None:
            model = AutoModelForCausalLM.from_pretrained(str(target.model_dir), dtype=dtype)
            model.to(device)
        else:
            fields = {k: v for k, v in target.config.items() if k != "model_type"}
            config = AutoConfig.for_model(target.config["model_type"], **fields)
            with torch.device(device):  # random init on the device, never through host memory
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.to(device)
    except Exception as exc:  # transformers raises many types; the user needs the cause in one line
        raise VerispecError(f"--compare transformers: could not build the transformers model for "
                            f"{target.name}: {type(exc).__name__}: {exc}") from exc
    model.eval().requires_grad_(False)
    return model


def attention_implementation(model) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "default")


def _generation_config(num_tokens: int):
    from transformers import GenerationConfig

    # eos off (no early stop, no min-length processor): exactly num_tokens new tokens
    return GenerationConfig(do_sample=False, max_new_tokens=num_tokens, min_new_tokens=None,
                            eos_token_id=None, pad_token_id=0, use_cache=True)


@torch.inference_mode()
def _generate(model, prompt_ids: list[int], num_tokens: int, device: torch.device) -> PeerRun:
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    clock = _TokenClock()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         generation_config=_generation_config(num_tokens), streamer=clock)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    made = out.shape[1] - ids.shape[1]
    if made != num_tokens or clock.first is None:
        raise VerispecError(f"--compare transformers: generate made {made} tokens, expected {num_tokens}")
    return PeerRun((clock.first - t0) * 1000, (end - clock.first) * 1000, num_tokens)


def warm_up(model, prompt_ids: list[int], device: torch.device) -> None:
    _generate(model, prompt_ids, 2, device)


def run_once(model, prompt_ids: list[int], gen_tokens: int, device: torch.device) -> PeerRun:
    return _generate(model, prompt_ids, gen_tokens, device)
