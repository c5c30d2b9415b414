"""The demo model's corpus (`tools/demo_build/build.py`'s first stage): the Python standard library's
own source, every .py file under `sysconfig.get_paths()["stdlib"]` in sorted order minus
site-packages, data tables, Python 2 test data and files over 400 KB; files whose
crc32(path) % 50 == 0 held out; beside the raw files, chat examples made from the functions in
them, in the ChatML template."""
from __future__ import annotations

import ast
import json
import os
import random
import sys
import sysconfig
import textwrap
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.demo_build.build import DemoOptions

HOLDOUT_EVERY = 50  # files with crc32(path) % 50 == 0 are held out
MAX_FILE_BYTES = 400_000
SKIPPED_PREFIXES = ("site-packages/", "dist-packages/", "encodings/", "pydoc_data/", "lib2to3/tests/data/",
                    "test/tokenizedata/", "test/encoded_modules/")
CHAT_PER_FILE = 6  # chat examples taken from one file at most
SYSTEM_PROMPT = "You are a helpful coding assistant."


def say(line: str) -> None:
    sys.stderr.write(f"[demo] {line}\n")
    sys.stderr.flush()


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
