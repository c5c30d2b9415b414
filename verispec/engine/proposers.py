"""Which proposer an engine drafts with, from its configuration: an EAGLE3 drafter, the model's own
MTP head (Qwen3.5 / Qwen3.6), the Gemma 4 assistant, model-free suffix or n-gram drafting, a
model-free proposer beside a model drafter (the longer draft per sequence), or none (with the
reason logged)."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from verispec import log
from verispec.config import EngineConfig
from verispec.loading.tokenizer import Tokenizer
from verispec.errors import VerispecError
from verispec.spec.composite import LongestDraft, Member
from verispec.spec.proposer import Proposer
from verispec.spec.suffix import NgramOptions, NgramProposer, SuffixOptions, SuffixProposer

if TYPE_CHECKING:  # the models' code is imported by the loaders, not by the flag checks that use this module
    from verispec.models.base import CausalLM

DEFAULT_EAGLE3_BLOCK = 2  # drafts per round: the seed system's measured sweet spot
DEFAULT_MTP_DRAFTS = 1  # a Qwen MTP head: one draft + the bonus token (mlx-lm's "depth-2" loop)
# model-free drafts cost nothing to make and only what the counts back is drafted, so the cap is
# higher than a model drafter's (Arctic Inference allows up to 32 on a GPU); not yet measured here
DEFAULT_COPY_DRAFTS = 8


def model_free_options(config: EngineConfig) -> SuffixOptions | NgramOptions | None:
    """The model-free proposer's options (None: none asked for); raises on bad ones."""
    if config.suffix and config.ngram:
        raise VerispecError("--suffix and --ngram are two model-free proposers; use one of them")
    if config.suffix:
        options = SuffixOptions(cache_tokens=config.suffix_cache_tokens)
    elif config.ngram:
        options = NgramOptions(config.ngram_min, config.ngram_max)
    else:
        return None
    options.check()
    return options


def _model_free(config: EngineConfig) -> Proposer | None:
    options = model_free_options(config)
    if options is None:
        return None
    return SuffixProposer(options) if isinstance(options, SuffixOptions) else NgramProposer(options)


def build_proposer(config: EngineConfig, model: CausalLM, model_dir: Path, tokenizer: Tokenizer
                   ) -> tuple[Proposer | None, int]:
    """(proposer, drafts per round), or (None, 0) without speculation."""
    copying = _model_free(config)
    proposer, num_drafts = _model_drafter(config, model, model_dir, tokenizer)
    if copying is None:
        return proposer, num_drafts
    if proposer is None:
        return copying, config.num_draft_tokens or DEFAULT_COPY_DRAFTS
    copy_drafts = max(num_drafts, DEFAULT_COPY_DRAFTS)
    log.debug("%s beside %s: up to %d and %d drafts per round, the longer per sequence", copying.method,
              proposer.method, copy_drafts, num_drafts)
    return LongestDraft([Member(copying, copy_drafts), Member(proposer, num_drafts)]), copy_drafts


def _shared_tables(model: CausalLM, model_dir: Path):
    """What gives a drafter the target's embedding and head: the target itself, or under tensor
    parallelism their whole copy on rank 0 (loaded on first call). Drafters are replicated on
    rank 0 rather than split: a drafting pass then makes no collective and no step message, and
    stays one CUDA graph; the price is the tables' memory on rank 0 (docs/multi-gpu.md)."""
    if getattr(model, "shard", None) is None:
        return lambda: model
    from verispec.loading.model_loader import load_whole_tables

    return functools.cache(lambda: load_whole_tables(model_dir, model))


def _model_drafter(config: EngineConfig, model: CausalLM, model_dir: Path, tokenizer: Tokenizer
                   ) -> tuple[Proposer | None, int]:
    proposer, num_drafts = None, 0
    tables = _shared_tables(model, model_dir)
    if config.eagle3:
        from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

        drafter = load_eagle3(config.eagle3, model, tables)
        proposer = Eagle3Proposer(drafter, model.vocab_size)
        num_drafts = config.num_draft_tokens or DEFAULT_EAGLE3_BLOCK
        log.debug("EAGLE3 drafter %s: aux layers %s, draft vocab %d, %s per round",
                  config.eagle3, list(drafter.cfg.aux_layer_ids), drafter.cfg.draft_vocab_size,
                  log.count(num_drafts, "draft"))
    elif config.mtp and _is_gemma4(model):
        from verispec.spec.gemma4_assistant import assistant_proposer

        if getattr(model, "shard", None) is not None:  # it reads the target's K/V, which the ranks split
            raise VerispecError(f"--mtp on Gemma 4 (its assistant drafter) is not split over GPUs yet "
                                f"(--tensor-parallel-size {model.shard.world_size}); --eagle3, --suffix "
                                "and --ngram work")
        # None (logged) when no assistant checkpoint is found
        proposer, num_drafts = assistant_proposer(config, model, model_dir,
                                                  min(tokenizer.vocab_size, model.vocab_size))
    elif config.mtp:
        from verispec.spec.gemma4_assistant import refuse_assistant_options
        from verispec.spec.mtp import MtpHidden, MtpProposer, load_mtp_head

        refuse_assistant_options(config, model)
        head = load_mtp_head(model_dir, model, tables)  # None (logged) when the model has no head
        if head is not None:
            proposer = MtpProposer(head, MtpHidden.parse(config.mtp_hidden),
                                   num_real_tokens=min(tokenizer.vocab_size, model.vocab_size))
            num_drafts = config.num_draft_tokens or DEFAULT_MTP_DRAFTS
            log.debug("MTP head: %s per round, %s hidden", log.count(num_drafts, "draft"), config.mtp_hidden)
    return proposer, num_drafts


def _is_gemma4(model: CausalLM) -> bool:
    """--mtp on Gemma 4 means its assistant drafter (imported here only: model modules load on demand)."""
    from verispec.models.gemma4 import Gemma4ForCausalLM

    return isinstance(model, Gemma4ForCausalLM)
