"""On CUDA, with the graphs captured, a sequence's greedy output inside a batch == its output alone.

A tiny random Qwen3 in float32 (in bfloat16 the GEMMs' reduction order may depend on the batch size,
so only float32 is held to this), plain and speculating with replays of each prompt's own output that
are always right and always wrong: 8 prompts generated one at a time, then all together; every block
freed after.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.replay import KeyedReplay, first_divergence
from tools.tiny import build_tiny_model
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
NEW_TOKENS = 64
TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "x = [",
         "for i in range(10):\n    print(i)\n", "# A function that sorts a list\ndef sort(xs):",
         "while True:\n    line = input()", "with open('f.txt') as f:\n    for line in f:"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir) -> Engine:
    model_dir = tmp_path_factory.mktemp("gpu-batch") / "qwen3"
    build_tiny_model(model_dir, "qwen3", seed=0, tokenizer_dir=tokenizer_dir, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, hidden_size=128, intermediate_size=256)
    engine = load_engine(str(model_dir), dtype="float32", device=DEVICE, max_num_seqs=16, kv_cache_gb=0.5)
    engine.capture_graphs()
    return engine


@pytest.mark.parametrize("proposer", ["plain", "replay-right", "replay-wrong"])
def test_a_sequence_in_a_batch_is_the_sequence_alone(base, proposer):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [base.tokenizer.encode(t) for t in TEXTS]
    engine = base
    if proposer != "plain":
        continuations = {tuple(ids): base.generate_all(ids, params).token_ids for ids in prompts}
        wrong = proposer == "replay-wrong"
        engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                        proposer=KeyedReplay(continuations, base.model.vocab_size, wrong_at=lambda i: wrong),
                        num_drafts=3)
        engine.capture_graphs()
    alone = [engine.generate_all(ids, params).token_ids for ids in prompts]
    together = engine.generate_batch(prompts, params)
    divergences = [first_divergence(a, r.token_ids) for a, r in zip(alone, together)]
    assert divergences == [None] * len(prompts), f"first divergences: {divergences}"
    assert engine.blocks.num_used == 0
