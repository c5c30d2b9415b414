"""`verispec bench`: its command-line flags and the run they describe (the measuring is in
offline.py and http.py; the options' checks in options.py)."""
from __future__ import annotations

from pathlib import Path

from verispec.cache.paged import KV_CACHE_DTYPES
from verispec.errors import VerispecError


def add_bench_parser(sub) -> None:
    """`verispec bench`'s flags, on the CLI's subcommand parser."""
    bench = sub.add_parser("bench", help="measure speed: offline (-m / --shape) or over HTTP (--url / --serve)")
    where = bench.add_mutually_exclusive_group(required=True)
    where.add_argument("-m", "--model", default=None, help="offline: a checkpoint directory or hub id")
    where.add_argument("--shape", default=None,
                       help="offline: random weights of a real model's shape, built on the device (e.g. qwen3-8b)")
    where.add_argument("--url", default=None, help="HTTP: an OpenAI-compatible server, e.g. http://127.0.0.1:9999")
    where.add_argument("--serve", action="append", default=None, metavar="ARGS",
                       help="HTTP: boot `verispec serve ARGS` for this configuration (repeatable: one per config)")
    bench.add_argument("--methods", default=None,
                       help="offline: comma-separated methods (ar, eagle3, mtp, suffix; default ar)")
    bench.add_argument("--contexts", default="512", help="comma-separated prompt lengths in tokens (default 512; 4k = 4096)")
    bench.add_argument("--concurrency", default=None, metavar="N,...",
                       help="sequences at once, e.g. 1,8,32,64: offline a batch of N prompts submitted together, "
                            "over HTTP N concurrent clients (aggregate and per-request tok/s, TTFT p50/p99)")
    bench.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per context after a warm-up; medians (default 3)")
    bench.add_argument("--num-draft-tokens", "--draft-block", dest="draft_block", type=int, default=None, metavar="K",
                       help="drafts per round (default 2; --draft-block is an older name for this flag)")
    bench.add_argument("--eagle3", metavar="DIR", default=None,
                       help="offline: a real EAGLE3 drafter (default: random weights of the real drafter shape)")
    bench.add_argument("--dtype", default=None, help="bfloat16|float16|float32|float64 (default: bf16 on CUDA, float32 on CPU)")
    bench.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)")
    bench.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk (default 2048)")
    bench.add_argument("--no-cuda-graphs", action="store_true", help="offline: run decode/verify steps eagerly")
    bench.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="offline -m / --shape: split the model over N GPUs (docs/multi-gpu.md)")
    bench.add_argument("--numerics", default="auto", choices=("auto", "exact", "fast"),
                       help="offline: the engine's numerics (default auto; see `serve --help`)")
    bench.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="offline: what the KV cache stores (see `serve --help`); the roofline counts its bytes")
    bench.add_argument("--no-overlap-decode", action="store_true",
                       help="offline: wait for each plain decode step before queuing the next")
    bench.add_argument("--quant", default=None, metavar="FORMAT",
                       help="offline: quantize the target's weights first: mlx-4bit | mlx-8bit | mlx-3bit | mlx-6bit "
                            "(group 64, the layers `verispec quantize` writes)")
    bench.add_argument("--json-schema", default=None, metavar="FILE",
                       help="offline: also measure every run constrained to this JSON schema (a file, or 'builtin'); "
                            "rows '<method>+json', their speedup_vs_ar is the cost of the grammar")
    bench.add_argument("--prefix-cache", action="store_true",
                       help="offline: measure the prefix cache (a repeated prompt's TTFT, a 10-turn conversation's "
                            "computed prompt tokens, decode speed when nothing hits) against it turned off")
    bench.add_argument("--workload", default="random", metavar="NAME",
                       help="what the prompts ask: random (random words; default), edit (rename in a code file, "
                            "reply with the file), quote (answer with quotes from a document), json (re-emit JSON with "
                            "one field changed): built from text shipped with verispec, where --suffix pays")
    bench.add_argument("--write-draft-costs", default=None, metavar="FILE",
                       help="offline: time the speculative method's verify passes (at each --concurrency N, default "
                            "1, x widths 1..k+1) and drafting into a table for `serve --draft-costs FILE`")
    bench.add_argument("--draft-schedule", default=None, metavar="B:K,...|adaptive",
                       help="offline: drafts per round as `serve --draft-schedule`, or 'adaptive' (the engine's "
                            "per-sequence choice); default: k drafts at every --concurrency N, else adaptive")
    bench.add_argument("--compare", default=None, help="offline: also run a peer on the same model (transformers)")
    bench.add_argument("--bandwidth", type=float, default=None, metavar="TB/s",
                       help="memory bandwidth for the roofline (default: measured on CUDA, n/a elsewhere)")
    bench.add_argument("--step-iters", type=int, default=50,
                       help="timed rounds of (decode, verify, draft) steps, interleaved, behind the speculative cost columns")
    bench.add_argument("--out", default=None, metavar="DIR", help="write bench.json, bench.md and bench.png here")
    bench.add_argument("--endpoint", default="chat", choices=["chat", "completions"], help="HTTP: which API (default chat)")
    bench.add_argument("--api-key", default=None, help="HTTP: sent as 'Authorization: Bearer KEY'")
    bench.add_argument("--serve-timeout", type=float, default=900.0, help="HTTP: seconds to wait for /health (default 900)")
    bench.add_argument("--seed", type=int, default=0, help="seed for random weights and prompts")


def run_bench_command(args) -> int:
    from verispec.bench import run_bench
    from verispec.bench.options import (BenchOptions, Endpoint, parse_concurrency, parse_contexts, parse_methods,
                                        parse_peers, parse_workload)

    http = bool(args.url or args.serve)
    for flag, value in (("--methods", args.methods), ("--compare", args.compare), ("--eagle3", args.eagle3),
                        ("--quant", args.quant)):
        if http and value is not None:
            raise VerispecError(f"{flag} is for offline runs (-m / --shape); over HTTP the server's flags pick it")
    kwargs = {}
    if args.methods is not None:
        kwargs["methods"] = tuple(parse_methods(args.methods))
    if args.compare is not None:
        kwargs["compare"] = tuple(parse_peers(args.compare))
    if args.draft_block is not None:
        kwargs["draft_block"] = args.draft_block
    if args.concurrency is not None:
        kwargs["concurrency"] = tuple(parse_concurrency(args.concurrency))
    opts = BenchOptions(
        model=args.model, shape=args.shape, url=args.url, serve=tuple(args.serve or ()),
        contexts=tuple(parse_contexts(args.contexts)), gen_tokens=args.gen_tokens, repeats=args.repeats,
        dtype=args.dtype, device=args.device, prefill_step_size=args.prefill_step_size,
        numerics=args.numerics, kv_cache_dtype=args.kv_cache_dtype, cuda_graphs=not args.no_cuda_graphs,
        overlap_decode=not args.no_overlap_decode,
        out=Path(args.out) if args.out else None,
        bandwidth_tbs=args.bandwidth, eagle3=args.eagle3, step_iters=args.step_iters, quant=args.quant,
        endpoint=Endpoint(args.endpoint), api_key=args.api_key, serve_timeout_s=args.serve_timeout,
        seed=args.seed, json_schema=args.json_schema,
        prefix_cache=args.prefix_cache, workload=parse_workload(args.workload),
        write_draft_costs=Path(args.write_draft_costs) if args.write_draft_costs else None,
        draft_schedule=args.draft_schedule, tensor_parallel_size=args.tensor_parallel_size, **kwargs)
    run_bench(opts)
    return 0
