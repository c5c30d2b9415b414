#!/usr/bin/env python3
"""Build verispec's embedded demo model from scratch (see verispec/demo/build.py for what each
stage does): corpus from the Python standard library, BPE tokenizer, a ~21M-parameter
Qwen3.5-architecture model, its MTP head and an EAGLE3 drafter (`verispec train-drafter`), the
default speculation chosen by measurement, a model card with perplexity and samples.

    python scripts/train_demo_model.py                       # GPU: ~9-10 minutes on one H200
    python scripts/train_demo_model.py --tiny --out /tmp/m   # CPU smoke test: under a minute

Stages skip when their output exists in --work (rerun to continue after an interruption;
pretraining resumes from its checkpoint); --force STAGE redoes one. Split over two commands:
    --stages corpus,tokenizer,pretrain        then        --stages mtp,eagle3,select,card
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.demo_build.build import PRESETS, STAGES, DemoBuild, DemoOptions, tiny_options  # noqa: E402

SIZE_FLAGS = ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "seq_len", "batch_size", "lr",
              "draft_vocab_size")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="verispec/demo/model", help="where the finished model goes (default: the package)")
    p.add_argument("--work", default=None,
                   help="working directory (default build/demo-work, or build/demo-tiny with --tiny)")
    p.add_argument("--tiny", action="store_true", help="CPU test mode: tiny model, ~40 files, seconds per stage")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model size preset (default demo)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--force", default="", help="comma-separated stages to redo even if their output exists")
    p.add_argument("--pretrain-seconds", type=float, default=None, help="pretraining wall-clock budget (default 270)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="pretraining step limit (default: time only)")
    p.add_argument("--drafter-seconds", type=float, default=None, help="budget of each drafter's training (default 75)")
    p.add_argument("--drafter-steps", type=int, default=None)
    p.add_argument("--drafter-batch", type=int, default=None, help="drafter training windows per step (default 32)")
    p.add_argument("--drafter-gen-sequences", type=int, default=None,
                   help="continuations the target writes for drafter training (default 1024)")
    p.add_argument("--vocab-sample-tokens", type=int, default=None,
                   help="target predictions counted for the EAGLE3 draft vocabulary (default 2M)")
    p.add_argument("--max-files", type=int, default=None, help="corpus: at most this many stdlib files")
    p.add_argument("--extra-source", action="append", default=[], metavar="DIR",
                   help="corpus: also every .py file under DIR (repeatable), e.g. the environment's site-packages "
                        "when the machine's stdlib is small")
    p.add_argument("--eval-tokens", type=int, default=None, help="tokens per prompt when measuring speculation")
    p.add_argument("--select-seconds", type=float, default=None,
                   help="select stage: start no new configuration after this long (default 150; a rerun continues)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model for pretraining")
    p.add_argument("--seed", type=int, default=0)
    for name in SIZE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=float if name == "lr" else int, default=None,
                       help="override the preset's " + name)
    args = p.parse_args(argv)

    options = tiny_options() if args.tiny else DemoOptions()
    overrides = dict(out=args.out, stages=tuple(s for s in args.stages.split(",") if s),
                     force=tuple(s for s in args.force.split(",") if s), seed=args.seed, compile=args.compile)
    overrides["work"] = args.work or ("build/demo-tiny" if args.tiny else "build/demo-work")
    for flag in ("preset", "device", "pretrain_seconds", "pretrain_steps", "drafter_seconds", "drafter_steps",
                 "drafter_batch", "drafter_gen_sequences", "vocab_sample_tokens", "max_files",
                 "eval_tokens", "select_seconds"):
        if getattr(args, flag) is not None:
            overrides[flag] = getattr(args, flag)
    if args.pretrain_steps is not None and args.pretrain_seconds is None:
        overrides["pretrain_seconds"] = None
    if args.drafter_steps is not None and args.drafter_seconds is None:
        overrides["drafter_seconds"] = None
    if args.extra_source:
        overrides["extra_sources"] = tuple(args.extra_source)
    overrides["size_overrides"] = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k) is not None}
    for key, value in overrides.items():
        setattr(options, key, value)
    try:
        DemoBuild(options).run()
    except ValueError as exc:
        sys.stderr.write(f"train_demo_model: error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
