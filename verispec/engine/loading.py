"""Loading what an Engine is built from: the checkpoint (any format `verispec.loading` reads), its
tokenizer and the proposer the configuration asks for, with the option checks that need no model."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from verispec import log
from verispec.config import EngineConfig
from verispec.engine import cpu_threads, warmup
from verispec.engine.proposers import build_proposer
from verispec.errors import VerispecError
from verispec.loading import host_memory
from verispec.loading.device import parse_device, parse_dtype
from verispec.loading.model_loader import load_model, prepare_for_device, read_config, resolve_numerics
from verispec.loading.resolve import resolve_model
from verispec.loading.tokenizer import Tokenizer
from verispec.models.layers import numerics as layer_numerics


def load_parts(config: EngineConfig) -> tuple:
    """Engine's arguments, in its order: (model, tokenizer, config, model_dir, proposer, num_drafts,
    peers); with --tensor-parallel-size N > 1 the model is rank 0's share and `peers` the others'."""
    from verispec.engine.options import check_options

    check_options(config)  # every flag that needs no model, before the minute a load can take
    device = parse_device(config.device)
    dtype = parse_dtype(config.dtype, device)
    t0 = time.perf_counter()
    model_dir = resolve_model(config.model)
    t1 = time.perf_counter()
    log.startup_phase("finding the model", t1 - t0)
    tokenizer = _tokenizer_beside_the_weights(model_dir, device)
    with host_memory.lean_allocations() if device.type == "cpu" else contextlib.nullcontext():
        if config.tensor_parallel_size == 1:
            model, peers = load_model(model_dir, dtype, device), None
        else:
            model, peers = load_sharded(config, model_dir, dtype)
            device = next(model.parameters()).device
        try:
            return _finish_parts(config, model, model_dir, dtype, device, peers, t1, tokenizer)
        except BaseException:
            if peers is not None:  # a failed start leaves no worker ranks waiting on a collective
                peers.stop()
            raise


def _tokenizer_beside_the_weights(model_dir, device) -> Future | None:
    """The tokenizer, built on a thread while the weights load (on CUDA: the host is mostly waiting
    for copies then; a first GGUF start builds its tokenizer from the file's vocabulary for ~2 s).
    On a CPU the cores are loading the weights and the load's peak memory counts: built after them
    (None)."""
    if device.type != "cuda":
        return None
    future: Future = Future()
    thread = threading.Thread(target=_build_tokenizer, args=(model_dir, future), name="verispec-tokenizer",
                              daemon=True)
    thread.start()
    return future


def _build_tokenizer(model_dir, future: Future) -> None:
    try:
        future.set_result(Tokenizer.from_dir(model_dir))
    except BaseException as exc:  # raised where the tokenizer is wanted
        future.set_exception(exc)


def _finish_parts(config: EngineConfig, model, model_dir, dtype, device, peers, t1: float,
                  building_tokenizer: Future | None) -> tuple:
    """load_parts after the weights: the tokenizer, the proposer, the numerics and the device's rewrites."""
    t2 = time.perf_counter()
    log.startup_phase(f"loading the weights ({type(model).__name__}, {str(dtype).removeprefix('torch.')}, "
                      f"{device})", t2 - t1)
    if peers is None:
        _decode_small_quantized(model, config.numerics, dtype, device)
    if building_tokenizer is not None:
        tokenizer = building_tokenizer.result()
        phase = "the tokenizer (the rest of its build, begun with the weights)"
    else:
        tokenizer = Tokenizer.from_dir(model_dir)
        phase = "the tokenizer"
    t3 = time.perf_counter()
    log.startup_phase(phase, t3 - t2)
    proposer, num_drafts = build_proposer(config, model, model_dir, tokenizer)
    t4 = time.perf_counter()
    if proposer is not None:
        log.startup_phase("loading the drafter", t4 - t3)
    warmup.pin_triton_cache_dir(device)  # before the load-time rewrites compile anything (see there)
    numerics, _ = resolve_numerics(model, config.numerics)
    prepare_for_device(model, config.fuse_small_ops, numerics)  # after the proposer, which may share its layers
    # again, prepared: a CPU model whose layers now run the layer kernel is exact under auto too
    numerics, why_not_exact = resolve_numerics(model, config.numerics)
    if why_not_exact is not None:  # a warning where exact was asked for; /v1/models and --json say it anyway
        (log.warning if config.numerics == "exact" else log.debug)("numerics: fast (not exact: %s)", why_not_exact)
    config = dataclasses.replace(config, numerics=numerics)
    layer_numerics.keep_cpu_products_row_invariant(numerics, device)
    if device.type == "cpu" and getattr(model, "layer_stack", None) is not None:
        cpu_threads.use_every_core_for_layer_kernel()
    log.startup_phase("preparing the model for the device", time.perf_counter() - t4)
    return model, tokenizer, config, model_dir, proposer, num_drafts, peers


def _decode_small_quantized(model, requested: str, dtype, device) -> None:
    """Exact numerics for a small quantized model on CUDA: its layers decoded to `dtype` once, so the
    dense row-invariant kernels run it (quant/dense.py), before anything shares its layers. Its
    quantized kernels are not row-invariant, and at this size the dense weights cost next to nothing."""
    from verispec.models.layers import numerics
    from verispec.quant import dense

    if requested == "fast" or torch.device(device).type != "cuda" or not dense.has_decodable_layers(model):
        return
    size = dense.dense_bytes(model, dtype)
    if size > numerics.SMALL_MODEL_BYTES:
        log.debug("numerics: the quantized layers stay quantized (%.2f GiB dense, over %.0f GiB)", size / 2**30,
                  numerics.SMALL_MODEL_BYTES / 2**30)
        return
    replaced = dense.decode_to_dense(model, dtype)
    log.info("numerics: %s quantized layers decoded to %s (%.2f GiB dense), for exact numerics",
             replaced, str(dtype).removeprefix("torch."), size / 2**30)


def load_sharded(config: EngineConfig, model_dir, dtype) -> tuple:
    """Rank 0's share of the model and its peers: the checkpoint's config is checked first (one
    line, before any process starts), then this machine's workers start and every rank loads its
    share. `model_dir` may be a `RandomWeights` (bench --shape): each rank draws its own share."""
    from verispec.engine import tp_group
    from verispec.engine.tp_peers import Peers
    from verispec.loading.gguf import is_gguf
    from verispec.loading.random_weights import RandomWeights
    from verispec.models.sharding import check_shardable

    random = isinstance(model_dir, RandomWeights)
    if not random and is_gguf(model_dir):
        raise VerispecError(f"--tensor-parallel-size {config.tensor_parallel_size}: GGUF files are not split "
                            "over GPUs yet; load a safetensors checkpoint")
    check_shardable(model_dir.config if random else read_config(model_dir), config.tensor_parallel_size)
    group = tp_group.start(config, model_dir)
    peers = Peers(group)
    try:
        model = load_rank_share(model_dir, dtype, group)
    except BaseException:
        peers.stop()
        raise
    return model, peers


def load_rank_share(source, dtype, group):
    """This rank's share of a checkpoint directory or of a shape's random weights, on its device."""
    from verispec.loading.random_weights import RandomWeights, random_model

    if isinstance(source, RandomWeights):
        return random_model(source, group.device, dtype, shard=group.shard)
    return load_model(Path(source), dtype, group.device, shard=group.shard)
