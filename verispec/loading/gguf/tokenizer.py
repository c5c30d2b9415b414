"""The tokenizer of a GGUF file, built by transformers from the file's vocabulary (`gguf_file=`).

What we take from the metadata ourselves: the chat template (`tokenizer.chat_template`, set on the
tokenizer whatever transformers did with it) and the ids that end generation. transformers' llama
converter swaps bos and eos on the tokenizer it builds, so its eos_token is not used; the ids are
eos / eot / eom from the metadata plus, as llama.cpp does, the vocabulary's end-of-turn markers.
"""
from __future__ import annotations

from verispec import log
from verispec.errors import VerispecError
from verispec.loading.tokenizer import Tokenizer

END_OF_TURN_MARKERS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def gguf_tokenizer(checkpoint) -> Tokenizer:
    """checkpoint: a GGUFCheckpoint."""
    from transformers import AutoTokenizer

    from verispec.loading.gguf import END_OF_GENERATION_KEYS

    path = checkpoint.path
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types; the user needs the path + cause
        raise VerispecError(f"could not build a tokenizer from GGUF file {path}: {exc}") from exc
    # GGUF has no such setting and llama.cpp never cleans up; transformers' GGUF converter turns on this
    # WordPiece clean-up (spaces before punctuation stripped), which 5.17 ignores for BPE with a warning
    # at every start. Off, the text is what the file's vocabulary spells (and decoding takes the fast path)
    hf.clean_up_tokenization_spaces = False
    values = checkpoint.meta.values
    template = values.get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    else:
        log.debug("GGUF %s has no tokenizer.chat_template: chat requests will be refused", path.name)
    eos = [int(values[k]) for k in END_OF_GENERATION_KEYS if values.get(k) is not None]
    vocab = hf.get_vocab()
    markers = [vocab[m] for m in END_OF_TURN_MARKERS if m in vocab]
    if not eos:
        log.debug("GGUF %s names no eos token; ending generation on %s only", path.name, markers or "max_tokens")
    return Tokenizer(hf, eos + markers)
