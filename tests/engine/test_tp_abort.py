"""Aborting a lost tensor-parallel group (engine/tp_peers.py BoundedOnce)."""
from __future__ import annotations


def test_a_blocked_abort_is_waited_on_once_and_for_a_bounded_time():
    """Where a GPU kernel waits on the lost rank, NCCL's abort can block for good: neither the
    watch thread nor stop() may hang on it, and it is started once."""
    import threading
    import time

    from verispec.engine.tp_peers import BoundedOnce

    started, release = [], threading.Event()
    bounded = BoundedOnce(lambda: (started.append(1), release.wait()), 0.2, "a blocked abort")
    begin = time.monotonic()
    assert bounded.run() is False and bounded.run() is False  # the second call waits for what is left
    assert time.monotonic() - begin < 2 and started == [1]
    release.set()
    time.sleep(0.05)
    assert bounded.run() is True and started == [1]
    assert BoundedOnce(lambda: None, 5.0, "a quick abort").run() is True
