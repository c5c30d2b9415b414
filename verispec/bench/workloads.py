"""Bench workloads where the answer repeats the prompt, so model-free drafting (--suffix, --ngram)
has something to copy: beside `random` words (bench/prompts.py), edit a given code file, answer
with quotes from a given document, re-emit JSON with one field changed.

Every prompt is built deterministically from text shipped with verispec itself (its own source
files and their docstrings; JSON records from a seeded generator), so runs compare across machines
and need no network. Each starts with its own tag, as random prompts do, so no prompt cache can
flatter TTFT; its size is set in words (code tokens and words alike split on whitespace).
"""
from __future__ import annotations

import ast
import collections
import json
import random
import re
from enum import Enum
from functools import lru_cache
from pathlib import Path

from verispec.bench.prompts import WORDS, prompt_tag, text_prompt

PACKAGE = Path(__file__).resolve().parents[1]


class Workload(str, Enum):
    RANDOM = "random"  # random words: nothing to copy (bench/prompts.py)
    EDIT = "edit"  # a source file of verispec's, with a rename asked for: the answer is the file again
    QUOTE = "quote"  # verispec's docstrings as a document, answered with quotes from it
    JSON = "json"  # seeded JSON records, re-emitted with one field changed


@lru_cache(maxsize=1)
def _sources() -> list[tuple[str, str]]:
    """(path inside the package, text) of verispec's Python files, in a fixed order."""
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    return [(str(p.relative_to(PACKAGE.parent)), p.read_text(encoding="utf-8")) for p in files]


@lru_cache(maxsize=1)
def _docstrings() -> list[str]:
    """The module docstrings of verispec's files: prose, in a fixed order."""
    out = []
    for _, text in _sources():
        try:
            doc = ast.get_docstring(ast.parse(text))
        except SyntaxError:
            continue
        if doc and len(doc.split()) >= 20:
            out.append(doc)
    return out


def _take_words(pieces: list[str], start: int, num_words: int, sep: str) -> str:
    """Whole pieces from `start` on (wrapping around) until about num_words words; the last piece
    is cut at a line so the text stays about that size."""
    out, count, i = [], 0, start
    while count < num_words:
        piece = pieces[i % len(pieces)]
        words = len(piece.split())
        if count + words > num_words:
            lines, kept = piece.splitlines(), []
            for line in lines:
                if count >= num_words:
                    break
                kept.append(line)
                count += len(line.split())
            out.append("\n".join(kept))
            break
        out.append(piece)
        count += words
        i += 1
    return sep.join(out)


def _frequent_identifier(code: str, rng: random.Random) -> str:
    names = collections.Counter(n for n in re.findall(r"\b[a-z_][a-z0-9_]{4,}\b", code)
                                if n not in {"return", "import", "class", "while", "raise", "false", "lambda"})
    common = [n for n, _ in names.most_common(8)] or ["value"]
    return rng.choice(common)


def edit_prompt(tag: str, num_words: int, seed: str) -> str:
    rng = random.Random(seed)
    sources = _sources()
    start = rng.randrange(len(sources))
    name = sources[start][0]
    code = _take_words([text for _, text in sources], start, num_words, "\n\n")
    old = _frequent_identifier(code, rng)
    return (f"{tag}\nHere is the file {name}:\n```python\n{code}\n```\n"
            f"Rename `{old}` to `{old}_v2` everywhere in this file and reply with the whole updated file in one "
            "code block, nothing else.")


def quote_prompt(tag: str, num_words: int, seed: str) -> str:
    rng = random.Random(seed)
    docs = _docstrings()
    document = _take_words(docs, rng.randrange(len(docs)), num_words, "\n\n")
    topic = rng.choice([w for w in re.findall(r"[a-z]{6,}", document.lower())] or ["cache"])
    return (f"{tag}\nDocument:\n{document}\n\nWhat does the document say about \"{topic}\"? Answer only with "
            "sentences quoted exactly from the document, each on its own line in quotation marks.")


def json_prompt(tag: str, num_words: int, seed: str) -> str:
    rng = random.Random(seed)
    records, words = [], 0
    while words < num_words:
        record = {"id": len(records) + 1, "name": f"{rng.choice(WORDS)} {rng.choice(WORDS)}",
                  "kind": rng.choice(["user", "group", "service"]), "score": round(rng.uniform(0, 100), 2),
                  "tags": rng.sample(WORDS, 2)}
        records.append(record)
        words += len(json.dumps(record).split())
    target = rng.randrange(len(records)) + 1
    document = json.dumps({"records": records}, indent=1)
    return (f"{tag}\nHere is a JSON document:\n{document}\n\nReply with the same JSON, unchanged except that the "
            f"record with \"id\": {target} has \"score\": 42. Output only the JSON.")


BUILDERS = {Workload.EDIT: edit_prompt, Workload.QUOTE: quote_prompt, Workload.JSON: json_prompt}


def workload_prompt(workload: Workload, label: str, context: int, repeat: int, num_words: int) -> str:
    """A prompt of about num_words words for (context, repeat): the same arguments, the same text."""
    if workload is Workload.RANDOM:
        return text_prompt(label, context, repeat, num_words)
    tag = prompt_tag(f"{label} {workload.value}", context, repeat)
    return BUILDERS[workload](tag, num_words, tag)


def tokenized_workload_prompt(tokenizer, workload: Workload, label: str, context: int, repeat: int) -> list[int]:
    """At most `context` ids (a checkpoint's tokenizer): the prompt is made smaller, never cut, so its
    instruction at the end stays."""
    num_words = max(8, int(context * 0.75))
    while True:
        ids = tokenizer.encode(workload_prompt(workload, label, context, repeat, num_words), add_special_tokens=True)
        if len(ids) <= context or num_words <= 8:
            return ids[:context] if num_words <= 8 else ids
        num_words = max(8, int(num_words * context / len(ids) * 0.95))
