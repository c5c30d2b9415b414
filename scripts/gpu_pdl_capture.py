"""Programmatic dependent launch (PDL) vs CUDA graph capture: which capture breaks, and after what.

With launch.PDL on (it switches quant_mma's kernel too), a multi-engine gpu_spec_identity.py run once failed a capture
(cudaErrorStreamCaptureInvalidated). PASS/FAIL lines, and $OUT/pdl_capture.json when OUT is set:
- synthetic: the real 4-bit mma_gemv launched with PDL inside torch.cuda.graph (thread_local and global
  modes) after each kind of predecessor node, replayed 3 times against an eager non-PDL result; each
  (case, mode) in its own process, so a poisoned CUDA context hides no other case.
- engines: gpu_spec_identity.main() itself with both flags on, GraphedCall instrumented: a failing capture
  prints its config, engine, graph (fn, input shapes), traceback, the last ops / kernel calls / Python
  GCs before the failure and the live threads; the targets after a failing one run in fresh processes.

  python3 scripts/gpu_pdl_capture.py [--part synthetic|engines|all] [--repeats 3] [--repeat 1]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
RESULTS: dict = {"synthetic": [], "engines": []}


def save() -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "pdl_capture.json").write_text(json.dumps(RESULTS, indent=1))


def child(argv: list[str], timeout: float, quiet: bool) -> dict:
    """This script in a fresh process (repo root on PYTHONPATH): its result file, or why there is none."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp, "result.json")
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--result-file", str(result)],
                                  env=env, stdout=subprocess.PIPE if quiet else None,
                                  stderr=subprocess.STDOUT if quiet else None, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return {"ok": False, "error": f"timed out after {timeout:.0f}s", "tail": str(e.stdout or "")[-2000:]}
        if result.exists():
            return json.loads(result.read_text())
    return {"ok": False, "error": f"process died (rc {proc.returncode})", "tail": (proc.stdout or "")[-2000:]}


def context_ok() -> bool:
    """Whether the CUDA context still runs work after a failure (a sticky error poisons it)."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2
    except Exception:  # noqa: BLE001 - any error here means broken
        return False


# ---- synthetic: one PDL mma_gemv after each kind of predecessor ------------------------------------
N = K = 4096
GROUP = 64


def operands():
    from verispec.kernels import launch
    from verispec.quant.kernels import gemv as quant_gemv, mma as quant_mma
    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    s = argparse.Namespace(side=torch.cuda.Stream())
    s.packed = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, device=dev)
    s.packed8 = torch.randint(-2**31, 2**31 - 1, (N, K // 4), dtype=torch.int32, device=dev)
    s.scales = (torch.rand(N, K // GROUP, device=dev) / 512).to(bf16)
    s.offsets = -8 * s.scales  # centred weights: chained products stay in range
    s.x_src = torch.randn(1, K, device=dev, dtype=bf16)
    s.x = s.x_src.clone()  # the static input every predecessor rewrites
    s.x_pinned = s.x_src.cpu().pin_memory()
    s.a, s.b = torch.randn(1, 64, device=dev, dtype=bf16), torch.randn(64, K, device=dev, dtype=bf16) / 8
    s.mma = lambda x: quant_mma.mma_gemv(x, s.packed, s.scales, s.offsets, 4, GROUP)
    s.gemv8 = lambda x: quant_gemv.gemv(x, s.packed8, s.scales, s.offsets, 8, GROUP)
    return s


def _join(s):
    # side-stream work joined back inside the capture: the PDL kernel's predecessor is an event wait
    cur = torch.cuda.current_stream()
    s.side.wait_stream(cur)
    with torch.cuda.stream(s.side):
        torch.mul(s.x_src, 2, out=s.x)
    cur.wait_stream(s.side)


PRE = {"elementwise": lambda s: torch.mul(s.x_src, 2, out=s.x), "cublas": lambda s: torch.mm(s.a, s.b, out=s.x),
       "memset": lambda s: s.x.zero_(), "memcpy_d2d": lambda s: s.x.copy_(s.x_src),
       "h2d_pinned": lambda s: s.x.copy_(s.x_pinned, non_blocking=True), "none": lambda s: None, "join": _join}
# name -> (predecessor, product after it, background thread: None / "launch" / "launch+sync")
CASES = {"a_elementwise": ("elementwise", "mma", None), "b_cublas": ("cublas", "mma", None),
         "c_memset": ("memset", "mma", None), "d_memcpy_d2d": ("memcpy_d2d", "mma", None),
         "e_h2d_pinned": ("h2d_pinned", "mma", None), "f_first_op": ("none", "mma", None),
         "g_stream_join": ("join", "mma", None), "h_after_pdl_mma": ("elementwise", "mma_mma", None),
         "h2_after_pdl_gemv8": ("elementwise", "gemv8_mma", None), "i_shared_pool": ("elementwise", "mma", None),
         "j_thread_launches": ("elementwise", "mma", "launch"),
         # an engine worker also syncs; in global mode that alone must fail (a known, expected failure)
         "j2_thread_syncs": ("elementwise", "mma", "launch+sync")}


def background(s, stop: threading.Event, warm: threading.Event, sync: bool) -> None:
    """Eager PDL and plain kernels on this thread's own stream until stopped."""
    stream, x, count = torch.cuda.Stream(), s.x_src.clone(), 0
    try:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                s.mma(torch.mul(x, 2))
                if sync:
                    stream.synchronize()
                count += 1
                if count == 20:  # its allocations are cached by now (but torch.cuda.graph empties the
                    warm.set()   # cache before capturing: in global mode its next cudaMalloc alone fails it)
    except Exception as e:  # noqa: BLE001 - e.g. its sync refused during a global-mode capture
        s.background_error = f"{type(e).__name__}: {e}".strip()


