"""Build the embedded demo model from scratch: corpus, tokenizer, pretraining, MTP head, EAGLE3
drafter, choice of the default speculation, model card. `scripts/train_demo_model.py` is the
command line; `make demo-model` runs it.

- Corpus: the Python standard library's own source (on every machine, no download): every .py
  file under `sysconfig.get_paths()["stdlib"]` in sorted order, minus site-packages, data tables
  (`encodings/`, `pydoc_data/`), Python 2 test data and files over 400 KB. Files whose
  crc32(path) % 50 == 0 are held out. Beside the raw files, chat examples made from the
  functions in them (user: a signature or a request built from the docstring; assistant: the
  function; a quarter with a `<think>` block holding the docstring), in the ChatML template.
- Tokenizer: byte-level BPE (`tokenizers`), `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` special,
  `<think>`/`</think>` added (kept in decoded text for the reasoning parser), ChatML template.
- Model: transformers' Qwen3_5ForCausalLM (model_type qwen3_5_text: Gated DeltaNet layers with a
  gated full-attention layer every fourth), tied embeddings, trained with the standard next-token
  loss (AdamW, bf16 autocast on CUDA, cosine schedule, clipping) and saved with
  `save_pretrained` in bfloat16: a genuine Hugging Face checkpoint.
- Drafters: `verispec.train` (what `verispec train-drafter` runs) writes `mtp.safetensors` and
  `eagle3/`; the `select` stage measures plain, MTP and EAGLE3 decoding on held-out prompts with
  the engine and records the fastest speculative configuration in `demo.json`, which
  `verispec serve` / `generate` use when no `-m` is given.

Every stage skips when its output exists (`--force STAGE` redoes it) and pretraining resumes
from its checkpoint, so an interrupted run continues where it stopped.
"""
from __future__ import annotations

import ast
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import textwrap
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from verispec.demo.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, THINK_TOKENS

STAGES = ("corpus", "tokenizer", "pretrain", "mtp", "eagle3", "select", "card")
HOLDOUT_EVERY = 50  # files with crc32(path) % 50 == 0 are held out
MAX_FILE_BYTES = 400_000
SKIPPED_PREFIXES = ("site-packages/", "dist-packages/", "encodings/", "pydoc_data/", "lib2to3/tests/data/",
                    "test/tokenizedata/", "test/encoded_modules/")
CHAT_PER_FILE = 6  # chat examples taken from one file at most
SYSTEM_PROMPT = "You are a helpful coding assistant."
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "mtp.safetensors",
               "demo.json", "README.md")
SHIP_LIMIT_BYTES = 60_000_000
DEMO_NAME = "verispec-demo"
# select: plain decoding first (the reference), then the likeliest winners, so a cut-short run has them
SELECT_ORDER = ("ar", "mtp-2", "eagle3-3", "mtp-1", "eagle3-2", "mtp-3", "eagle3-4", "eagle3-1")


