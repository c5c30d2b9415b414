"""On CUDA the tokenizer is built on a thread while the weights load (engine/loading.py); its
result, or its error, is what building it inline gives. On a CPU nothing is started."""
from __future__ import annotations

import pytest
import torch

from verispec.engine import loading
from verispec.errors import VerispecError
from verispec.loading.tokenizer import Tokenizer


def test_the_threaded_tokenizer_is_the_inline_one(tokenizer_dir):
    building = loading._tokenizer_beside_the_weights(tokenizer_dir, torch.device("cuda"))
    threaded, inline = building.result(timeout=120), Tokenizer.from_dir(tokenizer_dir)
    text = "def f(x):\n    return x + 1  # ünïcode"
    assert threaded.encode(text) == inline.encode(text)
    assert threaded.eos_token_ids == inline.eos_token_ids


def test_its_error_reaches_the_caller(tmp_path):
    building = loading._tokenizer_beside_the_weights(tmp_path, torch.device("cuda"))
    with pytest.raises(VerispecError, match="could not load a tokenizer"):
        building.result(timeout=120)


def test_a_cpu_load_builds_it_after_the_weights(tokenizer_dir):
    assert loading._tokenizer_beside_the_weights(tokenizer_dir, torch.device("cpu")) is None