def run_case(name: str, mode: str, repeats: int) -> dict:
    from verispec.kernels import launch
    from verispec.quant.kernels import gemv as quant_gemv
    pre, product, thread_kind = CASES[name]
    s = operands()
    then = {"mma": s.mma, "mma_mma": lambda x: s.mma(s.mma(x)), "gemv8_mma": lambda x: s.mma(s.gemv8(x))}[product]

    def body():
        PRE[pre](s)
        return then(s.x)

    def spoil():  # stale input before each replay: a PDL read before its predecessor wrote shows up
        if pre != "none":
            s.x.fill_(3.0)

    spoil()
    with launch.launches_without_pdl():
        reference = body().clone()  # eager, PDL off
    launch.PDL = True
    spoil()
    out = {"eager_pdl_equal": torch.equal(body(), reference), "runs": []}
    stop, warm = threading.Event(), threading.Event()
    if thread_kind:
        threading.Thread(target=background, args=(s, stop, warm, thread_kind.endswith("sync")), daemon=True).start()
        out["background_warm"] = warm.wait(60)
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                run = {"captured": False, "replays_equal": []}
                out["runs"].append(run)
                try:
                    warm_stream = torch.cuda.Stream()
                    warm_stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(warm_stream):  # warm-up off the capture, as GraphedCall does
                        for _ in range(2):
                            body()
                    torch.cuda.current_stream().wait_stream(warm_stream)
                    graphs, outputs, pool = [], [], None
                    for _ in range(2 if name == "i_shared_pool" else 1):
                        graphs.append(torch.cuda.CUDAGraph())
                        with torch.cuda.graph(graphs[-1], pool=pool, capture_error_mode=mode):
                            outputs.append(body())
                        pool = graphs[-1].pool()
                    run["captured"] = True
                    for _ in range(3):
                        for g, y in zip(graphs, outputs):
                            spoil()
                            g.replay()
                            torch.cuda.synchronize()
                            run["replays_equal"].append(torch.equal(y, reference))
                except Exception as e:  # noqa: BLE001 - the failure is the result
                    run["error"], run["context_ok"] = f"{type(e).__name__}: {e}".strip(), context_ok()
                    if not run["context_ok"]:
                        break
    finally:
        stop.set()
    out["background_error"] = getattr(s, "background_error", None)
    out["ok"] = out["eager_pdl_equal"] and all(r["captured"] and all(r["replays_equal"]) for r in out["runs"])
    return out


def synthetic(args) -> None:
    for mode in args.modes.split(","):
        for name in args.cases.split(",") if args.cases else CASES:
            r = child(["--case", name, "--mode", mode, "--repeats", str(args.repeats)], args.timeout, quiet=True)
            r.update(case=name, mode=mode)
            runs = r.get("runs", [])
            equal = [e for run in runs for e in run["replays_equal"]]
            errors = sorted({run["error"].splitlines()[0][:160] for run in runs if "error" in run})
            broken = " [CUDA context broken]" if any(run.get("context_ok") is False for run in runs) else ""
            print(f"{'PASS' if r['ok'] else 'FAIL'} synthetic {name:19s} {mode:12s} "
                  f"{sum(run['captured'] for run in runs)}/{args.repeats} captured, {sum(equal)}/{len(equal)} replays "
                  f"equal, eager PDL equal: {r.get('eager_pdl_equal')} {'; '.join(errors) or r.get('error', '')}"
                  f"{broken}", flush=True)
            if not r["ok"] and r.get("tail"):
                print("    " + r["tail"].strip()[-1500:].replace("\n", "\n    "))
            RESULTS["synthetic"].append(r)
            save()