@dataclass(frozen=True)
class DemoSize:
    """The model's shape and its pretraining batch."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    max_position_embeddings: int
    seq_len: int
    batch_size: int
    lr: float
    draft_vocab_size: int


PRESETS = {
    # ~20.8M parameters (3.1M of them the tied embedding): 42 MB in bfloat16, ~52 MB with its MTP
    # head and EAGLE3 drafter. 10 layers: Gated DeltaNet x3 + gated attention, twice, + 2 GDN.
    "demo": DemoSize(vocab_size=8192, hidden_size=384, num_layers=10, intermediate_size=1024, num_heads=6,
                     num_kv_heads=2, head_dim=64, linear_key_heads=3, linear_value_heads=6, linear_head_dim=64,
                     max_position_embeddings=4096, seq_len=1024, batch_size=64, lr=2e-3, draft_vocab_size=2048),
    # CPU tests: seconds, not quality.
    "tiny": DemoSize(vocab_size=512, hidden_size=64, num_layers=4, intermediate_size=128, num_heads=4,
                     num_kv_heads=2, head_dim=16, linear_key_heads=2, linear_value_heads=4, linear_head_dim=16,
                     max_position_embeddings=1024, seq_len=128, batch_size=16, lr=3e-3, draft_vocab_size=256),
}


@dataclass
class DemoOptions:
    out: str = "verispec/demo/model"  # where the finished model is copied (the packaged location)
    work: str = "build/demo-work"  # corpus, token streams, checkpoints, drafter runs
    preset: str = "demo"
    device: str | None = None
    seed: int = 0
    stages: tuple[str, ...] = STAGES
    force: tuple[str, ...] = ()
    pretrain_steps: int = 100_000  # with pretrain_seconds, whichever ends first
    pretrain_seconds: float | None = 270.0
    drafter_steps: int = 100_000
    drafter_seconds: float | None = 75.0
    drafter_batch: int = 32
    drafter_seq_len: int = 512
    drafter_gen_sequences: int = 1024  # continuations the target writes for its drafters' training
    vocab_sample_tokens: int = 2_000_000  # target predictions counted for the EAGLE3 draft vocabulary
    max_files: int | None = None  # corpus: at most this many files (evenly spread), None: all
    extra_sources: tuple[str, ...] = ()  # corpus: more directories of .py files beside the stdlib
    max_chars: int | None = None  # corpus: stop adding files past this many characters
    eval_prompts: int = 8
    eval_tokens: int = 128
    select_seconds: float | None = 150.0  # select: measure no more configurations after this long
    compile: bool = False  # torch.compile the model for pretraining
    size_overrides: dict = field(default_factory=dict)
    progress: bool | None = None

    @property
    def size(self) -> DemoSize:
        return replace(PRESETS[self.preset], **self.size_overrides)


def tiny_options(**overrides) -> DemoOptions:
    """The CPU test mode: a tiny model on ~40 files, seconds per stage."""
    base = dict(preset="tiny", pretrain_steps=100, pretrain_seconds=None, drafter_steps=60, drafter_seconds=None,
                drafter_batch=8, drafter_seq_len=64, drafter_gen_sequences=32, vocab_sample_tokens=50_000,
                max_files=40, max_chars=300_000, eval_prompts=2, eval_tokens=24, device="cpu")
    base.update(overrides)
    return DemoOptions(**base)


def say(line: str) -> None:
    sys.stderr.write(f"[demo] {line}\n")
    sys.stderr.flush()


# ---- corpus ----------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path, prefix: str = "") -> list[tuple[str, Path]]:
    """(prefix + relative posix path, path) of the .py files under root, sorted, filtered."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(SKIPPED_PREFIXES) or "__pycache__" in rel:
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        out.append((prefix + rel, path))
    return out


def stdlib_files(max_files: int | None = None, extra_sources: tuple[str, ...] = ()) -> list[tuple[str, Path]]:
    """The standard library's .py files (and those under `extra_sources`), sorted, filtered;
    `max_files` keeps that many, evenly spread."""
    out = python_files(stdlib_root())
    for i, source in enumerate(extra_sources):
        root = Path(source).expanduser()
        if not root.is_dir():
            raise ValueError(f"--extra-source {source}: not a directory")
        out += python_files(root, prefix=f"extra{i}/")
    if max_files is not None and len(out) > max_files:
        stride = len(out) / max_files
        out = [out[int(i * stride)] for i in range(max_files)]
    return out


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HOLDOUT_EVERY == 0


def chat_text(messages: list[dict]) -> str:
    """ChatML as CHAT_TEMPLATE renders it (a finished conversation, no generation prompt)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _function_source(text: str, node: ast.AST) -> str | None:
    src = ast.get_source_segment(text, node, padded=True)
    if not src:
        return None
    return textwrap.dedent(src).strip("\n")


def chat_examples(rel: str, text: str) -> list[str]:
    """Chat conversations made from the functions of one file (deterministic per file)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    rng = random.Random(zlib.crc32(rel.encode()))
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    rng.shuffle(functions)
    out = []
    for node in functions:
        if len(out) >= CHAT_PER_FILE:
            break
        src = _function_source(text, node)
        if src is None or not 80 <= len(src) <= 2500 or node.name.startswith("_"):
            continue
        first = src.split("\n", 1)[0]
        doc = ast.get_docstring(node) or ""
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.2 else []
        if summary and len(summary) < 300 and rng.random() < 0.5:
            ask = summary[0].lower() + summary[1:] if summary[:2] != summary[:2].upper() else summary
            user = f"Write a Python function `{node.name}` that {ask.rstrip('.')}."
            answer = f"```python\n{src}\n```"
        elif first.endswith(":"):
            user, answer = first, src
        else:
            continue
        if summary and rng.random() < 0.25:
            answer = f"<think>\n{summary}\n</think>\n\n{answer}"
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        out.append(chat_text(messages))
    return out


