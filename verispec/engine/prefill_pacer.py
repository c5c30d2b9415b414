"""Prompt tokens per step sized by time, where a step's time is the decoding streams' gap (the CPU).

On a GPU a step's token budget (--max-num-batched-tokens) is a good proxy for its time. On a CPU
a 2048-token prompt chunk takes tens of seconds (float16 several times longer than float32), and
every decoding stream waits that long for its next token. The pacer measures what prompt tokens
cost as steps run and sizes the next step's prompt tokens so the step stays near a time target.

It measures a step's whole time per prompt token (decode rows included). That overestimates a
prompt token's cost by decode_time / prompt_tokens, which is what makes it settle where
decode_time + prompt_tokens * cost = target: the next budget is target / measured cost.
"""
from __future__ import annotations

STEP_TARGET_S = 1.0  # a decoding stream's longest gap beside a long prompt, about
FIRST_BUDGET = 32  # prompt tokens of the first step, before anything is measured (a slow CPU: ~0.6 s)
MIN_BUDGET = 16  # a prompt always makes progress, even when decoding alone exceeds the target
GROWTH = 2.0  # a budget at most doubles per step: the cost per token grows along a prompt
SMOOTHING = 0.5  # weight of the newest measurement (a busy host's steps are noisy)


class PrefillPacer:
    """Token budget for a step's prompt chunks; `observe` each step that ran prompt tokens."""

    def __init__(self, target_s: float = STEP_TARGET_S, first_budget: int = FIRST_BUDGET,
                 min_budget: int = MIN_BUDGET):
        self.target_s = target_s
        self.min_budget = min_budget
        self.seconds_per_token: float | None = None  # None: nothing measured yet
        self._budget = max(first_budget, min_budget)

    def token_budget(self) -> int:
        return self._budget

    def observe(self, num_prompt_tokens: int, seconds: float) -> None:
        """A step ran `num_prompt_tokens` prompt tokens (and whatever decoded beside them) in `seconds`."""
        if num_prompt_tokens <= 0 or seconds < 0:
            return
        cost = seconds / num_prompt_tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = cost
        else:
            self.seconds_per_token = SMOOTHING * cost + (1 - SMOOTHING) * self.seconds_per_token
        # grow from what this step actually ran (a short prompt's tail says little about the next)
        ceiling = max(self._budget, int(num_prompt_tokens * GROWTH))
        fit = int(self.target_s / self.seconds_per_token) if self.seconds_per_token > 0 else ceiling
        self._budget = max(self.min_budget, min(fit, ceiling))


def prefill_pacer_for(device, step_seconds: float | None) -> PrefillPacer | None:
    """The CPU's pacer (step_seconds None: STEP_TARGET_S; 0: none). A GPU's steps are timed by
    their token budget (and asynchronous, so a host clock would not see their cost)."""
    if device.type != "cpu" or step_seconds == 0:
        return None
    return PrefillPacer(STEP_TARGET_S if step_seconds is None else step_seconds)