# ---- engines: gpu_spec_identity's own run, GraphedCall instrumented ---------------------------------
TRACE: collections.deque = collections.deque(maxlen=20)  # the last ops / kernel calls / GCs, any thread


def note(text: str) -> None:
    TRACE.append(f"[{threading.current_thread().name}] {text}")


def engines_child(args) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(SCRIPTS))
    import gpu_spec_identity as spec
    from verispec.engine import cuda_graphs
    from verispec.engine.engine import Engine
    from verispec.kernels import launch
    from verispec.quant.kernels import gemv as quant_gemv, mma as quant_mma
    launch.PDL = True  # before any kernel launches
    state = {"target": "", "config": "", "engine": "", "engines": 0, "graphs": 0, "failures": []}

    class OpRecorder(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:  # dynamo compiles as without the mode (else it would not)
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            note(str(func))
            return func(*args, **(kwargs or {}))

    def traced_kernel(fn, label):
        def call(*a, **kw):
            shapes = [list(t.shape) for t in a[:2] if isinstance(t, torch.Tensor)]  # x, words
            note(f"{label} {shapes}{' (capturing)' if torch.cuda.is_current_stream_capturing() else ''}")
            return fn(*a, **kw)
        return call
    for module, name in ((quant_mma, "mma_gemv"), (quant_gemv, "gemv"), (quant_gemv, "expert_gemv")):
        setattr(module, name, traced_kernel(getattr(module, name), f"{module.__name__.split('.')[-1]}.{name}"))
    # a collection inside a capture frees other engines' tensors, events and streams on the capturing thread
    gc.callbacks.append(lambda phase, info: phase == "stop" and note(f"python gc gen {info['generation']}, "
                                                                      f"{info['collected']} collected"))
    original_init, original_capture = cuda_graphs.GraphedCall.__init__, Engine.capture_graphs

    def init(self, fn, example_inputs, pool=None):
        state["graphs"] += 1
        phase = {"calls": 0, "returned": False}

        def wrapped(*inputs):
            phase["calls"], phase["returned"] = phase["calls"] + 1, False
            TRACE.clear()
            # aten ops recorded in the capture only (the compiled small ops show as their extern calls), so
            # that the warm-ups, which compile and autotune, run exactly as without this script
            with OpRecorder() if torch.cuda.is_current_stream_capturing() and not args.no_op_trace else \
                    contextlib.nullcontext():
                result = fn(*inputs)
            phase["returned"] = True
            return result
        try:
            original_init(self, wrapped, example_inputs, pool)
        except BaseException as e:
            where = "set-up, before fn ran" if not phase["calls"] else ("capture" if phase["calls"] > 2 else
                    f"warm-up {phase['calls']}") + (" end (fn had returned)" if phase["returned"] else " (inside fn)")
            f = {"config": state["config"], "engine": state["engine"], "graph_number": state["graphs"],
                 "fn": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}",
                 "inputs": [f"{list(x.shape)} {x.dtype}" for x in example_inputs], "shared_pool": pool is not None,
                 "where": where, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                 "last_ops": list(TRACE), "threads": [f"{t.name} (daemon={t.daemon})" for t in threading.enumerate()]}
            state["failures"].append(f)
            print(f"\n=== CAPTURE FAILED: {f['config']} / {f['engine']} / graph #{f['graph_number']} {f['fn']} "
                  f"inputs {f['inputs']} shared_pool={f['shared_pool']} at {where}\n{f['traceback']}"
                  "--- last ops / kernel calls / GCs, oldest first:\n  " + "\n  ".join(f["last_ops"])
                  + "\n--- threads alive: " + ", ".join(f["threads"]) + "\n===", flush=True)
            raise

    def capture_graphs(self, *a, **kw):
        state["engines"] += 1
        proposer = type(self.proposer).__name__ if self.proposer else "plain"
        state["engine"] = f"engine #{state['engines']} ({proposer}, k={self.num_drafts})"
        return original_capture(self, *a, **kw)
    cuda_graphs.GraphedCall.__init__, Engine.capture_graphs = init, capture_graphs

    def labelled_print(*a, **kw):  # gpu_spec_identity prints its config labels: remember them
        text = " ".join(map(str, a))
        if text.startswith("  "):
            state["config"] = f"{state['target']} /{text.rstrip()[1:]}"
        elif text and not text.startswith(("|", "(")):
            state["target"] = state["config"] = text
        print(*a, **kw)
    spec.print = labelled_print  # the module's global shadows the builtin for its main()

    rows_file = Path(tempfile.mkdtemp(), "rows.json")
    sys.argv = ["gpu_spec_identity.py", "--device", args.device, "--quant", args.quant, "--models", args.models,
                "--dtypes", args.dtypes, "--new-tokens", str(args.new_tokens), "--prompts", str(args.prompts),
                "--out", str(rows_file)]
    t0, error = time.time(), None
    try:
        spec.main()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    return {"ok": error is None, "error": error, "failed_target": state["target"] if error else None,
            "engines": state["engines"], "graphs": state["graphs"], "failures": state["failures"],
            "seconds": round(time.time() - t0, 1), "rows": rows,
            "identical": f"{sum(r['identical'] for r in rows)}/{sum(r['prompts'] for r in rows)}"}


