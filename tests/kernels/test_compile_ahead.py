"""kernels/compile_ahead.py's switch, without a GPU: inside dry_run() this thread's Triton launches
go through the dry path (autotuners skipped), other threads' do not, and leaving restores Triton's
own methods. What the dry run builds on CUDA is tested in tests/gpu/test_gpu_compile_ahead.py."""
from __future__ import annotations

import threading

import pytest

from verispec.kernels import compile_ahead

pytestmark = pytest.mark.skipif(not compile_ahead.available(), reason="needs Triton")


def test_dry_run_patches_while_it_lasts_and_only_for_its_thread():
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    before = (JITFunction.run, JITFunction._do_compile, Autotuner.run)
    seen_elsewhere = []
    with compile_ahead.dry_run(threads=2) as summary:
        assert compile_ahead.active()
        assert (JITFunction.run, JITFunction._do_compile, Autotuner.run) != before
        worker = threading.Thread(target=lambda: seen_elsewhere.append(compile_ahead.active()))
        worker.start()
        worker.join()
        assert Autotuner.run(object()) is None  # an autotuner in a dry run is left to the real pass
        with pytest.raises(RuntimeError, match="already active"):
            with compile_ahead.dry_run():
                pass
    assert seen_elsewhere == [False]
    assert not compile_ahead.active()
    assert (JITFunction.run, JITFunction._do_compile, Autotuner.run) == before
    assert summary == {"built": 0, "failed": 0, "skipped_tuners": 1, "wait_s": summary["wait_s"]}
