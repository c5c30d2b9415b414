"""The training forward (all positions at once, drafts 2..k unrolled with the "test-time
training" mask) computes exactly what the proposers compute at inference, row by row with their
own caches: a drafter is trained on the function it will run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verispec.cache.kv import KVCache
from tools.tiny import build_tiny_qwen3_5
from verispec.loading.model_loader import load_model
from verispec.spec.mtp import MtpHidden
from verispec.train.attention import unroll_mask
from verispec.train.eagle3 import Eagle3Trainee, choose_draft_vocab, default_aux_layers, drafter_config
from verispec.train.features import target_batch
from verispec.train.mtp import MtpTrainee

T = 20
STEPS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("unroll") / "qwen3_5"
    build_tiny_qwen3_5(out, tokenizer_dir=tokenizer_dir, seed=5)
    return load_model(Path(out), torch.float64, torch.device("cpu"))


def _perturb(module: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)


def test_unroll_mask_shape():
    m = unroll_mask(4, 2, torch.device("cpu"))
    assert m.shape == (4, 12)
    assert m[:, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert m[:, 4:8].equal(torch.eye(4, dtype=torch.bool)) and m[:, 8:].equal(torch.eye(4, dtype=torch.bool))


@pytest.mark.parametrize("layer_type", ["llama", "qwen3"])
def test_eagle3_unroll_matches_the_chained_drafts(target, layer_type):
    draft_ids = torch.arange(0, target.vocab_size, 2)
    config = drafter_config(target, default_aux_layers(target.num_layers), len(draft_ids), layer_type, STEPS, "t")
    trainee = Eagle3Trainee(target, config, draft_ids, copy_embedding=False, out_dir=Path("."), seed=0)
    d = trainee.drafter.double()
    _perturb(d)
    ids = torch.randint(0, target.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    batch = target_batch(target, ids, trainee.capture, target.vocab_size, trainee.draft_ids)
    with torch.no_grad():
        unrolled = trainee.unrolled_logits(batch, STEPS)
    for b in range(2):
        for p in (0, 7, T - 4):
            cache = KVCache(d.cache_specs(), 64, torch.float64, "cpu")
            g = d.project([a[b:b + 1, :p + 1] for a in batch.aux])
            with torch.no_grad():
                fed, logits = d(ids[b:b + 1, 1:p + 2], g, torch.arange(p + 1)[None], cache)
                cache.commit(p + 1)
                torch.testing.assert_close(logits[0, -1], unrolled[0][b, p])
                fed = fed[:, -1:]
                for j in range(1, STEPS):
                    fed, logits = d(ids[b:b + 1, p + j + 1:p + j + 2], fed, torch.tensor([[p + j]]), cache)
                    cache.commit(1)
                    torch.testing.assert_close(logits[0, -1], unrolled[j][b, p])


def test_mtp_unroll_matches_the_chained_drafts(target):
    trainee = MtpTrainee(target, MtpHidden.POST_NORM, target.vocab_size, seed=0)
    head = trainee.head.double()
    _perturb(head)
    ids = torch.randint(0, target.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    batch = target_batch(target, ids, (), target.vocab_size)
    with torch.no_grad():
        unrolled = trainee.unrolled_logits(batch, STEPS)
    for b in range(2):
        for p in (0, 7, T - 4):
            cache = KVCache(head.cache_specs(), 64, torch.float64, "cpu")
            with torch.no_grad():
                out = head(ids[b:b + 1, 1:p + 2], batch.hidden[b:b + 1, :p + 1], torch.arange(p + 1)[None], cache)
                cache.commit(p + 1)
                torch.testing.assert_close(head.logits(out[0, -1]), unrolled[0][b, p])
                out = out[:, -1:]
                for j in range(1, STEPS):
                    out = head(ids[b:b + 1, p + j + 1:p + j + 2], out, torch.tensor([[p + j]]), cache)
                    cache.commit(1)
                    torch.testing.assert_close(head.logits(out[0, -1]), unrolled[j][b, p])


def test_draft_vocabulary_is_the_most_predicted_ids():
    target_counts = torch.tensor([0, 5, 0, 9, 1, 0, 0, 7])
    text_counts = torch.tensor([3, 0, 8, 0, 0, 2, 0, 0])
    # 3 of 8 ids, the last two rows padding: 3 (9), 7 is padding, 1 (5) ... then 4 (1)
    ids = choose_draft_vocab(target_counts, text_counts, 3, num_real_tokens=6)
    assert ids.tolist() == [1, 3, 4]
    # beyond the predicted ids, the text's frequency decides: 2 (8) before 0 (3) before 5 (2)
    assert choose_draft_vocab(target_counts, text_counts, 5, num_real_tokens=6).tolist() == [0, 1, 2, 3, 4]
