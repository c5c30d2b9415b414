"""The demo model's tokenizer and pretraining (stages of `tools/demo_build/build.py`): byte-level BPE
with the ChatML specials, a Qwen3.5 hybrid config of a preset size, the next-token pretraining loop
(resumable, held-out early stopping) and held-out perplexity."""
from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tools.demo_build.corpus import say
from tools.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, THINK_TOKENS

if TYPE_CHECKING:
    from tools.demo_build.build import DemoSize


# ---- tokenizer -------------------------------------------------------------------------------
def train_tokenizer(docs: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE with the chat specials; `vocab_size` counts every token (think tags included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(THINK_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter(docs), trainer=trainer, length=len(docs))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.add_tokens(THINK_TOKENS)  # not special: they stay in decoded text for the reasoning parser
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 1 << 20
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return hf


def encode_stream(tokenizer, docs: list[str], separator: int):
    """Docs -> one int32 token stream, `separator` after each."""
    import torch

    pieces = []
    for start in range(0, len(docs), 512):
        for ids in tokenizer(docs[start:start + 512], add_special_tokens=False, verbose=False)["input_ids"]:
            pieces.append(torch.tensor(ids + [separator], dtype=torch.int32))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)


# ---- model -----------------------------------------------------------------------------------
def model_config(size: DemoSize, tokenizer):
    from transformers import Qwen3_5TextConfig

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab = max(size.vocab_size, len(tokenizer))
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads, head_dim=size.head_dim,
        linear_num_key_heads=size.linear_key_heads, linear_num_value_heads=size.linear_value_heads,
        linear_key_head_dim=size.linear_head_dim, linear_value_head_dim=size.linear_head_dim,
        linear_conv_kernel_dim=4, max_position_embeddings=size.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
    )


def gdn_kernel_note(device) -> str:
    """Which Gated DeltaNet implementation transformers trains with on this device."""
    if device.type != "cuda":
        return "torch reference (CPU)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as exc:  # ImportError, or a Triton mismatch at import
        return (f"torch reference: flash-linear-attention is not usable ({type(exc).__name__}: {exc}); "
                "training will be much slower")
    return "flash-linear-attention (fla) Triton kernels"


@dataclass
class PretrainResult:
    steps: int
    seconds: float
    tokens: int
    final_loss: float
    kept_step: int  # the step whose weights were kept (the best held-out loss)


def heldout_loss(model, stream, seq_len: int, device, autocast, max_windows: int = 16) -> float:
    """Mean next-token loss over the first `max_windows` non-overlapping windows of `stream`."""
    import torch
    import torch.nn.functional as F

    num = max(1, min(max_windows, (len(stream) - 1) // seq_len))
    window = torch.stack([stream[j * seq_len:(j + 1) * seq_len + 1] for j in range(num)])
    window = window.to(device=device, dtype=torch.long)
    model.eval()
    with torch.no_grad(), autocast:
        logits = model(input_ids=window[:, :-1], use_cache=False).logits
    return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)))