def _read_file(item: tuple[str, str]) -> tuple[str, str | None, list[str]]:
    rel, path = item
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return rel, None, []
    return rel, text, chat_examples(rel, text)


def build_corpus(options: DemoOptions, work: Path) -> dict:
    """work/corpus/{train,heldout}.json: {"code": [file texts], "chat": [conversations]}."""
    files = stdlib_files(options.max_files, options.extra_sources)
    items = [(rel, str(path)) for rel, path in files]
    if len(items) > 64 and (os.cpu_count() or 1) > 2:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor() as pool:
            results = list(pool.map(_read_file, items, chunksize=16))
    else:
        results = [_read_file(i) for i in items]
    split = {"train": {"code": [], "chat": [], "files": []}, "heldout": {"code": [], "chat": [], "files": []}}
    chars = 0
    for rel, text, chats in results:
        if text is None or not text.strip():
            continue
        if options.max_chars is not None and chars >= options.max_chars:
            break
        part = split["heldout" if is_heldout(rel) else "train"]
        part["code"].append(text)
        part["chat"].extend(chats)
        part["files"].append(rel)
        chars += len(text)
    if not split["heldout"]["code"]:  # tiny subsets may miss every held-out path: hold out the last file
        for key in ("code", "files"):
            split["heldout"][key].append(split["train"][key].pop())
    while len(split["heldout"]["chat"]) < 4 and len(split["train"]["chat"]) > 8:
        split["heldout"]["chat"].append(split["train"]["chat"].pop())
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    for name, part in split.items():
        (out / f"{name}.json").write_text(json.dumps(part))
    stats = {name: {"files": len(p["files"]), "chat_examples": len(p["chat"]),
                    "code_chars": sum(map(len, p["code"])), "chat_chars": sum(map(len, p["chat"]))}
             for name, p in split.items()}
    stats["stdlib"] = str(stdlib_root())
    stats["extra_sources"] = list(options.extra_sources)
    stats["python"] = sys.version.split()[0]
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    extra = f" + {', '.join(options.extra_sources)}" if options.extra_sources else ""
    say(f"corpus from {stats['stdlib']}{extra} (Python {stats['python']}): "
        f"{stats['train']['files']} files + {stats['train']['chat_examples']} chat examples for training, "
        f"{stats['heldout']['files']} files + {stats['heldout']['chat_examples']} held out "
        f"({(stats['train']['code_chars'] + stats['train']['chat_chars']) / 1e6:.1f}M training characters)")
    return stats


def load_corpus(work: Path, name: str, options: "DemoOptions | None" = None) -> dict:
    """A corpus split; rebuilt (deterministically) when the work directory lacks it, e.g. when only
    the model directory was carried over to another machine."""
    path = work / "corpus" / f"{name}.json"
    if not path.is_file():
        say(f"{path} is missing: rebuilding the corpus")
        build_corpus(options or DemoOptions(), work)
    return json.loads(path.read_text())


def training_documents(work: Path, seed: int, options: "DemoOptions | None" = None) -> list[str]:
    """Raw files and chat examples in one seeded shuffled order."""
    part = load_corpus(work, "train", options)
    docs = part["code"] + part["chat"]
    random.Random(seed).shuffle(docs)
    return docs


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


