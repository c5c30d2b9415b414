"""`train-drafter --gen-prompts`: the target answers given prompts (e.g. chat prompts rendered
with its template) instead of continuing cuts of the training text.

The oracle for the generated windows is the engine's own plain greedy decoding: a greedy row's
answer to its first prompt must be exactly what the engine generates for that prompt alone.
"""
from __future__ import annotations

import json

import pytest
import torch

from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.errors import VerispecError
from verispec.train import DrafterTrainOptions, Method, train_drafter
from verispec.train.data import generate_answers, read_gen_prompts, split_gen_prompts

PROMPTS = ["def add(a, b):\n", "class Point:\n    def __init__(self", "for i in range(10):\n", "import os\n",
           "with open(path) as f:\n    data", "while queue:\n"]


def test_read_gen_prompts_takes_jsonl_json_strings_and_plain_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "<|im_start|>user\nHi<|im_end|>\n", "kind": "x"}) + "\n\n"
                    + json.dumps("a string\nwith a newline") + "\nplain line\n{not json\n")
    assert read_gen_prompts(str(path)) == ["<|im_start|>user\nHi<|im_end|>\n", "a string\nwith a newline",
                                           "plain line", "{not json"]
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt field"}\n')
    with pytest.raises(VerispecError, match='bad.jsonl:1: a JSON line needs a string "prompt" field'):
        read_gen_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(VerispecError, match="no such file"):
        read_gen_prompts(str(tmp_path / "absent"))


def test_split_holds_out_every_nth_prompt():
    train, held = split_gen_prompts([[i] for i in range(10)], holdout_every=4)
    assert held == [[3], [7]] and len(train) == 8


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_greedy_row_answers_its_prompt_as_the_engine_does_then_takes_the_next(qwen3_target):
    engine = load_engine(str(qwen3_target), dtype="float64", device="cpu")
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # ragged: rows of different prompt lengths decode together
    end = tok.encode("\n")[-1]
    total = 48
    windows = generate_answers(engine.model, prompts, num_rows=4, total_len=total, num_real_tokens=tok.vocab_size,
                               end_ids=[end], batch_size=4, seed=0)
    assert windows.shape == (4, total)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
    for row in (0, 2):  # even rows answer greedily
        first = prompts[order[row]]
        window = windows[row].tolist()
        assert window[:len(first)] == first
        answer = engine.generate_all(first, params).token_ids
        cut = answer.index(end) + 1 if end in answer else len(answer)
        got = window[len(first):len(first) + cut]
        assert got == answer[:len(got)]
        rest = window[len(first) + cut:]
        if end in answer and rest:  # the answer ended inside the window: a prompt follows
            assert any(rest[:len(p)] == p[:len(rest)] for p in prompts), rest


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_train_drafter_with_gen_prompts_evaluates_on_held_out_prompts(tmp_path, qwen3_target, train_text):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 3))
    summary = train_drafter(DrafterTrainOptions(
        method=Method.EAGLE3, model=str(qwen3_target), out=str(tmp_path / "d"), steps=4, batch_size=4, seq_len=64,
        warmup_steps=1, eval_prompts=2, eval_tokens=8, gen_sequences=8, gen_prompts=str(prompts_file),
        gen_fraction=0.75, holdout_every=6, eval_every=0, device="cpu", save_dtype="float32", progress=False),
        documents=[train_text])
    assert summary["steps"] == 4 and summary["after"]["drafted"] > 0
    with pytest.raises(VerispecError, match="--gen-fraction must be between 0 and 1"):
        DrafterTrainOptions(method=Method.EAGLE3, model="m", out="o", gen_fraction=1.0).validate()
