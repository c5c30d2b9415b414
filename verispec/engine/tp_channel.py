"""Rank 0's step messages to the other ranks of a tensor-parallel group: one TCP connection per
worker (Nagle off), each message a length-prefixed pickle.

Why not a torch.distributed broadcast: a gloo broadcast of one small object costs a sizeable part
of a decode step (docs/multi-gpu.md), and a worker replays its CUDA graph only once told to, so
every step waited that long. The model's tensors still travel on the NCCL (or gloo) group.

The ranks meet through the process group: rank 0 listens on the master address and broadcasts
where, each worker connects and names its rank. A connection that closes is how each side learns
that the other is gone (rank 0: `on_lost(rank)` from a watch thread; a worker: `receive` raises).
"""
from __future__ import annotations

import pickle
import socket
import struct
import threading

import torch.distributed as dist

HEADER = struct.Struct("<Q")  # a message's length in bytes
ACCEPT_TIMEOUT_S = 600.0  # how long rank 0 waits for every worker to connect (another machine may be slow)


class RankGone(ConnectionError):
    """The other end of a control connection closed."""


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Hub:
    """Rank 0's end: a connection to each worker rank."""

    def __init__(self, connections: dict[int, socket.socket]):
        self.connections = connections
        self._closed = False

    @classmethod
    def open(cls, address: str, world_size: int, announce=None) -> "Hub":
        """Listen on `address`, tell the workers where (`announce((host, port))`; by default a
        broadcast over the process group, which every rank makes), accept them."""
        with socket.create_server((address, 0)) as server:
            (announce or _broadcast)(server.getsockname()[:2])
            server.settimeout(ACCEPT_TIMEOUT_S)
            connections = {}
            while len(connections) < world_size - 1:
                sock, _ = server.accept()
                sock.settimeout(None)
                rank = HEADER.unpack(_read(sock, HEADER.size))[0]
                connections[rank] = _nodelay(sock)
        return cls(connections)

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = HEADER.pack(len(data)) + data
        for rank, sock in self.connections.items():
            try:
                sock.sendall(frame)
            except OSError as exc:
                raise RankGone(f"tensor-parallel rank {rank}'s connection closed ({exc})") from exc

    def watch(self, on_lost) -> None:
        """Call on_lost(rank) from a daemon thread when a worker's connection closes (workers
        never write after their hello, so a read returns only at the end)."""
        for rank, sock in self.connections.items():
            def wait(rank=rank, sock=sock):
                try:
                    sock.recv(1)
                except OSError:
                    pass
                if not self._closed:
                    on_lost(rank)

            threading.Thread(target=wait, name="verispec-tp-line", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for sock in self.connections.values():
            sock.close()


class Line:
    """A worker's end: the connection to rank 0."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    def connect(cls, rank: int, learn=None) -> "Line":
        """Learn where rank 0 listens (`learn()`; by default the broadcast Hub.open makes), connect,
        name this rank."""
        sock = _nodelay(socket.create_connection(tuple((learn or _learn)())))
        sock.sendall(HEADER.pack(rank))
        return cls(sock)

    def receive(self):
        """The next message (blocks; an idle server sends none for hours). Raises RankGone when
        rank 0's end closed."""
        size = HEADER.unpack(_read(self.sock, HEADER.size))[0]
        return pickle.loads(_read(self.sock, size))

    def close(self) -> None:
        self.sock.close()


def _broadcast(address) -> None:
    dist.broadcast_object_list([address], src=0)


def _learn():
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _read(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise RankGone("the other end closed the connection")
        got += n
    return bytes(buf)
