"""The checks an EngineConfig passes before anything is loaded: every flag that needs no model.

A bad value is one error line naming the flag, within a second of start-up, instead of after the
model has loaded (which takes a minute on a cold machine). The checks that need the model (an MTP
head it lacks, a drafter for another vocabulary) stay with the loading.
"""
from __future__ import annotations

from verispec.cache.kv import LayerCacheSpec
from verispec.cache.paged import KV_CACHE_DTYPES
from verispec.config import EngineConfig
from verispec.engine.draft_schedule import DraftSchedule
from verispec.engine.tp_group import check_tensor_parallel_options
from verispec.errors import VerispecError
from verispec.loading.device import parse_device, parse_dtype


NUMERICS = ("auto", "exact", "fast")


def check_limits(config: EngineConfig) -> None:
    """The numeric flags."""
    for flag, value in (("--prefill-step-size", config.prefill_step_size), ("--max-num-seqs", config.max_num_seqs),
                        ("--block-size", config.block_size)):
        if value < 1:
            raise VerispecError(f"{flag} must be >= 1, got {value}")
    if not 0 < config.gpu_memory_utilization <= 1:
        raise VerispecError(f"--gpu-memory-utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    if config.kv_cache_gb is not None and config.kv_cache_gb <= 0:
        raise VerispecError(f"--kv-cache-gb must be > 0, got {config.kv_cache_gb}")
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise VerispecError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                            f"got {config.kv_cache_dtype!r}")
    if config.numerics not in NUMERICS:
        raise VerispecError(f"--numerics must be one of {', '.join(NUMERICS)}, got {config.numerics!r}")
    for flag, value in (("--max-model-len", config.max_model_len),
                        ("--max-num-batched-tokens", config.max_num_batched_tokens),
                        ("--num-draft-tokens", config.num_draft_tokens)):
        if value is not None and value < 1:
            raise VerispecError(f"{flag} must be >= 1, got {value}")


def check_kv_cache_dtype(specs: list, kv_cache_dtype: str) -> None:
    """The model's attention layers can hold --kv-cache-dtype: tq codes rotate a row by a Walsh-Hadamard
    matrix and pack 8 codes at a time, so head dims must be powers of two, 8 or more."""
    if not kv_cache_dtype.startswith("tq"):
        return
    dims = sorted({s.head_dim for s in specs if isinstance(s, LayerCacheSpec)})
    if any(d < 8 or d & (d - 1) for d in dims):
        raise VerispecError(f"--kv-cache-dtype {kv_cache_dtype} needs attention head dims that are powers of two "
                            f"(8 or more); this model's are {', '.join(map(str, dims))}: use auto or fp8")


def check_proposer_options(config: EngineConfig) -> None:
    if config.num_draft_tokens is not None and config.num_draft_tokens < 1:
        raise VerispecError(f"--num-draft-tokens must be >= 1, got {config.num_draft_tokens}")
    from verispec.engine.proposers import model_free_options

    model_free_options(config)  # raises on a bad combination or value
    if config.eagle3 and not config.mtp:
        from verispec.spec.eagle3_files import eagle3_config_path

        eagle3_config_path(config.eagle3)
    if not config.mtp:
        return
    from verispec.spec.gemma4_assistant import check_assistant_options
    from verispec.spec.mtp import MtpHidden

    if config.eagle3:
        raise VerispecError("--mtp and --eagle3 are two proposers; use one of them")
    MtpHidden.parse(config.mtp_hidden)
    check_assistant_options(config.assistant_window)


def check_options(config: EngineConfig) -> None:
    """Every flag that needs no model: numbers, device, dtype, draft schedule, proposer options."""
    check_limits(config)
    check_tensor_parallel_options(config)
    device = parse_device(config.device)
    parse_dtype(config.dtype, device)
    DraftSchedule.parse(config.draft_schedule, config.num_draft_tokens or 1)
    check_proposer_options(config)