# ---- stages ----------------------------------------------------------------------------------
class DemoBuild:
    def __init__(self, options: DemoOptions):
        import torch

        from verispec.loading.model_loader import parse_device

        if options.preset not in PRESETS:
            raise ValueError(f"--preset {options.preset!r} is not one of {', '.join(PRESETS)}")
        bad = [s for s in (*options.stages, *options.force) if s not in STAGES]
        if bad:
            raise ValueError(f"unknown stage(s) {', '.join(bad)} (stages: {', '.join(STAGES)})")
        self.options = options
        self.size = options.size
        self.work = Path(options.work)
        self.model_dir = self.work / "model"
        self.device = parse_device(options.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.record_path = self.work / "build.json"
        self.record = json.loads(self.record_path.read_text()) if self.record_path.is_file() else {}

    def save_record(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.record_path.write_text(json.dumps(self.record, indent=2))

    def wanted(self, stage: str, done: bool) -> bool:
        if stage not in self.options.stages:
            return False
        if done and stage not in self.options.force:
            say(f"{stage}: done already (--force {stage} redoes it)")
            return False
        return True

    def run(self) -> dict:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars: noise in logs
        t0 = time.perf_counter()
        o = self.options
        if self.wanted("corpus", (self.work / "corpus" / "stats.json").is_file()):
            self.record["corpus"] = build_corpus(o, self.work)
            self.save_record()
        if self.wanted("tokenizer", (self.model_dir / "tokenizer.json").is_file()):
            self.stage_tokenizer()
        if self.wanted("pretrain", (self.model_dir / "model.safetensors").is_file()):
            self.stage_pretrain()
        if self.wanted("mtp", (self.model_dir / "mtp.safetensors").is_file()):
            self.stage_drafter("mtp")
        if self.wanted("eagle3", (self.model_dir / "eagle3" / "config.json").is_file()):
            self.stage_drafter("eagle3")
        if self.wanted("select", self.select_done()):
            self.stage_select()
        if "card" in o.stages:
            self.stage_card()
        say(f"done in {time.perf_counter() - t0:.0f}s")
        return self.record

    def select_done(self) -> bool:
        path = self.model_dir / "demo.json"
        return path.is_file() and not json.loads(path.read_text()).get("unmeasured")

    def stage_tokenizer(self) -> None:
        import torch

        t0 = time.perf_counter()
        docs = training_documents(self.work, self.options.seed, self.options)
        tok = train_tokenizer(docs, self.size.vocab_size, self.model_dir)
        sep = tok.convert_tokens_to_ids("<|endoftext|>")
        tokens = self.work / "tokens"
        tokens.mkdir(parents=True, exist_ok=True)
        torch.save(encode_stream(tok, docs, sep), tokens / "train.pt")
        held = load_corpus(self.work, "heldout", self.options)
        torch.save(encode_stream(tok, held["code"], sep), tokens / "heldout_code.pt")
        torch.save(encode_stream(tok, held["chat"], sep), tokens / "heldout_chat.pt")
        n = len(torch.load(tokens / "train.pt"))
        chars = sum(map(len, docs))
        self.record["tokenizer"] = {"vocab_size": len(tok), "train_tokens": n, "chars_per_token": round(chars / n, 2),
                                    "seconds": round(time.perf_counter() - t0, 1)}
        self.save_record()
        say(f"tokenizer: {len(tok)} tokens; training stream {n:,} tokens ({chars / n:.2f} characters per token), "
            f"{time.perf_counter() - t0:.0f}s")

    def stage_pretrain(self) -> None:
        import torch
        from transformers import AutoTokenizer, GenerationConfig, Qwen3_5ForCausalLM

        o, size = self.options, self.size
        tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        config = model_config(size, tok)
        torch.manual_seed(o.seed)
        model = Qwen3_5ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        stream = torch.load(self.work / "tokens" / "train.pt")
        say(f"pretraining a {n_params / 1e6:.1f}M-parameter qwen3_5_text model on {len(stream):,} tokens "
            f"(batch {size.batch_size} x {size.seq_len}, {o.device or self.device}; Gated DeltaNet: "
            f"{gdn_kernel_note(self.device)})")
        heldout = torch.load(self.work / "tokens" / "heldout_code.pt")
        result = pretrain(model, stream, size.seq_len, size.batch_size, size.lr, o.pretrain_steps,
                          o.pretrain_seconds, self.device, self.work / "pretrain" / "state.pt", seed=o.seed,
                          progress=o.progress, compile=o.compile, heldout=heldout,
                          eval_every_s=30.0 if o.preset == "demo" else 5.0)
        model.to(torch.bfloat16)
        model.save_pretrained(str(self.model_dir), safe_serialization=True)
        GenerationConfig(eos_token_id=[config.eos_token_id, config.pad_token_id],
                         pad_token_id=config.pad_token_id).save_pretrained(str(self.model_dir))
        del model
        ppl_code = perplexity(self.model_dir, torch.load(self.work / "tokens" / "heldout_code.pt"), size.seq_len,
                              self.device)
        ppl_chat = perplexity(self.model_dir, torch.load(self.work / "tokens" / "heldout_chat.pt"), size.seq_len,
                              self.device)
        self.record["pretrain"] = {
            "parameters": n_params, "steps": result.steps, "kept_step": result.kept_step,
            "seconds": round(result.seconds, 1),
            "tokens": result.tokens, "tokens_per_second": round(result.tokens / max(result.seconds, 1e-9)),
            "epochs": round(result.tokens / len(stream), 2), "final_train_loss": round(result.final_loss, 4),
            "heldout_perplexity_code": round(ppl_code, 3), "heldout_perplexity_chat": round(ppl_chat, 3),
            "batch_size": size.batch_size, "seq_len": size.seq_len, "lr": size.lr, "device": str(self.device),
            "size": asdict(size),
        }
        self.save_record()
        rate = result.tokens / max(result.seconds, 1e-9)
        say(f"pretrained {result.steps} steps in {result.seconds:.0f}s ({rate:,.0f} tok/s, {result.tokens / len(stream):.1f} epochs); held-out perplexity: code {ppl_code:.2f}, "
            f"chat {ppl_chat:.2f}")

    def stage_drafter(self, method: str) -> None:
        from verispec.train import DrafterTrainOptions, Method, train_drafter

        o, size = self.options, self.size
        run_dir = self.work / method
        opts = DrafterTrainOptions(
            method=Method(method), model=str(self.model_dir), out=str(run_dir), steps=o.drafter_steps,
            max_seconds=o.drafter_seconds, batch_size=o.drafter_batch, seq_len=o.drafter_seq_len,
            lr=1e-3 if o.preset == "demo" else 3e-3, warmup_steps=50 if o.preset == "demo" else 5,
            ttt_steps=3 if method == "eagle3" else 2, device=o.device, seed=o.seed,
            gen_sequences=o.drafter_gen_sequences, gen_prompt_len=min(64, o.drafter_seq_len // 4),
            eval_every=0, eval_prompts=o.eval_prompts, eval_tokens=min(o.eval_tokens, 64), save_every=1000,
            draft_vocab_size=size.draft_vocab_size if method == "eagle3" else None, progress=o.progress,
            vocab_sample_tokens=o.vocab_sample_tokens,
            max_data_tokens=20_000_000, restart="mtp" in o.force or "eagle3" in o.force,
        )
        summary = train_drafter(opts, documents=training_documents(self.work, o.seed, o))
        if method == "mtp":
            shutil.copy2(run_dir / "mtp.safetensors", self.model_dir / "mtp.safetensors")
        else:
            dest = self.model_dir / "eagle3"
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / "model.safetensors", dest / "model.safetensors")
            config = json.loads((run_dir / "config.json").read_text())
            config["speculators_config"]["verifier"]["name_or_path"] = DEMO_NAME  # not this machine's path
            (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self.record[method] = {k: v for k, v in summary.items() if k not in ("files", "out", "target")}
        self.save_record()

    def prompts(self) -> list[tuple[str, list[int]]]:
        """Held-out prompts for the measurements: the start of held-out files (raw) and the user
        turn of held-out chat examples (with the generation prompt)."""
        from verispec.loading.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(self.model_dir)
        held = load_corpus(self.work, "heldout", self.options)
        n = max(1, self.options.eval_prompts // 2)
        out = []
        for text in held["code"][:n]:
            out.append(("code", tok.encode(text)[:64]))
        for conv in held["chat"][:n]:
            user = conv.split("<|im_start|>assistant\n")[0]
            out.append(("chat", tok.encode(user + "<|im_start|>assistant\n")))
        return out

    def _weights_stamp(self) -> list:
        """What the select measurements depend on: the weights' sizes and times, the prompts' length."""
        stamp = []
        for name in ("model.safetensors", "mtp.safetensors", "eagle3/model.safetensors"):
            path = self.model_dir / name
            stamp.append([name, path.stat().st_size, path.stat().st_mtime_ns] if path.is_file() else [name])
        return stamp + [self.options.eval_tokens, self.options.eval_prompts, str(self.device)]

    def _device_label(self, dtype: str) -> str:
        """"cuda (NVIDIA H200, bfloat16)" / "cpu (2 threads, float32)": what a timing was taken on."""
        import torch

        if self.device.type == "cuda":
            return f"{self.device.type} ({torch.cuda.get_device_name(self.device)}, {dtype})"
        return f"{self.device.type} ({torch.get_num_threads()} threads, {dtype})"

    def stage_select(self) -> None:
        """Measure plain, MTP (depth 1-3) and EAGLE3 (1-4 drafts) decoding on held-out prompts with
        the engine as `verispec serve` runs it; the fastest speculative configuration becomes the default.

        Each configuration's row is saved as it is measured (work/select-partial.json), and past
        `select_seconds` the remaining ones are left for a rerun, which measures only those."""
        from verispec.config import EngineConfig
        from verispec.engine.engine import Engine
        from verispec.engine.params import SamplingParams

        o = self.options
        prompts = self.prompts()
        partial_path = self.work / "select-partial.json"
        stamp = self._weights_stamp()
        partial = json.loads(partial_path.read_text()) if partial_path.is_file() else {}
        if partial.get("stamp") != stamp:
            partial = {"stamp": stamp, "rows": {}, "reference": None}
        rows = partial["rows"]
        params = SamplingParams(max_tokens=o.eval_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        measured_now = 0
        for name in SELECT_ORDER:
            if name in rows:
                continue
            if (o.select_seconds is not None and time.perf_counter() - t0 > o.select_seconds
                    and measured_now and len(rows) >= 2):
                break
            measured_now += 1
            method, _, depth = name.partition("-")
            kw = ({} if method == "ar" else {"mtp": True, "mtp_depth": int(depth)} if method == "mtp" else
                  {"eagle3": str(self.model_dir / "eagle3"), "draft_block": int(depth)})
            engine = Engine.load(EngineConfig(model=str(self.model_dir), device=o.device, **kw))
            engine.prewarm()
            generated = drafted = accepted = rounds = 0
            decode_s = 0.0
            outputs = []
            for _, ids in prompts:
                result = engine.generate_all(ids, params)
                st = result.stats
                generated += st.generated_tokens
                drafted, accepted, rounds = drafted + st.drafted, accepted + st.accepted, rounds + st.rounds
                decode_s += st.decode_ms / 1000
                outputs.append(result.token_ids)
            engine_dtype = str(engine.dtype).removeprefix("torch.")
            del engine
            if name == "ar":
                partial["reference"] = outputs
            reference = partial["reference"]
            same = f"{sum(a == b for a, b in zip(outputs, reference))}/{len(prompts)}" if reference else "n/a"
            rows[name] = {"config": name,
                          "decode_tok_per_s": round((generated - len(prompts)) / max(decode_s, 1e-9), 1),
                          "acceptance": round(accepted / drafted, 4) if drafted else None,
                          "tokens_per_round": round((generated - len(prompts)) / rounds, 3) if rounds else None,
                          "identical_to_plain_greedy": same, "device": self._device_label(engine_dtype)}
            partial_path.write_text(json.dumps(partial))
            r = rows[name]
            say(f"select: {name:9s} {r['decode_tok_per_s']:8.1f} tok/s  acceptance {r['acceptance']}  "
                f"tokens/round {r['tokens_per_round']}  identical {r['identical_to_plain_greedy']}")
        spec_rows = [rows[n] for n in SELECT_ORDER if n in rows and n != "ar"]
        if not spec_rows:
            say("select: no speculative configuration measured yet; rerun to continue")
            return
        best = max(spec_rows, key=lambda r: r["decode_tok_per_s"])
        method, _, depth = best["config"].partition("-")
        speculation = ({"method": "mtp", "mtp_depth": int(depth)} if method == "mtp" else
                       {"method": "eagle3", "eagle3": "eagle3", "draft_block": int(depth)})
        plain = rows["ar"]["decode_tok_per_s"] if "ar" in rows else None
        unmeasured = [n for n in SELECT_ORDER if n not in rows]
        why = (f"fastest measured: {best['config']} at {best['decode_tok_per_s']} tok/s vs plain {plain} tok/s "
               f"(greedy, {len(prompts)} held-out prompts x {o.eval_tokens} tokens, {self.device})"
               + (f"; not measured yet: {', '.join(unmeasured)}" if unmeasured else ""))
        # a default per device type: what pays on a GPU (captured drafter steps) and on a CPU (drafter
        # compute) differs; a select run on one device keeps the other's measurements and choice
        device_type = self.device.type
        earlier_path = self.model_dir / "demo.json"
        earlier = json.loads(earlier_path.read_text()) if earlier_path.is_file() else {}
        by_device = {k: v for k, v in (earlier.get("speculation_by_device") or {}).items() if k != device_type}
        why_by_device = {k: v for k, v in (earlier.get("why_by_device") or {}).items() if k != device_type}
        by_device[device_type], why_by_device[device_type] = speculation, why
        kept = [r for r in earlier.get("measurements", []) if _device_type(r) != device_type]
        default_type = "cuda" if "cuda" in by_device else device_type
        demo = {"speculation": by_device[default_type], "why": why_by_device[default_type],
                "speculation_by_device": by_device, "why_by_device": why_by_device,
                "measurements": [rows[n] for n in SELECT_ORDER if n in rows] + kept, "unmeasured": unmeasured}
        (self.model_dir / "demo.json").write_text(json.dumps(demo, indent=2) + "\n")
        self.record["select"] = demo
        self.save_record()
        say(f"default speculation: {speculation} ({demo['why']})"
            + (" -- rerun the select stage to measure the rest" if unmeasured else ""))

    def samples(self) -> list[dict]:
        from verispec.demo.default import engine_config
        from verispec.engine.engine import Engine
        from verispec.engine.params import SamplingParams

        engine = Engine.load(engine_config(self.model_dir, device=self.options.device))
        tok = engine.tokenizer
        cases = [
            ("raw", "def fibonacci(n):", 0.0),
            ("chat", "def fibonacci(n):", 0.0),
            ("chat", "Write a Python function `is_prime` that returns True if n is a prime number.", 0.0),
            ("raw", "import os\n\n\ndef list_python_files(root):\n", 0.0),
            ("raw", "class Stack:\n", 0.8),
        ]
        out = []
        for kind, prompt, temperature in cases:
            ids = (tok.encode(prompt) if kind == "raw" else
                   tok.chat_prompt_ids([{"role": "user", "content": prompt}])[1])
            params = SamplingParams(max_tokens=min(160, self.options.eval_tokens * 2), temperature=temperature,
                                    top_p=0.95 if temperature else 1.0, seed=0)
            result = engine.generate_all(ids, params)
            s = result.stats
            out.append({"kind": kind, "prompt": prompt, "temperature": temperature, "text": result.text,
                        "tokens": s.generated_tokens, "method": s.method,
                        "acceptance": round(s.accepted / s.drafted, 3) if s.drafted else None})
        return out

    def stage_card(self) -> None:
        samples = self.samples()
        self.record["samples"] = samples
        self.save_record()
        (self.model_dir / "README.md").write_text(model_card(self.record, self.options))
        out = Path(self.options.out)
        if out.resolve() != self.model_dir.resolve():
            copy_model(self.model_dir, out)
        total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        say(f"model written to {out} ({total / 1e6:.1f} MB)")
        if total > SHIP_LIMIT_BYTES:
            say(f"warning: {total / 1e6:.1f} MB is over the {SHIP_LIMIT_BYTES / 1e6:.0f} MB the package may ship")


def copy_model(src: Path, out: Path) -> None:
    """The shippable files of the finished model into `out` (files there from an earlier build
    that this one would write are replaced; nothing else there is touched)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (out / name).exists():
            (out / name).unlink()
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if (out / "eagle3").is_dir():
        shutil.rmtree(out / "eagle3")
    if (src / "eagle3").is_dir():
        shutil.copytree(src / "eagle3", out / "eagle3")


def _device_type(row: dict) -> str:
    """A measurement row's device type: "cuda" from "cuda", "cuda:0" or "cuda (H200, bf16)"."""
    return str(row.get("device", "")).split(" ")[0].split(":")[0]


def _fmt(value, spec: str = "") -> str:
    return "n/a" if value is None else format(value, spec)


def model_card(record: dict, options: DemoOptions) -> str:
    p = record.get("pretrain", {})
    c = record.get("corpus", {})
    size = p.get("size") or asdict(options.size)
    select = record.get("select", {})
    lines = [
        "# verispec demo model",
        "",
        "A small Qwen3.5-architecture model (`qwen3_5_text`: Gated DeltaNet layers with a gated full-attention",
        "layer every fourth) trained from scratch on the Python standard library's source, with a",
        "multi-token-prediction head (`mtp.safetensors`) and an EAGLE3 drafter (`eagle3/`) trained by",
        "`verispec train-drafter`. Built by `scripts/train_demo_model.py` (`make demo-model`); a genuine",
        "Hugging Face checkpoint (transformers loads it). It writes plausible-looking Python, not correct",
        "programs: it is a demonstration of the server and of speculative decoding, not a useful assistant.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {_fmt(p.get('parameters'), ',')} (tied embedding; bfloat16) |",
        f"| shape | hidden {size['hidden_size']}, {size['num_layers']} layers, "
        f"intermediate {size['intermediate_size']}, {size['num_heads']} heads ({size['num_kv_heads']} kv) x {size['head_dim']}, GDN {size['linear_key_heads']}/"
        f"{size['linear_value_heads']} heads x {size['linear_head_dim']} |",
        f"| vocabulary | {record.get('tokenizer', {}).get('vocab_size', 'n/a')} byte-level BPE tokens |",
        f"| training data | Python {c.get('python', '?')} stdlib"
        f"{' + ' + ', '.join(c['extra_sources']) if c.get('extra_sources') else ''}: "
        f"{c.get('train', {}).get('files', '?')} files + "
        f"{c.get('train', {}).get('chat_examples', '?')} chat examples, "
        f"{_fmt(record.get('tokenizer', {}).get('train_tokens'), ',')} tokens |",
        f"| pretraining | {p.get('steps', '?')} steps x {p.get('batch_size', '?')} x {p.get('seq_len', '?')} tokens "
        f"({p.get('epochs', '?')} epochs) in {p.get('seconds', '?')} s on {p.get('device', '?')} |",
        f"| held-out perplexity | {p.get('heldout_perplexity_code', 'n/a')} on "
        f"{c.get('heldout', {}).get('files', '?')} held-out stdlib files; {p.get('heldout_perplexity_chat', 'n/a')} on held-out chat examples |",
        "",
        "## Speculative decoding",
        "",
    ]
    by_device = select.get("speculation_by_device") or {}
    if by_device:
        for device_type, spec in by_device.items():
            lines.append(f"- default on {device_type}: `{json.dumps(spec)}` — "
                         f"{(select.get('why_by_device') or {}).get(device_type, '')}.")
    else:
        lines.append(f"Default: `{json.dumps(select.get('speculation'))}` — {select.get('why', 'not measured')}.")
    lines += ["",
              "| device | configuration | decode tok/s | vs plain | acceptance | tokens per target pass | "
              "identical to plain greedy |",
              "|---|---|---|---|---|---|---|"]
    rows = select.get("measurements", [])
    plain = {_device_type(r): r.get("decode_tok_per_s") for r in rows if r["config"] == "ar"}
    for row in rows:
        base, speed = plain.get(_device_type(row)), row.get("decode_tok_per_s")
        ratio = f"{speed / base:.2f}x" if isinstance(speed, (int, float)) and isinstance(base, (int, float)) else "n/a"
        lines.append(f"| {row.get('device', '?')} | {row['config']} | {speed} | {ratio} | {_fmt(row['acceptance'])} | "
                     f"{_fmt(row['tokens_per_round'])} | {row['identical_to_plain_greedy']} |")
    for method in ("mtp", "eagle3"):
        m = record.get(method)
        if m and m.get("after"):
            before = m.get("before") or {}
            lines.append("")
            lines.append(f"{method}: trained {m['steps']} steps in {m['seconds']} s; acceptance on held-out text "
                         f"{_fmt(before.get('acceptance'))} (untrained) -> {m['after']['acceptance']} at "
                         f"{m['eval_drafts']} drafts per round" +
                         (f"; draft vocabulary {m['draft_vocab_size']} ids covering "
                          f"{100 * m['draft_vocab_coverage']:.1f}% of the target's predictions"
                          if m.get("draft_vocab_size") else ""))
    lines += ["", "## Samples", ""]
    for s in record.get("samples", []):
        how = "greedy" if not s["temperature"] else f"temperature {s['temperature']}, top_p 0.95, seed 0"
        where = "raw completion" if s["kind"] == "raw" else "chat"
        lines.append(f"**{where}**, {how} ({s['method']}, acceptance {_fmt(s['acceptance'])}): `{s['prompt']!r}`")
        lines.append("")
        lines.append("```")
        lines.append((s["prompt"] if s["kind"] == "raw" else "") + s["text"])
        lines.append("```")
        lines.append("")
    lines += ["## Reproduce", "", "```bash", "python scripts/train_demo_model.py   # ~10 minutes on one H200",
              "```", ""]
    return "\n".join(lines)
