"""Frozen configuration objects. Every environment variable verispec reads is read here."""
from __future__ import annotations

import os
from dataclasses import dataclass


def _env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    return default if not raw else raw not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvSettings:
    debug: bool = False
    model_cache: str | None = None  # VERISPEC_MODEL_CACHE: a local root searched before the HF cache
    hf_hub_cache: str | None = None
    hf_home: str | None = None
    xdg_cache_home: str | None = None
    hf_offline: bool = False
    eagle3_profile: bool = False  # VERISPEC_EAGLE3_PROFILE: per-round draft vs verify milliseconds
    use_fla: bool = True  # VERISPEC_FLA=0: Gated DeltaNet on CUDA uses the torch path, not fla's kernels
    p2p_all_reduce: bool = True  # VERISPEC_P2P_ALL_REDUCE=0: a split model's small all-reduces use NCCL too
    omp_num_threads: str | None = None  # OMP_NUM_THREADS: set, `serve` and `generate` leave the thread count
    cache_dir: str | None = None  # VERISPEC_CACHE_DIR: what verispec derives once and reuses (GGUF tokenizers)
    compile_ahead: bool = True  # VERISPEC_COMPILE_AHEAD=0: prewarm compiles Triton kernels inside the captures, one by one

    @classmethod
    def from_environ(cls) -> "EnvSettings":
        env = os.environ
        return cls(
            debug=_env_flag("VERISPEC_DEBUG"),
            model_cache=env.get("VERISPEC_MODEL_CACHE") or None,
            hf_hub_cache=env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or None,
            hf_home=env.get("HF_HOME") or None,
            xdg_cache_home=env.get("XDG_CACHE_HOME") or None,
            hf_offline=_env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE"),
            eagle3_profile=_env_flag("VERISPEC_EAGLE3_PROFILE"),
            use_fla=_env_flag("VERISPEC_FLA", default=True),
            p2p_all_reduce=_env_flag("VERISPEC_P2P_ALL_REDUCE", default=True),
            omp_num_threads=env.get("OMP_NUM_THREADS") or None,
            cache_dir=env.get("VERISPEC_CACHE_DIR") or None,
            compile_ahead=_env_flag("VERISPEC_COMPILE_AHEAD", default=True),
        )

    def verispec_cache(self) -> str:
        """VERISPEC_CACHE_DIR, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec."""
        if self.cache_dir:
            return self.cache_dir
        return os.path.join(self.xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache"), "verispec")


def env() -> EnvSettings:
    """Read the environment now (tests change it with monkeypatch): every variable, so not once a round."""
    return EnvSettings.from_environ()


def debug_flag() -> bool:
    """VERISPEC_DEBUG alone, read now: what log.debug asks on hot paths (one variable, not all of them)."""
    return _env_flag("VERISPEC_DEBUG")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str | None = None  # None: bf16 on CUDA, float32 on CPU
    device: str | None = None  # None: cuda if available, else cpu
    prefill_step_size: int = 2048
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    default_max_tokens: int = 8192
    max_logprobs: int = 20
    seed: int | None = None
    cuda_graphs: bool = True  # capture decode/verify steps as CUDA graphs (CUDA + Triton only)
    fuse_small_ops: bool = True  # compile norms/RoPE/activations into single kernels (CUDA only)
    eagle3: str | None = None  # speculators EAGLE3 drafter directory
    # drafts per round, whichever the proposer (None: its default, EAGLE3 2, a Qwen MTP head 1, a
    # Gemma 4 assistant 2); the draft schedule may lower it as the batch grows
    num_draft_tokens: int | None = None
    mtp: bool = False  # speculate with the model's own MTP head (Qwen3.5 / Qwen3.6)
    mtp_hidden: str = "post-norm"  # target hidden fed to the head: post-norm | pre-norm
    # --mtp on a Gemma 4 target: the assistant drafter (model_type gemma4_assistant)
    mtp_model: str | None = None  # its directory or hub id (None: `<model>-assistant` beside the model)
    assistant_window: int | None = None  # the assistant attends to the last W target positions (None: all)
    # model-free drafting (spec/suffix.py), alone or beside a model drafter (the longer draft wins)
    suffix: bool = False  # suffix decoding: the sequence itself plus a cache of recent outputs
    suffix_cache_tokens: int = 1 << 18  # that cache's size in tokens (0: the sequence itself only)
    ngram: bool = False  # prompt lookup: copy what followed the last n tokens' earlier occurrence
    ngram_min: int = 2
    ngram_max: int = 5
    # serving: continuous batching over a paged KV cache
    max_num_seqs: int = 64  # sequences decoding at once
    max_num_batched_tokens: int | None = None  # tokens per step, prompt chunks + verify rows (None: see engine)
    block_size: int = 16  # positions per KV block
    gpu_memory_utilization: float = 0.9  # fraction of the free GPU memory (after weights) the KV cache takes
    kv_cache_gb: float | None = None  # the KV cache's size in GiB (CPU default 2; on CUDA overrides the fraction)
    prefix_cache: bool = True  # reuse cached K/V blocks of earlier prompts' prefixes (--no-prefix-cache: off)
    # what the paged KV cache stores: "auto" (the model's dtype), "fp8" (e4m3 codes with a scale per
    # token and kv head; kernels/kv_fp8.py) or "tq4" / "tq3" (rotated rows' 4/4- or 4/3-bit key/value
    # codes and a scale; kernels/kv_turboquant.py); docs/serving.md#kv-cache-compression
    kv_cache_dtype: str = "auto"
    # "exact": a token's result does not depend on the pass it is computed in (batch, speculation,
    # prompt chunking, prefix cache; docs/serving.md); "fast": torch's own GEMMs and flash attention;
    # "auto": exact where it holds and costs little (models/layers/numerics.py `resolve`)
    numerics: str = "auto"
    # plain greedy steps queued one ahead of the host's work on the last (None: where CUDA graphs run)
    overlap_decode: bool | None = None
    # on a CPU, a step's prompt tokens are sized so the step takes about this long (engine/prefill_pacer.py;
    # None: 1 s, 0: off, chunks of --prefill-step-size within the token budget as on a GPU)
    prefill_step_seconds: float | None = None
    # prompt chunks of several sequences share one pass (engine/scheduler.py `prefill_groups`); None:
    # on CUDA, where a pass's launches are shared, not on a CPU (engine/scheduler.py `batches_prompts`)
    batch_prefill: bool | None = None
    # drafts per round: by batch size, "1:3,8:1,32:0", the same for every sequence (None: chosen per
    # sequence per round from the costs below and each sequence's acceptance, engine/draft_policy.py)
    draft_schedule: str | None = None
    # what that choice weighs (engine/draft_costs.py): a table file `verispec bench --write-draft-costs`
    # wrote, "measure" (the engine's own passes timed at start-up), or None (an analytic model per device)
    draft_costs: str | None = None
    # tensor parallelism (docs/multi-gpu.md): the model split over this many processes, one a GPU,
    # over nnodes machines joined by torch.distributed's env rendezvous at master_addr:master_port
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one machine); required across machines
