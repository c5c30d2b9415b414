"""One OpenMP pool at a time on the CPU: the engine's worker thread computes, nobody else holds one.

torch's CPU kernels run their parallel regions on OpenMP (libgomp in the Linux wheels). libgomp
keeps a pool of helper threads for every thread that has run a parallel region, and when the
threads it manages outnumber the CPUs it cuts the helpers' spin-wait between regions to about a
hundred iterations: each region then wakes its helpers through the kernel, tens of microseconds,
and a decode step of a small model runs hundreds of regions of a few microseconds each. The model
is loaded and the engine built on the caller's thread (one pool), and the engine computes on its
worker thread (a second pool): on a 2-core machine SmolLM2-135M decoded at half speed, 21-24
instead of 40-48 tok/s (docs/benchmarks.md).

`release_thread_pool()` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all`,
soft pause: the pool is rebuilt if that thread computes again). The engine calls it after it is
built and after each submit (the caller's thread may have made small tensors there); its worker
thread's own pool goes away when the worker exits after an idle spell.

`threads_for_host()`: how many threads that pool gets when serving. A parallel region waits for
its slowest thread; with one thread per core, any other busy thread on the host (the server's
event loop, tokenizing, a neighbour) deschedules a helper mid-region and every region stalls
(2 threads on a busy 2-core host decoded 10-20x slower than 1). One core is left free, until the
model turns out to run on the CPU layer kernel (`use_every_core_for_layer_kernel`): its step is a
few long regions whose barrier yields the core to a descheduled peer (quant/kernels/cpu_pool.h),
so there every physical core computes (the default model served on 2 cores: 54 against 33 tok/s
at one client, 1.46x at four clients' aggregate; docs/benchmarks.md).
`verispec generate` computes alone and takes one thread per physical core (`set_generate_threads`).
Both count physical cores, not SMT siblings: two threads on one core share its vector units, and
decode's small products gain nothing from the second while every region waits for both.
"""
from __future__ import annotations

import ctypes
import os
import threading

from verispec import log
from verispec.config import env

OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")  # GNU, Intel, LLVM: each implements OpenMP 5's pause
OMP_PAUSE_SOFT = 1
CHOSEN_BY_SERVE = "VERISPEC_SERVE_CHOSE_THREADS"  # set with OMP_NUM_THREADS by set_serving_threads

_lock = threading.Lock()
_pause = None  # the runtime's omp_pause_resource_all, once looked up
_looked_up = False


def _torch_openmp_library() -> str | None:
    """The path of torch's own OpenMP runtime as this process loaded it (None if none is found).
    Other wheels bundle their own copies (sentencepiece has a libgomp too): pausing one of those
    would leave torch's pools as they are."""
    import torch

    package = os.path.dirname(os.path.realpath(torch.__file__))
    homes = (package + os.sep, package + ".libs" + os.sep)  # torch/lib, or auditwheel's torch.libs
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if (os.path.basename(path).startswith(OPENMP_LIBRARIES) and ".so" in path
                        and os.path.realpath(path).startswith(homes)):
                    return path
    except OSError:  # not Linux: no /proc
        return None
    return None


def _pause_function():
    global _pause, _looked_up
    with _lock:
        if not _looked_up:
            _looked_up = True
            path = _torch_openmp_library()
            if path is None:
                log.debug("torch's OpenMP runtime was not found in this process: thread pools are left as they are")
            else:
                function = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
                if function is None:
                    log.debug("%s has no omp_pause_resource_all (OpenMP < 5): thread pools are left as they are",
                              path)
                else:
                    function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
                    _pause = function
        return _pause


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP helper threads. True if the runtime did."""
    pause = _pause_function()
    if pause is None:
        return False
    rc = pause(OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all returned %d: this thread's OpenMP pool stays", rc)
    return rc == 0


def threads_for_host(num_cpus: int) -> int:
    """Compute threads for a serving engine on `num_cpus` usable CPUs: all but one, at least one."""
    return max(1, num_cpus - 1)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def physical_cores(sysfs: str = "/sys/devices/system/cpu") -> int:
    """Physical cores among the usable CPUs: SMT siblings (same package and core id) count once.
    Without the topology files (not Linux, some containers): the usable CPUs."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return usable_cpus()
    cores = set()
    for cpu in cpus:
        topology = os.path.join(sysfs, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as package, \
                    open(os.path.join(topology, "core_id")) as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def set_serving_threads() -> int | None:
    """`verispec serve` on a CPU: threads_for_host() unless OMP_NUM_THREADS says otherwise. Also
    exported, so an engine process (spawned, a fresh interpreter) starts with the same count.
    Returns the count set (None: left to OMP_NUM_THREADS)."""
    import torch

    if env().omp_num_threads is not None:
        return None
    cores = physical_cores()
    num_threads = threads_for_host(cores)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    os.environ[CHOSEN_BY_SERVE] = "1"  # ours, not the user's: the model may raise it (below)
    torch.set_num_threads(num_threads)
    log.info("CPU compute threads: %d of %d physical cores (OMP_NUM_THREADS sets another count)", num_threads,
             cores)
    return num_threads


def use_every_core_for_layer_kernel() -> int | None:
    """A served model whose layers run the CPU layer kernel computes on every physical core, where
    `set_serving_threads` had left one free (not where OMP_NUM_THREADS was the user's). Returns
    the count set (None: left as it was)."""
    import torch

    if os.environ.get(CHOSEN_BY_SERVE) != "1":
        return None
    cores = physical_cores()
    if torch.get_num_threads() >= cores:
        return None
    os.environ["OMP_NUM_THREADS"] = str(cores)
    torch.set_num_threads(cores)
    log.info("CPU compute threads: %d, every physical core (the layer kernel's barriers yield to a busy host)", cores)
    return cores


def set_generate_threads() -> int | None:
    """`verispec generate` on a CPU: one compute thread per physical core, unless OMP_NUM_THREADS
    says otherwise (torch's default counts SMT siblings too). Returns the count set (None: left
    to OMP_NUM_THREADS)."""
    import torch

    if env().omp_num_threads is not None:
        return None
    num_threads = physical_cores()
    torch.set_num_threads(num_threads)
    log.debug("CPU compute threads: %d, one per physical core (OMP_NUM_THREADS sets another count)", num_threads)
    return num_threads
