"""Where speculative greedy first leaves plain greedy, layer by layer.

Runs gpu_spec_identity's tiny model (one family, one quantization) plainly and with an
always-right proposer (so every verify row before the divergence has the plain run's prefix),
records each decoder layer's attention output, MLP input and MLP output for every position as
each pass computed it, and prints the first (position, layer, stage) whose bits differ.

    python3 scripts/gpu_identity_trace.py --model qwen3 --quant mlx-4bit [--graphs] [--trace-always]

Without --graphs the passes run eagerly (hooks do not run inside a CUDA graph replay); the
script first says whether the divergence shows without graphs too.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_spec_identity import SHAPE, Replay, divergence  # noqa: E402

from verispec.cli import main as main_cli  # noqa: E402
from tools.tiny import build_tiny_model, build_tokenizer, corpus_text  # noqa: E402
from verispec.engine.engine import Engine, load_engine  # noqa: E402
from verispec.engine.params import SamplingParams  # noqa: E402


class Recorder:
    """Rows of chosen module inputs / outputs by (stage, layer, position), as [H] float32 CPU tensors."""

    def __init__(self, model):
        self.rows: dict[tuple[str, int, int], list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self.positions = self.input_ids = None
        self.on = False
        model.register_forward_pre_hook(self._model_pre, with_kwargs=True)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_hook(self._hook("attn_out", i))
            layer.mlp.register_forward_hook(self._hook("mlp_in", i, use_input=True))
            layer.mlp.register_forward_hook(self._hook("mlp_out", i))
            layer.mlp.down_proj.register_forward_hook(self._hook("act", i, use_input=True))

    def _model_pre(self, module, args, kwargs):
        self.input_ids, self.positions = args[0], args[1]

    def _hook(self, stage: str, layer: int, use_input: bool = False):
        def hook(module, inputs, output):
            if not self.on:
                return
            t = inputs[0] if use_input else output
            t = t.reshape(self.positions.shape + t.shape[-1:]).float().cpu()
            pos, ids = self.positions.cpu(), self.input_ids.cpu()
            for b in range(pos.shape[0]):
                for j in range(pos.shape[1]):
                    self.rows[(stage, layer, int(pos[b, j]))].append((int(ids[b, j]), t[b, j].clone()))
        return hook


STAGES = ("attn_out", "mlp_in", "act", "mlp_out")


def first_difference(plain: Recorder, spec: Recorder, tokens: list[int], start: int, upto: int, layers: int):
    """tokens: prompt + plain continuation; positions start..upto (inclusive) compared."""
    report = []
    for p in range(start, upto + 1):
        for layer in range(layers):
            for stage in STAGES:
                a = [r for tok, r in plain.rows.get((stage, layer, p), []) if tok == tokens[p]]
                b = [r for tok, r in spec.rows.get((stage, layer, p), []) if tok == tokens[p]]
                if not a or not b:
                    continue
                ref = a[-1]
                for k, r in enumerate(b):
                    if not torch.equal(ref, r):
                        d = (ref - r).abs()
                        report.append(dict(position=p, layer=layer, stage=stage, computation=k, of=len(b),
                                           max_abs=float(d.max()), elements=int((d > 0).sum())))
                        return report
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--quant", default="mlx-4bit")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--trace-always", action="store_true", help="trace the first prompt even with no divergence")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    fdir = root / args.model
    build_tiny_model(fdir, args.model, tokenizer_dir=root / "tok", **SHAPE,
                     **({"head_dim": 64} if args.model == "qwen3" else {}))
    mdir = fdir
    if args.quant != "none":
        mdir = root / f"{args.model}-{args.quant}"
        if main_cli(["quantize", "-m", str(fdir), "--format", args.quant, "--out", str(mdir)]) != 0:
            raise SystemExit("quantize failed")
    plain_engine = load_engine(str(mdir), dtype=args.dtype, device=args.device)
    model, tok = plain_engine.model, plain_engine.tokenizer
    text = corpus_text()
    prompts = [tok.encode(text[i * 997: i * 997 + 400]) for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    if args.graphs:
        plain_engine.capture_graphs()
    plain = [plain_engine.generate_all(p, params).token_ids for p in prompts]
    vocab = model.vocab_size
    divs = []
    for p, cont in zip(prompts, plain):
        eng = Engine(model, tok, plain_engine.config, proposer=Replay(cont, 0, vocab), num_drafts=args.k)
        if args.graphs:
            eng.capture_graphs()
        divs.append(divergence(cont, eng.generate_all(p, params).token_ids))
    print(f"{args.model} {args.quant} {args.dtype} graphs={args.graphs}: first divergence per prompt {divs}", flush=True)
    result = dict(divergences=divs, traces=[])
    rec = Recorder(model)
    for i, (p, cont, d) in enumerate(zip(prompts, plain, divs)):
        if d is None and not (args.trace_always and i == 0):
            continue
        tokens = p + cont
        rec.rows.clear()
        rec.on = True
        Engine(model, tok, plain_engine.config).generate_all(p, params)  # no graphs: hooks see every pass
        plain_rows = dict(rec.rows)
        rec.rows.clear()
        Engine(model, tok, plain_engine.config, proposer=Replay(cont, 0, vocab),
               num_drafts=args.k).generate_all(p, params)
        rec.on = False
        plain_rec = Recorder.__new__(Recorder)
        plain_rec.rows = plain_rows
        upto = len(p) + (d if d is not None else len(cont) - 1)
        report = first_difference(plain_rec, rec, tokens, 0, upto, len(model.model.layers))
        print(f"  prompt {i} ({len(p)} tokens, divergence at generated token {d}): "
              f"{report[0] if report else 'no layer differs up to the divergence'}", flush=True)
        result["traces"].append(dict(prompt=i, divergence=d, first=report))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
