"""The caller's OpenMP pool is freed once the engine is built and after each submit, so the engine's
worker thread is the only one computing with a pool (engine/cpu_threads.py). Each check runs in a
fresh Python process: pools are per process and per thread, and pytest's own process has others."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")

# a parallel elementwise op on the calling thread, then the number of OS threads of the process
PRELUDE = textwrap.dedent("""
    import os, time, torch
    torch.set_num_threads(2)
    def threads():
        time.sleep(0.2)  # a released helper exits asynchronously
        return len(os.listdir("/proc/self/task"))
    def parallel_op():
        x = torch.zeros(1 << 22)
        x.add_(1)
""")


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_release_frees_the_calling_threads_pool():
    out = run("""
        from verispec.engine.cpu_threads import release_thread_pool
        before = threads()
        parallel_op()
        with_pool = threads()
        released = release_thread_pool()
        print(before, with_pool, released, threads())
    """)
    before, with_pool, released, after = out.split()
    assert int(with_pool) == int(before) + 1  # one helper thread for 2 OpenMP threads
    assert released == "True"
    assert int(after) == int(before)


def test_release_targets_torchs_runtime_when_another_libgomp_is_loaded():
    """sentencepiece's wheel bundles its own libgomp; pausing that one would leave torch's pool."""
    pytest.importorskip("sentencepiece")
    out = run("""
        import sentencepiece  # loads its own OpenMP runtime before torch's pool is looked up
        from verispec.engine.cpu_threads import release_thread_pool
        before = threads()
        parallel_op()
        release_thread_pool()
        print(before, threads())
    """)
    before, after = out.split()
    assert after == before


ENGINE_RUN = """
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams
    from verispec.engine.cpu_threads import release_thread_pool
    engine = Engine.load(EngineConfig(model={model!r}, device="cpu", dtype="float32", kv_cache_gb=0.05,
                                      max_model_len=256))
    parallel_op()  # the caller computes after the engine was built: its submit must free that pool too
    {before_submit}
    result = engine.generate_all([1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    print(len(result.token_ids), threads())
"""


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_engine_leaves_no_pool_on_the_callers_thread(qwen3_dir):
    """After a request, the process has the threads of a run whose caller freed its pool by hand
    (the main thread, the worker and its helper, other libraries' threads): not the caller's
    helper on top."""
    engine_run = run(ENGINE_RUN.format(model=str(qwen3_dir), before_submit="pass"))
    by_hand = run(ENGINE_RUN.format(model=str(qwen3_dir), before_submit="release_thread_pool()"))
    generated, threads_engine = engine_run.split()
    assert generated == "8"
    assert threads_engine == by_hand.split()[1]


def test_physical_cores_count_smt_siblings_once(tmp_path, monkeypatch):
    from verispec.engine import cpu_threads

    # 4 CPUs: two cores with two SMT siblings each
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1)]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_threads.physical_cores(str(tmp_path)) == 2
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0})  # a cpuset of one CPU
    assert cpu_threads.physical_cores(str(tmp_path)) == 1
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})  # no topology for cpu4
    assert cpu_threads.physical_cores(str(tmp_path)) == 5


def test_generate_takes_a_thread_per_physical_core_unless_told(monkeypatch):
    from verispec.engine import cpu_threads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda: 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads.set_generate_threads() is None and calls == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads.set_generate_threads() == 3 and calls == [3]
