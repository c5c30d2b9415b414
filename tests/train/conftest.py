"""Fixtures for drafter-training tests: tiny targets that have learnt a repetitive text.

A random-weight target's greedy output is unrelated to any text, so a drafter trained for a few
seconds could not beat a random one reliably; a target briefly trained on a small set of code
snippets writes them back, which a drafter learns in a few dozen steps. Both targets are trained
here with the demo model's own pretraining loop and saved with `save_pretrained`.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tools.demo_build.pretrain import pretrain
from tools.tiny import build_tiny_model, build_tiny_qwen3_5

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "def square(x):\n    return x * x\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i)\n",
    "if value is None:\n    value = default\n",
    "import os\nimport sys\n",
    "while queue:\n    item = queue.pop()\n    process(item)\n",
    "with open(path) as f:\n    data = f.read()\n",
]


def repetitive_text(num_blocks: int = 400, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(rng.choice(SNIPPETS) for _ in range(num_blocks))


def train_target(out: Path, hf_model, text: str, steps: int = 80) -> Path:
    """Pretrain `hf_model` (fresh init) on `text` and save it over `out` (keeping its tokenizer
    and generation_config)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    stream = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int32)
    pretrain(hf_model, stream, seq_len=64, batch_size=16, lr=3e-3, steps=steps, max_seconds=None,
             device=torch.device("cpu"), state_path=out.parent / f".{out.name}-pretrain.pt", warmup_steps=10,
             progress=False)
    gen_config = (out / "generation_config.json").read_text()
    hf_model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(gen_config)
    return out


@pytest.fixture(scope="session")
def train_text() -> str:
    return repetitive_text()


@pytest.fixture(scope="session")
def data_file(tmp_path_factory, train_text) -> Path:
    path = tmp_path_factory.mktemp("data") / "snippets.py"
    path.write_text(train_text)
    return path


@pytest.fixture(scope="session")
def qwen3_5_target(tmp_path_factory, tokenizer_dir, train_text) -> Path:
    from transformers import Qwen3_5ForCausalLM

    out = tmp_path_factory.mktemp("targets") / "qwen3_5"
    random_model = build_tiny_qwen3_5(out, tokenizer_dir=tokenizer_dir, seed=3)
    torch.manual_seed(0)
    return train_target(out, Qwen3_5ForCausalLM(random_model.config), train_text)


@pytest.fixture(scope="session")
def qwen3_target(tmp_path_factory, tokenizer_dir, train_text) -> Path:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("targets") / "qwen3"
    random_model = build_tiny_model(out, "qwen3", tokenizer_dir=tokenizer_dir, num_hidden_layers=4, head_dim=16)
    torch.manual_seed(0)
    return train_target(out, AutoModelForCausalLM.from_config(random_model.config), train_text)