def engines(args) -> None:
    common = ["--device", args.device, "--dtypes", args.dtypes, "--new-tokens", str(args.new_tokens),
              "--prompts", str(args.prompts)] + (["--no-op-trace"] if args.no_op_trace else [])
    targets = [(m, q) for m in args.models.split(",") for q in args.quant.split(",")]

    def run(models: str, quant: str, label: str) -> dict:
        r = child(["--engines-child", "--models", models, "--quant", quant, *common], args.timeout, quiet=False)
        r.update(run=label, models=models, quant=quant)
        f = (r.get("failures") or [{}])[0]
        detail = (f"at {f['config']} / {f['engine']} graph #{f['graph_number']} {f['fn']} ({f['where']}): "
                  f"{f['error'][:200]}" if f else r.get("error") or "")
        print(f"{'PASS' if r['ok'] else 'FAIL'} engines {label} [{models} x {quant}] {r.get('engines', '?')} engines, "
              f"{r.get('graphs', '?')} graphs, identical {r.get('identical', '?')}, {r.get('seconds', '?')}s {detail}",
              flush=True)
        RESULTS["engines"].append(r)
        save()
        return r

    for i in range(args.repeat):
        r = run(args.models, args.quant, f"run {i + 1}")
        if r["ok"] or args.stop_at_first:
            continue
        # the failed process' state is suspect: the targets after the failing one, each in a fresh process
        failed = (r.get("failed_target") or "").rsplit(" ", 1)[0]  # gpu_spec_identity's "model [quant] dtype"
        done = next((j for j, (m, q) in enumerate(targets) if failed == (m if q == "none" else f"{m} {q}")),
                    len(targets) - 1)
        for m, q in targets[done + 1:]:
            run(m, q, f"run {i + 1}, after the failure")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("synthetic", "engines", "all"), default="all")
    ap.add_argument("--cases", default="", help=f"synthetic cases (comma-separated; default all): {', '.join(CASES)}")
    ap.add_argument("--modes", default="thread_local,global", help="capture_error_mode values for synthetic")
    ap.add_argument("--repeats", type=int, default=3, help="captures per synthetic case (intermittent failures)")
    ap.add_argument("--quant", default="mlx-8bit,mlx-4bit", help="as gpu_spec_identity.py")
    ap.add_argument("--models", default="llama,qwen3", help="as gpu_spec_identity.py")
    ap.add_argument("--dtypes", default="bfloat16", help="as gpu_spec_identity.py")
    ap.add_argument("--new-tokens", type=int, default=64, help="as gpu_spec_identity.py")
    ap.add_argument("--prompts", type=int, default=2, help="as gpu_spec_identity.py")
    ap.add_argument("--repeat", type=int, default=1, help="whole engines runs (the failure was intermittent)")
    ap.add_argument("--stop-at-first", action="store_true", help="after an engines failure, skip the later targets")
    ap.add_argument("--no-op-trace", action="store_true", help="no TorchDispatchMode in engine captures")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run of the engines flow
    for hidden in ("--case", "--mode", "--result-file"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--engines-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case or args.engines_child:  # a child: its result to the file, then out without torch's teardown
        try:
            result = run_case(args.case, args.mode, args.repeats) if args.case else engines_child(args)
        except Exception as e:  # noqa: BLE001 - set-up failures are results too
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "tail": traceback.format_exc()[-2000:]}
        Path(args.result_file).write_text(json.dumps(result, indent=1, default=str))
        sys.stdout.flush()
        os._exit(0)
    t0 = time.time()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}")
    if args.part in ("synthetic", "all"):
        synthetic(args)
    if args.part in ("engines", "all"):
        engines(args)
    fails = [f"{part} {r.get('case') or r.get('run')} {r.get('mode', '')}".strip()
             for part in RESULTS for r in RESULTS[part] if not r["ok"]]
    print(f"summary: {sum(map(len, RESULTS.values())) - len(fails)} PASS, {len(fails)} FAIL "
          f"({time.time() - t0:.0f}s){': ' + '; '.join(fails) if fails else ''}")


if __name__ == "__main__":
    main()
