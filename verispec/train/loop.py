"""The drafter training run: data, target features, optimiser and schedule, evaluation,
checkpoints (resume), output files.

Schedule: AdamW (betas 0.9/0.95), linear warmup, cosine decay to 10% of the peak learning rate
over the run's progress, where progress is steps / --steps or, with --max-seconds, elapsed /
max-seconds, whichever is further (so a wall-clock budget always ends with a decayed rate).
autocast in the target's dtype when that is bf16/fp16 (the default on CUDA; float32 master weights),
gradient clipping.

Checkpoints: OUT/.train-state/<method>.pt holds the drafter, the optimiser, the step, the elapsed
time, the draft vocabulary and the self-generated data; a later run with the same settings
resumes from it (--restart ignores it). The output files are rewritten at every checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from verispec.errors import VerispecError
from verispec.loading.device import DTYPES, parse_device, parse_dtype
from verispec.loading.model_loader import load_model
from verispec.loading.resolve import resolve_model
from verispec.loading.tokenizer import Tokenizer
from verispec.spec.mtp import MtpHidden
from verispec.train.data import (eval_prompts, generate_answers, generate_continuations, read_documents,
                                 read_gen_prompts, split_gen_prompts, tokenize_windows)
from verispec.train.eagle3 import (DEFAULT_MAX_DRAFT_VOCAB, Eagle3Trainee, choose_draft_vocab, default_aux_layers,
                                   drafter_config)
from verispec.train.evaluate import Acceptance, eval_engine, measure
from verispec.train.features import target_batch
from verispec.train.mtp import MtpTrainee
from verispec.train.options import DrafterTrainOptions, Method
from verispec.train.progress import TrainProgress

STATE_DIR = ".train-state"
STATE_VERSION = 1
MIN_LR_FRACTION = 0.1


def lr_at(options: DrafterTrainOptions, step: int, fraction: float) -> float:
    warm = min(1.0, (step + 1) / max(1, options.warmup_steps))
    cosine = MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0)))
    return options.lr * warm * cosine


def run_fraction(options: DrafterTrainOptions, step: int, elapsed: float) -> float:
    fraction = step / options.steps
    if options.max_seconds:
        fraction = max(fraction, elapsed / options.max_seconds)
    return fraction


class BatchSampler:
    """Deterministic batches over two pools (text windows, generated continuations): a fresh
    seeded permutation per pass over each pool, so a resumed run sees the batches it would have."""

    def __init__(self, num_text: int, num_gen: int, batch_size: int, seed: int, gen_fraction: float = 0.25):
        self.num_gen_rows = min(batch_size - 1, max(1, round(batch_size * gen_fraction))) if num_gen else 0
        self.num_text_rows = batch_size - self.num_gen_rows
        self.sizes = (num_text, num_gen)
        self.seed = seed
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def _take(self, pool: int, start: int, count: int) -> torch.Tensor:
        size = self.sizes[pool]
        out = []
        for s in range(start, start + count):
            epoch, within = divmod(s, size)
            key = (pool, epoch)
            if key not in self._perms:
                self._perms = {k: v for k, v in self._perms.items() if k[1] >= epoch - 1}
                gen = torch.Generator().manual_seed(self.seed * 1000003 + pool * 7919 + epoch)
                self._perms[key] = torch.randperm(size, generator=gen)
            out.append(self._perms[key][within])
        return torch.stack(out)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        text = self._take(0, step * self.num_text_rows, self.num_text_rows)
        gen = (self._take(1, step * self.num_gen_rows, self.num_gen_rows) if self.num_gen_rows
               else torch.zeros(0, dtype=torch.long))
        return text, gen


def _fingerprint(options: DrafterTrainOptions, extra: dict) -> dict:
    return dict(method=options.method.value, seq_len=options.seq_len, batch_size=options.batch_size,
                ttt_steps=options.ttt_steps, layer_type=options.layer_type, copy_embedding=options.copy_embedding,
                mtp_hidden=options.mtp_hidden, gen_fraction=options.gen_fraction,
                gen_prompts=options.gen_prompts, **extra)


def _save_atomic(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _note(progress: TrainProgress | None, line: str) -> None:
    if progress is not None:
        progress.note(line)
    else:
        import sys

        sys.stderr.write(f"train-drafter: {line}\n")
        sys.stderr.flush()


def run(options: DrafterTrainOptions, documents: list[str] | None = None) -> dict:
    options.validate()
    method = options.method
    device = parse_device(options.device)
    dtype = parse_dtype(options.dtype, device)
    save_dtype = DTYPES[options.save_dtype]
    model_dir = resolve_model(options.model)
    torch.manual_seed(options.seed)
    target = load_model(model_dir, dtype, device)
    tokenizer = Tokenizer.from_dir(model_dir)
    num_real = min(tokenizer.vocab_size, target.vocab_size)
    if method is Method.MTP:
        MtpTrainee.check_target(target)
    aux = list(options.aux_layers or default_aux_layers(target.num_layers))
    if method is Method.EAGLE3 and any(not 0 <= i < target.num_layers for i in aux):
        shown = ", ".join(map(str, aux))
        raise VerispecError(f"--aux-layers: EAGLE3 aux layer ids [{shown}] must be layers of the target's "
                            f"{target.num_layers} (0..{target.num_layers - 1})")
    out = Path(options.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_DIR / f"{method.value}.pt"
    extra: dict = {"target_vocab": target.vocab_size, "target_hidden": target.hidden_size}
    size = min(options.draft_vocab_size or DEFAULT_MAX_DRAFT_VOCAB, num_real)
    if method is Method.EAGLE3:
        extra.update(aux_layers=aux, draft_vocab_size=size)
    fingerprint = _fingerprint(options, extra)
    state = None
    if state_path.is_file() and not options.restart:
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state.get("version") != STATE_VERSION:
            raise VerispecError(f"{state_path} is a checkpoint of another verispec version; use --restart")
        if state["fingerprint"] != fingerprint:
            diff = {k: (state["fingerprint"].get(k), v) for k, v in fingerprint.items()
                    if state["fingerprint"].get(k) != v}
            shown = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
            raise VerispecError(f"the checkpoint in {state_path.parent} was written with other settings ({shown}); "
                                "rerun with the same settings to resume, or add --restart")

    docs = documents if documents is not None else read_documents(options.data)
    data = tokenize_windows(docs, tokenizer, options.seq_len, options.holdout_every, options.max_data_tokens,
                            options.seed)
    _note(None, f"{method.value} drafter for {model_dir} on {device} ({str(dtype).removeprefix('torch.')}): "
                f"{data.train.shape[0]} training windows of {options.seq_len} tokens, {data.heldout.shape[0]} held out")

    # With --gen-prompts the target answers those prompts (evaluation uses the held-out ones);
    # otherwise it continues prompts cut from the training text. Kept in the checkpoint.
    chat_train = chat_heldout = None
    if options.gen_prompts is not None:
        texts = read_gen_prompts(options.gen_prompts)
        encoded = tokenizer.hf(texts, add_special_tokens=False, verbose=False)["input_ids"]
        chat_train, chat_heldout = split_gen_prompts([list(ids) for ids in encoded], options.holdout_every)
    if state is not None:
        gen = state["gen"]
    elif chat_train is not None:
        t0 = time.perf_counter()
        gen = generate_answers(target, chat_train, options.gen_sequences, options.seq_len, num_real,
                               tokenizer.eos_token_ids,
                               batch_size=min(options.gen_sequences, max(64, options.batch_size * 8)),
                               seed=options.seed + 2)
        _note(None, f"generated {gen.shape[0]} windows of {options.seq_len} tokens answering {len(chat_train)} "
                    f"prompts from {options.gen_prompts} with the target in {time.perf_counter() - t0:.1f}s")
    elif options.gen_sequences:
        t0 = time.perf_counter()
        pick = torch.randint(0, data.train.shape[0], (options.gen_sequences,),
                             generator=torch.Generator().manual_seed(options.seed + 1))
        prompts = data.train[pick, :options.gen_prompt_len]
        gen = generate_continuations(target, prompts, options.seq_len, num_real,
                                     batch_size=min(options.gen_sequences, max(64, options.batch_size * 8)),
                                     seed=options.seed + 2)
        _note(None, f"generated {gen.shape[0]} continuations of {options.seq_len - options.gen_prompt_len} tokens "
                    f"with the target in {time.perf_counter() - t0:.1f}s")
    else:
        gen = torch.zeros(0, options.seq_len, dtype=torch.long)
    sampler = BatchSampler(data.train.shape[0], gen.shape[0], options.batch_size, options.seed, options.gen_fraction)

    def batch_ids(step: int) -> torch.Tensor:
        text_idx, gen_idx = sampler.batch(step)
        return torch.cat([data.train[text_idx], gen[gen_idx]]).to(device)

    vocab_ids = None
    coverage = None
    if method is Method.EAGLE3:
        if state is not None:
            draft_ids, coverage = state["draft_ids"], state.get("coverage")
        else:
            draft_ids, coverage = _select_vocab(target, batch_ids, size, num_real, options, sampler.sizes)
            _note(None, f"draft vocabulary: {len(draft_ids)} of {num_real} target ids, covering "
                        f"{100 * coverage:.1f}% of the target's predictions on the training data")
        config = drafter_config(target, aux, len(draft_ids), options.layer_type, options.num_eval_drafts,
                                verifier=options.model)
        trainee = Eagle3Trainee(target, config, draft_ids, options.copy_embedding, out, options.seed)
        vocab_ids = trainee.draft_ids
    else:
        trainee = MtpTrainee(target, MtpHidden.parse(options.mtp_hidden), num_real, options.seed)

    params = trainee.parameters()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay,
                            **({"fused": True} if fused else {}))
    step, elapsed, history = 0, 0.0, {"evaluations": []}
    if state is not None:
        trainee.load_state_dict(state["trainee"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        _note(None, f"resuming from {state_path} at step {step} ({elapsed:.0f}s trained)")

    if not options.eval_prompts:
        prompts = []
    elif chat_heldout:  # whole held-out chat prompts: what the drafter meets when serving chats
        prompts = chat_heldout[:options.eval_prompts]
    else:
        prompts = eval_prompts(data.heldout, options.eval_prompts, options.eval_prompt_len)

    def evaluate(at_step: int) -> Acceptance | None:
        if not prompts:
            return None
        engine = eval_engine(target, tokenizer, model_dir, trainee.proposer(dtype), options.num_eval_drafts)
        result, _ = measure(engine, prompts, options.eval_tokens)
        history["evaluations"].append(dict(step=at_step, **result.as_json()))
        return result

    def checkpoint(finished: bool) -> list[Path]:
        files = trainee.save(out, save_dtype)
        _save_atomic(dict(version=STATE_VERSION, fingerprint=fingerprint, step=step, elapsed=elapsed,
                          history=history, trainee=trainee.state_dict(), optimizer=opt.state_dict(),
                          draft_ids=None if vocab_ids is None else vocab_ids.cpu(), coverage=coverage,
                          gen=gen, finished=finished), state_path)
        summary = _summary(options, model_dir, out, files, step, elapsed, history, coverage, vocab_ids, data)
        (out / f"training-{method.value}.json").write_text(json.dumps(summary, indent=2) + "\n")
        return files

    if state is not None and state.get("finished"):
        _note(None, f"already trained ({step} steps) in {out}; --restart trains again")
        return _summary(options, model_dir, out, trainee.save(out, save_dtype), step, elapsed, history, coverage,
                        vocab_ids, data)

    if step == 0:
        before = evaluate(0)
        if before is not None:
            _note(None, f"before training: {before.summary()}")
    progress = TrainProgress(options.steps, f"train-drafter {method.value}", options.progress, initial=step)
    # the drafter keeps float32 weights; with a half-precision target it computes under autocast
    half = dtype in (torch.bfloat16, torch.float16)
    autocast = torch.autocast(device.type, dtype=dtype) if half else nullcontext()
    t_start = time.perf_counter() - elapsed
    tokens_seen = 0
    t_rate = time.perf_counter()
    try:
        while run_fraction(options, step, elapsed) < 1.0:
            fraction = run_fraction(options, step, elapsed)
            for group in opt.param_groups:
                group["lr"] = lr_at(options, step, fraction)
            ids = batch_ids(step)
            batch = target_batch(target, ids, trainee.capture, num_real, vocab_ids)
            with autocast:
                loss, metrics = trainee.loss(batch, options.ttt_steps, options.ttt_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, options.grad_clip)
            opt.step()
            step += 1
            tokens_seen += ids.numel()
            elapsed = time.perf_counter() - t_start
            rate = tokens_seen / max(time.perf_counter() - t_rate, 1e-9)
            shown = " ".join(f"{k} {v:.2f}" for k, v in metrics.items())
            progress.update(step, run_fraction(options, step, elapsed),
                            f"loss {loss.item():.3f} {shown} lr {opt.param_groups[0]['lr']:.1e} {rate:,.0f} tok/s")
            done = run_fraction(options, step, elapsed) >= 1.0
            if options.eval_every and step % options.eval_every == 0 and not done:
                result = evaluate(step)
                if result is not None:
                    progress.note(f"step {step}: {result.summary()}")
            if step % options.save_every == 0 and not done:
                checkpoint(finished=False)
    finally:
        progress.close()
    elapsed = time.perf_counter() - t_start
    after = evaluate(step)
    files = checkpoint(finished=True)
    if after is not None:
        _note(None, f"after {step} steps ({elapsed:.0f}s): {after.summary()}")
    _note(None, f"wrote {', '.join(str(f) for f in files)}")
    return _summary(options, model_dir, out, files, step, elapsed, history, coverage, vocab_ids, data)


def _select_vocab(target, batch_ids, size: int, num_real: int, options: DrafterTrainOptions,
                  sampler_sizes: tuple[int, int]) -> tuple[torch.Tensor, float]:
    """Count the target's greedy predictions over training batches (text and its own
    continuations); the most frequent `size` ids become the draft vocabulary."""
    vocab = target.vocab_size
    target_counts = torch.zeros(vocab, dtype=torch.long)
    text_counts = torch.zeros(vocab, dtype=torch.long)
    seen = 0
    step = 0
    one_pass = -(-(sampler_sizes[0] + sampler_sizes[1]) // options.batch_size)
    max_batches = max(1, min(one_pass, -(-options.vocab_sample_tokens // (options.batch_size * options.seq_len))))
    while seen < options.vocab_sample_tokens and step < max_batches:
        ids = batch_ids(step)
        batch = target_batch(target, ids, (), num_real)
        target_counts += torch.bincount(batch.argmax.flatten().cpu(), minlength=vocab)
        text_counts += torch.bincount(ids.flatten().cpu(), minlength=vocab)
        seen += ids.numel()
        step += 1
    draft_ids = choose_draft_vocab(target_counts, text_counts, size, num_real)
    coverage = float(target_counts[draft_ids].sum()) / max(1, int(target_counts.sum()))
    return draft_ids, coverage


def _summary(options, model_dir, out, files, step, elapsed, history, coverage, vocab_ids, data) -> dict:
    evaluations = history["evaluations"]
    summary = {
        "method": options.method.value, "target": str(model_dir), "out": str(out),
        "files": [str(f) for f in files], "steps": step, "seconds": round(elapsed, 1),
        "batch_size": options.batch_size, "seq_len": options.seq_len, "ttt_steps": options.ttt_steps,
        "train_windows": int(data.train.shape[0]), "heldout_windows": int(data.heldout.shape[0]),
        "eval_drafts": options.num_eval_drafts, "evaluations": evaluations,
    }
    if vocab_ids is not None:
        summary.update(draft_vocab_size=int(len(vocab_ids)), draft_vocab_coverage=coverage)
    if evaluations:
        summary["before"] = evaluations[0] if evaluations[0]["step"] == 0 else None
        summary["after"] = evaluations[-1]
    return summary
