"""Training text -> token windows for drafter training, a held-out split, and continuations the
target writes itself.

Documents (files, or every file under a directory, in sorted order; binary files skipped) are
tokenized with the target's tokenizer and joined with its end-of-text token into one stream,
cut into windows of `seq_len` tokens; every `holdout_every`-th window is held out (evaluation
prompts come from there, never from training windows). When the text is larger than the token
budget, documents are taken in a seeded shuffled order so the budget samples all of them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.errors import VerispecError
from verispec.loading.tokenizer import Tokenizer
from verispec.models.base import CausalLM

TOKENIZE_BATCH = 256  # documents per tokenizer call (fast tokenizers encode a batch in parallel)


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(root).parts)


def read_documents(paths: list[str]) -> list[str]:
    """The text of every file named or found under a directory (UTF-8; others skipped)."""
    if not paths:
        raise VerispecError("--data is required: text files or directories to train on")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(f for f in path.rglob("*") if f.is_file() and not _is_hidden(f, path)))
        else:
            raise VerispecError(f"--data {raw}: no such file or directory")
    docs = []
    for f in files:
        data = f.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            docs.append(text)
    if not docs:
        raise VerispecError(f"--data {' '.join(paths)}: no UTF-8 text files found")
    return docs


@dataclass
class TokenData:
    train: torch.Tensor  # [N, T] int64 windows of training text
    heldout: torch.Tensor  # [M, T] held-out windows (evaluation prompts)
    num_tokens: int  # tokens in the stream (train + held-out)


def tokenize_windows(docs: list[str], tokenizer: Tokenizer, seq_len: int, holdout_every: int,
                     max_tokens: int, seed: int) -> TokenData:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    separator = tokenizer.hf.eos_token_id if tokenizer.hf.eos_token_id is not None else None
    pad = tokenizer.hf.pad_token_id
    if pad is not None:  # <|endoftext|>-style document separator when the tokenizer has one
        separator = pad
    stream: list[int] = []
    for start in range(0, len(order), TOKENIZE_BATCH):
        texts = [docs[i] for i in order[start:start + TOKENIZE_BATCH]]
        for ids in tokenizer.hf(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            if separator is not None:
                stream.append(separator)
        if len(stream) >= max_tokens:
            break
    stream = stream[:max_tokens]
    num_windows = len(stream) // seq_len
    if num_windows < 2:
        raise VerispecError(f"--data has {len(stream)} tokens, too few for --seq-len {seq_len} "
                            f"(at least {2 * seq_len} are needed: one training and one held-out window)")
    windows = torch.tensor(stream[:num_windows * seq_len], dtype=torch.long).view(num_windows, seq_len)
    held = torch.zeros(num_windows, dtype=torch.bool)
    held[holdout_every - 1::holdout_every] = True
    if not held.any():
        held[-1] = True
    return TokenData(windows[~held], windows[held], len(stream))


def eval_prompts(heldout: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from the held-out windows (further offsets of the same
    windows when there are fewer windows than prompts)."""
    num_windows, seq_len = heldout.shape
    length = min(length, seq_len)
    per_window = max(1, seq_len // length)
    prompts = []
    for i in range(count):
        window, slot = i % num_windows, (i // num_windows) % per_window
        prompts.append(heldout[window, slot * length:(slot + 1) * length].tolist())
    return prompts


@torch.no_grad()
def generate_continuations(model: CausalLM, prompts: torch.Tensor, total_len: int, num_real_tokens: int,
                           batch_size: int, seed: int) -> torch.Tensor:
    """The target's own continuations of `prompts` [N, P] up to `total_len` tokens: [N, total_len].

    Even rows continue greedily (what greedy serving produces), odd rows by sampling at
    temperature 1 (the sampled outputs a drafter also meets). Batched decoding on the model's
    own cache; end-of-text tokens do not stop a row (the drafter learns what follows them too).
    """
    param = next(model.parameters())
    device = param.device
    generator = torch.Generator(device=device).manual_seed(seed)
    out = []
    for start in range(0, prompts.shape[0], batch_size):
        ids = prompts[start:start + batch_size].to(device)
        b, p = ids.shape
        cache = model.make_cache(total_len, batch_size=b)
        positions = torch.arange(p, device=device)[None].expand(b, -1)
        hidden = model(ids, positions, cache).hidden[:, -1]
        cache.commit(p)
        sampled_rows = (torch.arange(start, start + b, device=device) % 2) == 1
        rows = [ids]
        for pos in range(p, total_len):
            logits = model.logits(hidden).float()
            logits[:, num_real_tokens:] = float("-inf")
            greedy = logits.argmax(-1)
            drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
            token = torch.where(sampled_rows, drawn, greedy)[:, None]
            rows.append(token)
            if pos + 1 == total_len:
                break
            hidden = model(token, torch.full((b, 1), pos, device=device), cache).hidden[:, -1]
            cache.commit(1)
        out.append(torch.cat(rows, dim=1).cpu())
    return torch.cat(out) if out else torch.zeros(0, total_len, dtype=torch.long)