def pretrain(model, stream, seq_len: int, batch_size: int, lr: float, steps: int, max_seconds: float | None,
             device, state_path: Path, seed: int = 0, warmup_steps: int = 200, weight_decay: float = 0.1,
             save_every_s: float = 60.0, progress: bool | None = None, compile: bool = False,
             heldout=None, eval_every_s: float = 30.0) -> PretrainResult:
    """Next-token training of a transformers causal LM on random windows of `stream` (1-D ints).

    Resumes from `state_path` (model, optimiser, step, elapsed time) when it exists; batches are a
    function of (seed, step), so a resumed run sees the batches it would have seen. With a
    `heldout` stream, the held-out loss is measured every `eval_every_s` seconds and at the end,
    and the model ends with the weights that scored best (a small model trained for many epochs
    over a small corpus can start to overfit before the budget runs out).
    """
    import torch
    import torch.nn.functional as F

    from verispec.train.progress import TrainProgress

    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **({"fused": True} if device.type == "cuda" else {}))
    step, elapsed, last_loss = 0, 0.0, float("nan")
    best = {"loss": float("inf"), "step": 0, "weights": None}
    if state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, last_loss = state["step"], state["elapsed"], state.get("loss", float("nan"))
        best = state.get("best") or best
        say(f"pretraining resumes at step {step} ({elapsed:.0f}s done)")
    forward = torch.compile(model) if compile else model
    num_windows = len(stream) - seq_len - 1
    if num_windows < 1:
        raise ValueError(f"the training stream has {len(stream)} tokens, fewer than one window of {seq_len + 1}")
    vocab = model.config.vocab_size
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    offsets_base = torch.arange(seq_len + 1)
    warmup_steps = max(1, min(warmup_steps, steps // 10 if not max_seconds else warmup_steps))

    def fraction(s: int, e: float) -> float:
        f = s / steps
        return max(f, e / max_seconds) if max_seconds else f

    def save_state() -> None:
        state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "loss": last_loss, "best": best}, tmp)
        os.replace(tmp, state_path)

    def check_heldout() -> None:
        if heldout is None or len(heldout) <= seq_len + 1:
            return
        loss = heldout_loss(forward, heldout, seq_len, device, autocast)
        model.train()
        better = loss < best["loss"]
        if better:
            best.update(loss=loss, step=step,
                        weights={k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        bar.note(f"step {step}: held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f})"
                 + ("" if better else f"; best so far {best['loss']:.4f} at step {best['step']}"))

    bar = TrainProgress(steps, "pretrain", progress, initial=step)
    t_start = time.perf_counter() - elapsed
    t_saved = t_evaluated = time.perf_counter()
    tokens, t_rate = 0, time.perf_counter()
    loss = None
    try:
        while fraction(step, elapsed) < 1.0:
            f = fraction(step, elapsed)
            warm = min(1.0, (step + 1) / warmup_steps)
            for group in opt.param_groups:
                group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(f, 1.0))))
            gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
            starts = torch.randint(0, num_windows, (batch_size,), generator=gen)
            window = stream[starts[:, None] + offsets_base].to(device=device, dtype=torch.long, non_blocking=True)
            inputs, labels = window[:, :-1], window[:, 1:]
            with autocast:
                logits = forward(input_ids=inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            tokens += inputs.numel()
            elapsed = time.perf_counter() - t_start
            if step % 10 == 0 or fraction(step, elapsed) >= 1.0 or step < 10:
                last_loss = loss.item()
                rate = tokens / max(time.perf_counter() - t_rate, 1e-9)
                bar.update(step, fraction(step, elapsed),
                           f"loss {last_loss:.3f} lr {opt.param_groups[0]['lr']:.1e} {rate:,.0f} tok/s")
            if time.perf_counter() - t_evaluated >= eval_every_s and fraction(step, elapsed) < 1.0:
                check_heldout()
                t_evaluated = time.perf_counter()
            if time.perf_counter() - t_saved >= save_every_s and fraction(step, elapsed) < 1.0:
                save_state()
                t_saved = time.perf_counter()
        if loss is not None:
            last_loss = loss.item()
        check_heldout()
    finally:
        bar.close()
    save_state()
    if best["weights"] is not None and best["step"] != step:
        say(f"keeping the weights of step {best['step']} (held-out loss {best['loss']:.4f}); later steps overfit")
        model.load_state_dict(best["weights"])
    model.eval()
    return PretrainResult(step, elapsed, tokens, last_loss, best["step"] or step)


def perplexity(model_dir: Path, stream, seq_len: int, device, max_windows: int = 64) -> float:
    """exp(mean next-token loss) over non-overlapping windows of `stream`, with the checkpoint as
    transformers loads it."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    num = min(max_windows, (len(stream) - 1) // seq_len)
    if num < 1:
        return float("nan")
    total, count = 0.0, 0
    # on CUDA as in training (bf16 autocast: the Gated DeltaNet kernels' usual precision)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with torch.no_grad(), autocast:
        for i in range(0, num, 8):
            rows = [stream[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(num, i + 8))]
            window = torch.stack(rows).to(device=device, dtype=torch.long)
            logits = model(input_ids=window[:, :-1], use_cache=False).logits.float()
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += window[:, 1:].numel()
    return math.exp(total / count)
