"""One sequence's grammar state (an llguidance matcher) and the masks of a speculative round.

Per round, the engine asks each constrained sequence to (1) cut its drafts at the first token the
grammar forbids, (2) compute the masks of every verified position, [last token] + drafts, while the
target's verify pass runs (the matcher advances over the drafts and rolls back, inside llguidance),
and (3) advance over the tokens actually committed. Masks are packed bits, 32 tokens per int32.
"""
from __future__ import annotations

import copy
import threading

import torch

from verispec import log
from verispec.errors import InvalidRequestError
from verispec.grammar.spec import GrammarSpec


class GrammarCompiler:
    """One per engine: the llguidance view of the tokenizer (built on first use: about a second for a
    150k vocabulary, so a server that never constrains never pays it) and the mask executor."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.source = tokenizer  # verispec.loading.tokenizer.Tokenizer, or one with only token_bytes / encode
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)  # covers the model's padded rows too
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = build_ll_tokenizer(self.source, self.vocab_size, self.eos_token_ids)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    @property
    def executor(self):
        _ = self.tokenizer
        return self._executor

    def check(self, spec: GrammarSpec) -> None:
        """Raise a 400-style error naming what the grammar (schema) uses that is not supported."""
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec.grammar, self.tokenizer)
        if is_error:
            raise InvalidRequestError(f"'{spec.param}': unsupported or invalid {spec.description}: "
                                      f"{'; '.join(messages)}", param=spec.param)

    def constraint(self, spec: GrammarSpec) -> "GrammarConstraint":
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"'{spec.param}': unsupported or invalid {spec.description}: "
                                      f"{matcher.get_error()}", param=spec.param)
        return GrammarConstraint(matcher, spec)


# decoded through both views of the vocabulary to check that llguidance reads the tokens' bytes right
BYTES_PROBE = ' {"name": "Zoë", "n": [1, 2.5e-3], "ok": true}\n\t<tool_call>'


def build_ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's tokenizer from the Hugging Face one; where llguidance reads the bytes of the tokens
    differently from verispec's `token_bytes` (e.g. GGUF tokenizers, whose decoder chain starts with
    ByteFallback before ByteLevel), the vocabulary is given to it as those bytes instead."""
    import llguidance

    eos = eos_token_ids or None
    if getattr(tokenizer, "hf", None) is not None:
        ll = _from_backend(llguidance, tokenizer.hf, vocab_size, eos)
        probe = tokenizer.encode(BYTES_PROBE)
        ours = b"".join(bytes(tokenizer.token_bytes(t)) for t in probe)
        if ll.decode_bytes(probe) == ours:
            return ll
        log.debug("llguidance reads this tokenizer's bytes as %r, not %r: giving it the vocabulary as bytes",
                  ll.decode_bytes(probe), ours)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_BytesVocabulary(tokenizer, vocab_size)),
                                  n_vocab=vocab_size, eos_token=eos)


def _from_backend(llguidance, hf_tokenizer, vocab_size: int, eos):
    """llguidance's tokenizer from a fast tokenizer's Rust backend, as `llguidance.hf.from_tokenizer`
    builds it, without that module's import of transformers (a SavedTokenizer has the backend too)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("Only fast tokenizers are supported")
    backend = copy.copy(backend)  # padding and truncation off on a copy, not on the engine's tokenizer
    backend.no_padding()
    backend.no_truncation()
    if eos is None:
        eos = hf_tokenizer.eos_token_id
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


class _BytesVocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the special ids, and encode."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "hf", None)  # None: a bench vocabulary (bench/vocabulary.py)
        num_real = tokenizer.vocab_size
        self.tokens = [bytes(tokenizer.token_bytes(i)) if i < num_real else b"" for i in range(vocab_size)]
        self.special_token_ids = sorted(set(hf.all_special_ids)) if hf is not None else []
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = hf.bos_token_id if hf is not None else None

    def __call__(self, text):
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")  # the wrapper probes for this and then sends str
        return self.tokenizer.encode(text)


class GrammarConstraint:
    def __init__(self, matcher, spec: GrammarSpec):
        self.matcher = matcher
        self.spec = spec

    @property
    def done(self) -> bool:
        """The grammar admits nothing more (only EOS): the generation ends here."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar accepts in a row from the current state."""
        return self.matcher.validate_tokens(token_ids) if token_ids else 0

    def advance(self, token_ids: list[int]) -> tuple[int, bool]:
        """Consume committed tokens; returns (how many to keep, whether the grammar ended there).
        Tokens after the grammar stopped are dropped (the generation ends at the stop)."""
        for i, tok in enumerate(token_ids):
            if self.matcher.is_stopped():
                return i, True
            if not self.matcher.consume_token(tok):
                # masked logits never choose a forbidden token: the grammar itself failed (e.g. a schema
                # recursive without end exceeds llguidance's parser limits), which ends the generation
                log.debug("grammar (%s) failed at token %d: %s; ending the generation", self.spec.description,
                          tok, self.matcher.get_error().splitlines()[0][:300])
                return i + 1, True
        return len(token_ids), self.done


def fill_masks(compiler: GrammarCompiler, rows: list[tuple[GrammarConstraint, int, list[int]]],
               num_rows: int) -> torch.Tensor:
    """Packed masks [num_rows, ceil(V / 32)] int32 (all allowed where no row is given): for each
    (constraint, first row, drafts), the mask before the drafts at `first row` and after draft i at
    `first row + 1 + i`. llguidance computes them in parallel with the GIL released."""
    import llguidance.torch as llt

    words = (compiler.vocab_size + 31) // 32
    packed = torch.full((num_rows, words), -1, dtype=torch.int32)
    with_drafts = [(c.matcher, row, drafts) for c, row, drafts in rows if drafts]
    without = [(c.matcher, row) for c, row, drafts in rows if not drafts]  # the draft API refuses none
    if with_drafts:
        llt.fill_next_token_bitmask_par_with_draft_tokens(compiler.executor, with_drafts, packed)
    if without:
        llt.fill_next_token_bitmask_par(compiler.executor, without, packed)
    return packed


def unpack_allowed(packed: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Packed masks [R, W] int32 -> allowed [R, vocab_size] bool on `device` (unpacked there: the
    copy is 32x smaller than a bool mask)."""
    packed = packed.to(device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((packed.unsqueeze(-1) >> bits) & 1).bool().view(packed.shape[0], -1)
    return allowed[:, :vocab_size]
