"""Rank 0's message connections to the other ranks (engine/tp_channel.py), in one process: messages
(tensors included) arrive whole and in order at every worker; a worker whose connection closes is
named to rank 0; a worker whose rank 0 is gone learns it at its next receive."""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from verispec.engine.tp_channel import Hub, Line, RankGone

WAIT_S = 10


def connected(world_size: int) -> tuple[Hub, dict[int, Line]]:
    where: queue.SimpleQueue = queue.SimpleQueue()
    lines: dict[int, Line] = {}

    def worker(rank: int) -> None:
        address = where.get(timeout=WAIT_S)
        where.put(address)  # for the next worker
        lines[rank] = Line.connect(rank, learn=lambda: address)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(1, world_size)]
    for t in threads:
        t.start()
    hub = Hub.open("127.0.0.1", world_size, announce=where.put)
    for t in threads:
        t.join(WAIT_S)
    return hub, lines


def test_every_worker_gets_every_message_in_order():
    hub, lines = connected(3)
    try:
        assert sorted(hub.connections) == [1, 2]
        messages = [("forward", torch.arange(6).view(2, 3)), ("replay", 4, 1), ("x" * 100_000,)]
        for m in messages:
            hub.send(m)
        for line in lines.values():
            got = [line.receive() for _ in messages]
            assert got[0][0] == "forward" and torch.equal(got[0][1], messages[0][1])
            assert got[1:] == messages[1:]
    finally:
        hub.close()
        for line in lines.values():
            line.close()


def test_a_closed_worker_connection_is_named_to_rank_0():
    hub, lines = connected(3)
    lost: queue.SimpleQueue = queue.SimpleQueue()
    try:
        hub.watch(lost.put)
        lines[2].close()
        assert lost.get(timeout=WAIT_S) == 2
        assert lost.empty()
    finally:
        hub.close()
        lines[1].close()


def test_a_worker_learns_that_rank_0_is_gone():
    hub, lines = connected(2)
    hub.send("last")
    hub.close()
    assert lines[1].receive() == "last"
    with pytest.raises(RankGone):
        lines[1].receive()
    lines[1].close()
