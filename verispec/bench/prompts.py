"""Benchmark prompts: distinct for every (context, repeat), so no prompt cache can flatter TTFT.

Each prompt starts with its own tag and continues with random words: two prompts share no
prefix beyond the chat template's, whatever the server caches.
"""
from __future__ import annotations

import random

import torch

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education river stone garden window paper music market energy light "
    "summer winter valley bridge engine signal planet forest ocean island village machine letter "
    "picture mountain silver golden quiet rapid gentle bright narrow ancient modern simple careful "
    "strange honest happy heavy early late open close build carry write read listen travel follow "
    "explain remember measure improve create gather discover balance wonder protect"
).split()


def prompt_tag(label: str, context: int, repeat: int) -> str:
    return f"[bench {label} ctx {context} run {repeat}]"


def random_words(num_words: int, seed: str) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def text_prompt(label: str, context: int, repeat: int, num_words: int) -> str:
    tag = prompt_tag(label, context, repeat)
    return f"{tag} {random_words(num_words, tag)}"


def token_prompt(context: int, repeat: int, vocab_size: int, seed: int = 0) -> list[int]:
    """`context` random token ids (random-weight shapes have no tokenizer)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + context * 131 + repeat)
    return torch.randint(0, vocab_size, (context,), generator=gen).tolist()


def tokenized_prompt(tokenizer, label: str, context: int, repeat: int) -> list[int]:
    """Exactly `context` ids of a words prompt (a checkpoint's tokenizer; for real acceptance)."""
    num_words = max(context, 8)
    while True:
        ids = tokenizer.encode(text_prompt(label, context, repeat, num_words), add_special_tokens=True)
        if len(ids) >= context:
            return ids[:context]
        num_words *= 2
