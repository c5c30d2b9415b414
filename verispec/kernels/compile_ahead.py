"""Triton kernels compiled ahead, from a pool of threads, during a dry run of the passes to come.

On an empty Triton cache a start-up compiles each kernel specialisation where a pass first meets
it, one after another, inside the CUDA-graph captures. Triton's compiler (its MLIR passes, LLVM,
ptxas in a subprocess) spends most of its time outside Python's interpreter lock, so the
specialisations compile several at a time from threads (docs/benchmarks.md), each with the C
launcher Triton builds for its signature and its binary loaded. What they are is only
known by running the passes, so the passes run once dry: inside `dry_run()`, every launch of a
`@triton.jit` kernel on this thread binds its arguments (which fixes the specialisation), hands a
specialisation not yet built to the pool, and returns without launching. Nothing a kernel would
write is written: what a dry pass computes is garbage and must be thrown away. The real passes after
it find the kernels built (Triton's in-memory cache, the same as a compile inline would fill).

Autotuned kernels (fla's) are skipped in a dry run: their tuning needs real launches; they compile
in the real pass, as without the dry run. torch.compile's kernels are inductor's, not launched
through `JITFunction.run`: they compile and run where they are met, on the dry pass's garbage
(elementwise work, nothing indexed by it).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from verispec import log
from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    # Triton's own methods, which the dry run's stand-ins call (kept for good: another thread may
    # be inside a stand-in while the last dry run puts Triton's back)
    _TRITON = (JITFunction.run, JITFunction._do_compile, Autotuner.run)
except ImportError:  # CPU-only installs
    JITFunction = None
    Autotuner = None
    _TRITON = None

# the pool's size: Triton's compile threads wait on ptxas and LLVM, not on Python (8 threads
# compiled eight GEMM variants 4x faster than one on the H200's host)
MAX_THREADS = 8

_state = threading.local()


def available() -> bool:
    return JITFunction is not None


def active() -> bool:
    """This thread is inside dry_run(): launches are skipped, captures are not made."""
    return getattr(_state, "run", None) is not None


class _DryRun:
    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile-ahead")
        self.submitted: dict[tuple[int, str], object] = {}
        self.skipped_tuners = 0

    def submit(self, build, kernel, key: str, args: tuple) -> None:
        if (id(kernel), key) not in self.submitted:
            self.submitted[(id(kernel), key)] = (kernel, self.pool.submit(build, kernel, key, *args))

    def drain(self) -> tuple[int, int]:
        """Wait for every compile; (built, failed). A failure is logged and left to the real pass,
        which compiles that specialisation again where it meets it and raises its error there."""
        failed = 0
        for kernel, future in self.submitted.values():
            error = future.exception()
            if error is not None:
                failed += 1
                log.debug("compiling %s ahead failed (%s: %s); it compiles where the pass meets it",
                          getattr(kernel, "__name__", kernel), type(error).__name__, (str(error).splitlines() or [""])[0])
        self.pool.shutdown()
        return len(self.submitted) - failed, failed


_patch_lock = threading.Lock()
_users = 0  # dry runs in progress, on any thread: the stand-ins are installed while there are some


def _run(self, *args, grid, warmup, **kwargs):
    return _TRITON[0](self, *args, grid=grid, warmup=warmup or active(), **kwargs)


def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    dry = getattr(_state, "run", None)
    if dry is None:  # not this thread's dry run: the pool's threads, or anyone else
        return _TRITON[1](self, key, signature, device, constexprs, options, attrs, warmup)
    dry.submit(_build, self, key, (_TRITON[1], signature, device, constexprs, options, attrs))
    return None  # run() returns without launching


def _build(fn, key, compile_fn, signature, device, constexprs, options, attrs):
    """One specialisation compiled, on a pool thread, and made ready to launch: Triton builds a
    kernel's launcher (a C stub, compiled by the host's C compiler on an empty cache) and loads its
    binary at its first launch, which would otherwise be inside a capture, one kernel at a time."""
    with torch.cuda.device(device):
        kernel = compile_fn(fn, key, signature, device, constexprs, options, attrs, True)
        if kernel is not None:
            kernel.run  # the property builds the launcher and loads the binary
    return kernel


def _tune(self, *args, **kwargs):
    dry = getattr(_state, "run", None)
    if dry is None:
        return _TRITON[2](self, *args, **kwargs)
    dry.skipped_tuners += 1
    return None


def _install() -> None:
    """Route JITFunction.run, its compile and Autotuner.run through the dry run where the calling
    thread is in one; every other thread goes straight through. Installed while a dry run lasts."""
    global _users
    with _patch_lock:
        _users += 1
        if _users == 1:
            JITFunction.run, JITFunction._do_compile, Autotuner.run = _run, _do_compile, _tune


def _uninstall() -> None:
    global _users
    with _patch_lock:
        _users -= 1
        if _users == 0:
            JITFunction.run, JITFunction._do_compile, Autotuner.run = _TRITON


@contextlib.contextmanager
def dry_run(threads: int | None = None):
    """Run passes dry on this thread: Triton launches skipped, their specialisations compiled by a
    pool of threads; on leaving, waits for the pool. Yields a dict filled on exit with `built`,
    `failed`, `skipped_tuners` and `wait_s` (the time spent waiting for the pool after the passes)."""
    if not available():
        raise RuntimeError("dry_run() needs Triton (compile_ahead.available())")
    if active():
        raise RuntimeError("dry_run() is already active on this thread")
    dry = _DryRun(threads or min(MAX_THREADS, os.cpu_count() or 1))
    summary: dict = {}
    _install()
    _state.run = dry
    try:
        yield summary
    finally:
        _state.run = None
        _uninstall()
        t0 = time.perf_counter()
        built, failed = dry.drain()
        summary.update(built=built, failed=failed, skipped_tuners=dry.skipped_tuners,
                       wait_s=time.perf_counter() - t0)
