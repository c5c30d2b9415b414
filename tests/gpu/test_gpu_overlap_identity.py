"""Overlapped decoding on CUDA gives the one-step-at-a-time output, token for token.

A random model of the bench's `tiny` shape (Qwen3 architecture) in bfloat16 with CUDA graphs: 12
greedy requests at once with different prompt lengths and max_tokens, one of them ended by a stop
string, run with overlapped decoding off and on. Both runs must give the same tokens, text and
finish reasons, free every block, and the overlapped run must really have queued steps ahead.
"""
from __future__ import annotations

import pytest
import torch

from verispec.bench.build import random_target
from verispec.bench.shapes import get_shape
from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams
from verispec.engine.types import FinishReason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
STOPPED = 5  # the request that a stop string ends


def test_overlapped_decode_gives_the_step_by_step_output():
    shape = get_shape("tiny")
    target = random_target(shape.name, shape.config, torch.device(DEVICE), torch.bfloat16)
    vocab = target.model.vocab_size
    prompts = [[(977 * i + 31 * j) % vocab for j in range(5 + 23 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=20 + 9 * i, temperature=0.0, ignore_eos=True) for i in range(12)]

    def engine(overlapped: bool) -> Engine:
        config = EngineConfig(model=shape.name, max_num_seqs=16, max_model_len=512, kv_cache_gb=0.25,
                              overlap_decode=None if overlapped else False)
        built = Engine(target.model, target.tokenizer, config)
        built.capture_graphs()
        return built

    step_by_step = engine(overlapped=False)
    assert not step_by_step.overlap.enabled
    # a stop string that the step-by-step batch meets mid-generation in one request
    first = step_by_step.generate_batch(prompts, params)[STOPPED].token_ids
    params[STOPPED] = SamplingParams(max_tokens=params[STOPPED].max_tokens, temperature=0.0, ignore_eos=True,
                                     stop=[target.tokenizer.decode(first[12:14])])
    outputs = {}
    for overlapped, eng in ((False, step_by_step), (True, engine(overlapped=True))):
        eng.round_timings.clear()
        results = eng.generate_batch(prompts, params)
        outputs[overlapped] = [(r.token_ids, r.text, r.finish_reason) for r in results]
        assert eng.blocks.num_used == 0, f"overlap_decode={overlapped}: blocks left in use"
        # an overlapped round records no host preparation time: it was launched during the last one
        queued_ahead = sum(1 for t in eng.round_timings if t[1] == 1 and t[2] == 0.0)
        assert (queued_ahead > 0) == overlapped, (overlapped, queued_ahead)
    assert outputs[False][STOPPED][2] == FinishReason.STOP
    assert outputs[True] == outputs[False]
