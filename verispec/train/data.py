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


def _prefill(model: CausalLM, ids: torch.Tensor, total_len: int):
    """ids [B, P] through a fresh cache of total_len rows -> (cache, last hidden [B, H])."""
    b, p = ids.shape
    cache = model.make_cache(total_len, batch_size=b)
    positions = torch.arange(p, device=ids.device)[None].expand(b, -1)
    hidden = model(ids, positions, cache).hidden[:, -1]
    cache.commit(p)
    return cache, hidden


def _next_tokens(model: CausalLM, hidden: torch.Tensor, num_real_tokens: int, sampled_rows: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
    """hidden [B, H] -> the next token per row [B]: greedy, or drawn at temperature 1 where sampled_rows."""
    logits = model.logits(hidden).float()
    logits[:, num_real_tokens:] = float("-inf")
    greedy = logits.argmax(-1)
    drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
    return torch.where(sampled_rows, drawn, greedy)


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
        cache, hidden = _prefill(model, ids, total_len)
        sampled_rows = (torch.arange(start, start + b, device=device) % 2) == 1
        rows = [ids]
        for pos in range(p, total_len):
            token = _next_tokens(model, hidden, num_real_tokens, sampled_rows, generator)[:, None]
            rows.append(token)
            if pos + 1 == total_len:
                break
            hidden = model(token, torch.full((b, 1), pos, device=device), cache).hidden[:, -1]
            cache.commit(1)
        out.append(torch.cat(rows, dim=1).cpu())
    return torch.cat(out) if out else torch.zeros(0, total_len, dtype=torch.long)


def read_gen_prompts(path: str) -> list[str]:
    """The prompts of a `--gen-prompts` file: one per line, either a JSON object with a "prompt"
    field (what scripts/make_chat_corpus.py writes: a prompt already rendered with the chat
    template), a JSON string, or the line itself as plain text. Blank lines are skipped."""
    import json

    file = Path(path).expanduser()
    if not file.is_file():
        raise VerispecError(f"--gen-prompts {path}: no such file")
    prompts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        text = line
        if line.lstrip().startswith(("{", '"')):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = line
            if isinstance(value, dict):
                if not isinstance(value.get("prompt"), str):
                    raise VerispecError(f"--gen-prompts {path}:{number}: a JSON line needs a string \"prompt\" field")
                value = value["prompt"]
            text = value if isinstance(value, str) else line
        prompts.append(text)
    if not prompts:
        raise VerispecError(f"--gen-prompts {path}: no prompts in the file")
    return prompts


def split_gen_prompts(prompt_ids: list[list[int]], holdout_every: int) -> tuple[list[list[int]], list[list[int]]]:
    """(generation prompts, held-out evaluation prompts): every `holdout_every`-th prompt is held
    out, so acceptance is measured on prompts the drafter never saw answered."""
    train = [p for i, p in enumerate(prompt_ids) if (i + 1) % holdout_every]
    held = [p for i, p in enumerate(prompt_ids) if (i + 1) % holdout_every == 0]
    if not train:
        raise VerispecError(f"--gen-prompts has {len(prompt_ids)} prompts: too few to keep any for generation "
                            f"after holding out every {holdout_every}-th")
    return train, held


@torch.no_grad()
def generate_answers(model: CausalLM, prompt_ids: list[list[int]], num_rows: int, total_len: int,
                     num_real_tokens: int, end_ids: list[int], batch_size: int, seed: int) -> torch.Tensor:
    """[num_rows, total_len] windows of prompts from `prompt_ids` and the target's own answers.

    Each row takes prompts in a seeded order: a prompt's tokens are fed as they are (its
    positions are the row's), then the target answers; when the answer ends (a token of
    `end_ids`), the row goes on with the next prompt, as a chat goes on with the next turn. So
    windows are full of prompt/answer pairs of any length, without padding, and rows of
    different prompt lengths decode together in one batch. Even rows answer greedily, odd rows
    by sampling at temperature 1 (as generate_continuations).
    """
    if not prompt_ids or any(not p for p in prompt_ids):
        raise VerispecError("--gen-prompts: every prompt must have at least one token")
    param = next(model.parameters())
    device = param.device
    generator = torch.Generator(device=device).manual_seed(seed)
    order = torch.randperm(len(prompt_ids), generator=torch.Generator().manual_seed(seed)).tolist()
    next_prompt = 0
    ends = torch.tensor(sorted(set(end_ids)) or [-1], device=device)
    out = []
    for start in range(0, num_rows, batch_size):
        b = min(batch_size, num_rows - start)
        queues: list[list[int]] = []
        for _ in range(b):  # each row starts with its own prompt
            queues.append(list(prompt_ids[order[next_prompt % len(order)]]))
            next_prompt += 1
        # the tokens every row's first prompt has are fed in one prefill pass
        p = min(total_len, min(len(q) for q in queues))
        ids = torch.tensor([q[:p] for q in queues], device=device)
        queues = [q[p:] for q in queues]
        cache, hidden = _prefill(model, ids, total_len)
        sampled_rows = (torch.arange(start, start + b, device=device) % 2) == 1
        rows = [ids]
        for pos in range(p, total_len):
            chosen = _next_tokens(model, hidden, num_real_tokens, sampled_rows, generator)
            forced = [q.pop(0) if q else -1 for q in queues]
            forced_t = torch.tensor(forced, device=device)
            token = torch.where(forced_t >= 0, forced_t, chosen)
            # a row whose answer just ended (and which is not inside a prompt) takes the next prompt
            ended = (forced_t < 0) & torch.isin(chosen, ends)
            for r in ended.nonzero().flatten().tolist():
                queues[r] = list(prompt_ids[order[next_prompt % len(order)]])
                next_prompt += 1
            rows.append(token[:, None])
            if pos + 1 == total_len:
                break
            hidden = model(token[:, None], torch.full((b, 1), pos, device=device), cache).hidden[:, -1]
            cache.commit(1)
        out.append(torch.cat(rows, dim=1).cpu())
    return torch.cat(out) if out else torch.zeros(0, total_len, dtype=torch.long)
