"""Which proposer an engine drafts with, from its configuration: an EAGLE3 drafter, the model's own
MTP head (Qwen3.5 / Qwen3.6), the Gemma 4 assistant, or none (with the reason logged)."""
from __future__ import annotations

from pathlib import Path

from verispec import log
from verispec.config import EngineConfig
from verispec.loading.tokenizer import Tokenizer
from verispec.models.base import CausalLM
from verispec.spec.proposer import Proposer

DEFAULT_EAGLE3_BLOCK = 2  # drafts per round: the seed system's measured sweet spot
DEFAULT_MTP_DRAFTS = 1  # a Qwen MTP head: one draft + the bonus token (mlx-lm's "depth-2" loop)


def build_proposer(config: EngineConfig, model: CausalLM, model_dir: Path, tokenizer: Tokenizer
                   ) -> tuple[Proposer | None, int]:
    """(proposer, drafts per round), or (None, 0) without speculation."""
    proposer, num_drafts = None, 0
    if config.eagle3:
        from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

        drafter = load_eagle3(config.eagle3, model)
        proposer = Eagle3Proposer(drafter, model.vocab_size)
        num_drafts = config.num_draft_tokens or DEFAULT_EAGLE3_BLOCK
        log.debug("EAGLE3 drafter %s: aux layers %s, draft vocab %d, %s per round",
                  config.eagle3, list(drafter.cfg.aux_layer_ids), drafter.cfg.draft_vocab_size,
                  log.count(num_drafts, "draft"))
    elif config.mtp and _is_gemma4(model):
        from verispec.spec.gemma4_assistant import assistant_proposer

        # None (logged) when no assistant checkpoint is found
        proposer, num_drafts = assistant_proposer(config, model, model_dir,
                                                  min(tokenizer.vocab_size, model.vocab_size))
    elif config.mtp:
        from verispec.spec.gemma4_assistant import refuse_assistant_options
        from verispec.spec.mtp import MtpHidden, MtpProposer, load_mtp_head

        refuse_assistant_options(config, model)
        head = load_mtp_head(model_dir, model)  # None (logged) when the model has no head
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
