"""Held-out perplexity of a model at each quantized format, next to its own stored weights.

Each format is written by `verispec quantize` into a temporary directory and loaded back as a user
would load it; perplexity is measured on windows of held-out text (the embedded demo model's
held-out standard-library files by default: crc32(path) % 50 == 0, never trained on), computed in
float32 on the CPU.

    python scripts/quant_quality.py                        # the embedded demo model
    python scripts/quant_quality.py -m ./my-model --text file.py --windows 16
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORMATS = (("mlx-8bit", 64), ("mlx-6bit", 64), ("mlx-4bit", 32), ("mlx-4bit", 64), ("mlx-4bit", 128),
           ("mlx-3bit", 64), ("fp8", None), ("nvfp4", None))


def heldout_text(max_chars: int) -> str:
    from tools.demo_build.corpus import is_heldout, stdlib_files

    parts, total = [], 0
    for rel, path in stdlib_files():
        if total >= max_chars:
            break
        if is_heldout(rel):
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(text)
            total += len(text)
    return "".join(parts)


def perplexity(model_dir: Path, windows: list[list[int]]) -> float:
    import torch

    from verispec.loading.model_loader import load_model

    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            x = torch.tensor([ids])
            out = model(x[:, :-1], torch.arange(len(ids) - 1)[None], model.make_cache(len(ids)))
            logits = model.logits(out.hidden)[0].float()
            nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(ids) - 1
    return math.exp(nll / count)


def weight_mib(model_dir: Path) -> float:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors") if f.name != "mtp.safetensors") / 2 ** 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None, help="model directory (default: the embedded demo model)")
    parser.add_argument("--text", default=None, help="a text file to measure on (default: held-out stdlib files)")
    parser.add_argument("--windows", type=int, default=16, help="windows of --seq-len tokens (default 16)")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # this checkout's verispec and tools
    from verispec.cli import main as cli_main
    from verispec.loading.tokenizer import Tokenizer

    model_dir = Path(args.model) if args.model else ROOT / "verispec/demo/model"
    tokenizer = Tokenizer.from_dir(model_dir)
    need = args.windows * args.seq_len
    text = Path(args.text).read_text() if args.text else heldout_text(max_chars=need * 8)
    ids = tokenizer.encode(text)[:need]
    windows = [ids[i:i + args.seq_len] for i in range(0, len(ids) - args.seq_len + 1, args.seq_len)]
    print(f"model {model_dir.name}: {len(windows)} windows x {args.seq_len} tokens of held-out text\n")
    print("| weights | group | perplexity | vs stored | weight MiB |")
    print("|---|---|---|---|---|")
    base = perplexity(model_dir, windows)
    print(f"| stored (as trained) | - | {base:.3f} | 1.000 | {weight_mib(model_dir):.1f} |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, group in FORMATS:
            out = Path(tmp) / f"{fmt}-{group}"
            argv = ["quantize", "-m", str(model_dir), "--format", fmt, "--out", str(out)]
            if group is not None:
                argv += ["--group-size", str(group)]
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # its one-line summary would split the table
                status = cli_main(argv)
            if status != 0:
                return status
            ppl = perplexity(out, windows)
            print(f"| {fmt} | {group or '-'} | {ppl:.3f} | {ppl / base:.3f} | {weight_mib(out):.1f} |"
                  f"  <!-- {time.perf_counter() - t0:.0f}s -->", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
