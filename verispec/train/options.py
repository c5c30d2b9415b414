"""What `verispec train-drafter` is asked to do, validated once (one readable error per bad value)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from verispec.errors import VerispecError


class Method(str, Enum):
    EAGLE3 = "eagle3"  # a speculators-format EAGLE3 drafter directory
    MTP = "mtp"  # a Qwen3.5 multi-token-prediction head, saved as an mtp.safetensors sidecar

    @classmethod
    def parse(cls, value: str) -> "Method":
        try:
            return cls(value)
        except ValueError:
            raise VerispecError(f"--method '{value}' is not supported "
                                f"(accepted: {', '.join(m.value for m in cls)})") from None


@dataclass
class DrafterTrainOptions:
    method: Method
    model: str  # target: local directory or hub id
    out: str  # output directory
    data: list[str] = field(default_factory=list)  # text files or directories
    steps: int = 2000
    max_seconds: float | None = None  # wall-clock budget: the schedule ends at whichever comes first
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    grad_clip: float = 1.0
    ttt_steps: int = 3  # drafts unrolled per training position (1 = first-draft loss only)
    ttt_decay: float = 0.8  # loss weight of unroll step j is ttt_decay ** j
    device: str | None = None
    dtype: str | None = None  # the target's dtype (default: bf16 on CUDA, float32 on CPU)
    seed: int = 0
    holdout_every: int = 20  # every n-th text window is held out (evaluation prompts)
    max_data_tokens: int = 20_000_000  # cap on tokenized training text (documents sampled evenly)
    gen_sequences: int = 256  # continuations the target writes itself, trained on beside the text
    gen_prompt_len: int = 32  # tokens of text before each self-generated continuation
    gen_prompts: str | None = None  # file of prompts (one per line / JSONL) the target answers, instead of text cuts
    gen_fraction: float = 0.25  # share of each batch taken from the target's own continuations
    eval_every: int = 500  # steps between acceptance evaluations (0: only before and after)
    eval_prompts: int = 8
    eval_prompt_len: int = 48
    eval_tokens: int = 64
    eval_drafts: int | None = None  # drafts per round in evaluation (default: ttt_steps, at most 4)
    save_every: int = 500  # steps between checkpoints (state for --resume and the output files)
    restart: bool = False  # ignore an existing checkpoint in OUT
    save_dtype: str = "bfloat16"
    progress: bool | None = None  # None: a bar on a terminal, periodic lines otherwise
    # EAGLE3
    draft_vocab_size: int | None = None  # None: min(32000, target vocabulary)
    vocab_sample_tokens: int = 2_000_000  # target predictions counted to choose the draft vocabulary
    aux_layers: list[int] | None = None  # None: [2, N // 2, N - 3] as the speculators default
    layer_type: str = "llama"  # drafter decoder layer: llama or qwen3
    copy_embedding: bool = False  # save the target's embedding in the drafter (else shared at load)
    # MTP
    mtp_hidden: str = "post-norm"  # target hidden fed to the head: post-norm | pre-norm

    def validate(self) -> None:
        self.method = Method.parse(self.method) if not isinstance(self.method, Method) else self.method
        checks = [("--steps", self.steps, 1), ("--batch-size", self.batch_size, 1), ("--seq-len", self.seq_len, 8),
                  ("--ttt-steps", self.ttt_steps, 1), ("--eval-prompts", self.eval_prompts, 0),
                  ("--eval-tokens", self.eval_tokens, 2), ("--eval-prompt-len", self.eval_prompt_len, 1),
                  ("--holdout-every", self.holdout_every, 2), ("--gen-sequences", self.gen_sequences, 0),
                  ("--gen-prompt-len", self.gen_prompt_len, 1), ("--save-every", self.save_every, 1),
                  ("--eval-every", self.eval_every, 0), ("--max-data-tokens", self.max_data_tokens, 1000),
                  ("--vocab-sample-tokens", self.vocab_sample_tokens, 1)]
        for flag, value, low in checks:
            if value < low:
                raise VerispecError(f"{flag} must be >= {low}, got {value}")
        if self.gen_prompt_len >= self.seq_len:
            raise VerispecError(f"--gen-prompt-len ({self.gen_prompt_len}) must be shorter than --seq-len "
                                f"({self.seq_len})")
        if not 0 < self.gen_fraction < 1:
            raise VerispecError(f"--gen-fraction must be between 0 and 1 (exclusive: every batch keeps a row of "
                                f"each kind), got {self.gen_fraction}")
        if self.gen_prompts is not None and not self.gen_sequences:
            raise VerispecError("--gen-prompts needs --gen-sequences >= 1 (the number of windows the target writes)")
        if not self.lr > 0:
            raise VerispecError(f"--lr must be > 0, got {self.lr}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise VerispecError(f"--max-seconds must be > 0, got {self.max_seconds}")
        if self.eval_drafts is not None and self.eval_drafts < 1:
            raise VerispecError(f"--eval-drafts must be >= 1, got {self.eval_drafts}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise VerispecError(f"--draft-vocab-size must be >= 2, got {self.draft_vocab_size}")
        if self.layer_type not in ("llama", "qwen3"):
            raise VerispecError(f"--layer-type '{self.layer_type}' is not supported (accepted: llama, qwen3)")
        if self.mtp_hidden not in ("post-norm", "pre-norm"):
            raise VerispecError(f"--mtp-hidden '{self.mtp_hidden}' is not supported (accepted: post-norm, pre-norm)")
        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise VerispecError(f"--save-dtype '{self.save_dtype}' is not supported "
                                "(accepted: bfloat16, float16, float32)")
        if self.method is Method.MTP:
            for flag, value in (("--draft-vocab-size", self.draft_vocab_size), ("--aux-layers", self.aux_layers)):
                if value is not None:
                    raise VerispecError(f"{flag} is for --method eagle3 (an MTP head drafts from the full vocabulary)")
        elif self.mtp_hidden != "post-norm":
            raise VerispecError("--mtp-hidden is for --method mtp")

    @property
    def num_eval_drafts(self) -> int:
        if self.eval_drafts is not None:
            return self.eval_drafts
        return min(self.ttt_steps, 4)
