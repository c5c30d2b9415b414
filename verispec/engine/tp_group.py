"""The processes of a tensor-parallel group and how they meet.

One process per rank: rank 0 is the engine's own process, the other ranks are worker processes
(engine/tp_worker.py) started here with the same interpreter, `tensor_parallel_size / nnodes` of
them on each machine. They meet through torch.distributed's env rendezvous (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE) in one process group, NCCL (CUDA) or gloo (CPU), for the model's
tensors; rank 0's step messages go on connections of their own (engine/tp_channel.py).
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from verispec import log
from verispec.config import EngineConfig, env
from verispec.engine.tp_channel import Hub
from verispec.errors import VerispecError
from verispec.kernels import p2p_all_reduce
from verispec.models.layers.parallel import Shard

# NVLink multicast (NVLS) stays off in every rank: the lent multi-GPU machines do not support it
COLLECTIVE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def check_tensor_parallel_options(config: EngineConfig) -> None:
    """The tensor-parallel flags, before anything loads (the model's own limits: models/sharding.py)."""
    size, nnodes = config.tensor_parallel_size, config.nnodes
    if size < 1:
        raise VerispecError(f"--tensor-parallel-size must be >= 1, got {size}")
    if nnodes < 1 or size % nnodes:
        raise VerispecError(f"--nnodes must be >= 1 and divide --tensor-parallel-size {size}, got {nnodes}")
    if not 0 <= config.node_rank < nnodes:
        raise VerispecError(f"--node-rank must be in [0, {nnodes - 1}] for --nnodes {nnodes}, got {config.node_rank}")
    if config.master_port is not None and not 0 < config.master_port < 65536:
        raise VerispecError(f"--master-port must be in [1, 65535], got {config.master_port}")
    if nnodes > 1 and config.master_port is None:
        raise VerispecError("--nnodes > 1 needs --master-port (and --master-addr: node 0's address)")
    if size == 1:
        return
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise VerispecError(f"--tensor-parallel-size {size} runs on --device cuda (one GPU a rank) or cpu, "
                            f"not {device}")
    per_node = size // nnodes
    if device == "cuda" and torch.cuda.device_count() < per_node:
        raise VerispecError(f"--tensor-parallel-size {size} over {nnodes} machine(s) needs {per_node} GPUs on "
                            f"this one; it has {torch.cuda.device_count()}")


@dataclass
class Worker:
    """A worker rank this process started."""

    rank: int
    process: subprocess.Popen


@dataclass
class Group:
    """This process's rank in a group it has joined."""

    shard: Shard
    device: torch.device
    workers: list[Worker] = field(default_factory=list)  # those this process started
    hub: Hub | None = None  # rank 0's connections to the workers

    @property
    def rank(self) -> int:
        return self.shard.rank


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """A rank's device: GPU `rank % ranks per machine` with CUDA, else the CPU."""
    wants_cuda = config.device == "cuda" or (config.device is None and torch.cuda.is_available())
    if not wants_cuda:
        return torch.device("cpu")
    return torch.device("cuda", rank % (config.tensor_parallel_size // config.nnodes))


def join(config: EngineConfig, rank: int) -> Group:
    """Join the group as `rank` (blocks until every rank has)."""
    os.environ.update(COLLECTIVE_ENV)
    os.environ.update(MASTER_ADDR=config.master_addr, MASTER_PORT=str(config.master_port),
                      RANK=str(rank), WORLD_SIZE=str(config.tensor_parallel_size))
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=config.tensor_parallel_size,
                            device_id=device if device.type == "cuda" else None)
    small = p2p_all_reduce.make(dist.group.WORLD, device, env().p2p_all_reduce, config.nnodes == 1)
    return Group(Shard(rank, config.tensor_parallel_size, dist.group.WORLD, small), device)


def start_workers(config: EngineConfig, model_dir: Path) -> list[Worker]:
    """This machine's worker ranks as processes, each told (config, rank, model directory) on its stdin
    (`model_dir` may be a shape's RandomWeights: loading/random_weights.py)."""
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    ranks = [r for r in range(first, first + per_node) if r != 0]
    workers = []
    for rank in ranks:
        proc = subprocess.Popen([sys.executable, "-m", "verispec.engine.tp_worker"], stdin=subprocess.PIPE,
                                env={**os.environ, **COLLECTIVE_ENV})
        proc.stdin.write(pickle.dumps((config, rank, model_dir)))
        proc.stdin.close()
        workers.append(Worker(rank, proc))
    _started.extend(w.process for w in workers)
    return workers


def with_free_port(config: EngineConfig) -> EngineConfig:
    """One machine without --master-port: a port free now on the loopback interface."""
    import dataclasses

    if config.master_port is not None:
        return config
    with socket.socket() as s:
        s.bind((config.master_addr, 0))
        port = s.getsockname()[1]
    return dataclasses.replace(config, master_port=port)


def start(config: EngineConfig, model_dir: Path) -> Group:
    """Rank 0: start this machine's workers, then join the group with them."""
    config = with_free_port(config)
    workers = start_workers(config, model_dir)
    try:
        group = join(config, 0)
        group.hub = Hub.open(config.master_addr, config.tensor_parallel_size)
    except BaseException:
        stop_workers(workers)
        raise
    group.workers = workers
    log.info("tensor parallel: %d ranks over %d machine(s), %s", config.tensor_parallel_size, config.nnodes,
             dist.get_backend())
    return group


def run_node(config: EngineConfig, model_dir: Path) -> int:
    """A machine other than node 0 runs only its worker ranks, until they exit; returns the first
    non-zero exit code (0 when all stopped cleanly)."""
    workers = start_workers(config, model_dir)
    log.info("node %d: ranks of a %d-rank group started; waiting for rank 0 at %s:%s", config.node_rank,
             config.tensor_parallel_size, config.master_addr, config.master_port)
    codes = [w.process.wait() for w in workers]
    return next((c for c in codes if c), 0)


def stop_workers(workers: list[Worker], timeout: float = 10.0) -> None:
    """Wait for workers told to stop (or whose rank 0 is gone); kill those that do not."""
    for w in workers:
        try:
            w.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait(timeout=timeout)


_started: list[subprocess.Popen] = []


@atexit.register
def _end_workers() -> None:
    """A process that exits without closing its engine (a script's LLM) ends its workers with it."""
    for proc in _started:
        if proc.poll() is None:
            proc.terminate()


def watch(workers: list[Worker], on_exit) -> None:
    """Call on_exit(rank, exit code) from a daemon thread when a worker process ends."""
    for w in workers:
        threading.Thread(target=lambda w=w: on_exit(w.rank, w.process.wait()), name="verispec-tp-watch",
                         daemon=True).start()
