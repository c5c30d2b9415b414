"""Tokenizer + chat template, through transformers (the format-defining library), or, for a tokenizer
transformers saved, the same read back without it (loading/saved_tokenizer.py)."""
from __future__ import annotations

import json
from pathlib import Path

from verispec.errors import InvalidRequestError, VerispecError
from verispec.loading.control_text import ControlTextMask, MaskedPrompt, control_pattern

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer (or a SavedTokenizer) with what the engine and
    server need."""

    def __init__(self, hf_tokenizer, eos_token_ids: list[int]):
        self.hf = hf_tokenizer
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.vocab_size = len(hf_tokenizer)  # includes added tokens
        template = getattr(hf_tokenizer, "chat_template", None) or ""
        vocab = hf_tokenizer.get_vocab()
        # A model "thinks" when its template or vocabulary knows the <think> tags.
        self.supports_thinking = THINK_OPEN in template or (THINK_OPEN in vocab and THINK_CLOSE in vocab)
        self.has_chat_template = bool(template)
        self._special_ids = set(hf_tokenizer.all_special_ids)
        self._byte_level = _is_byte_level(hf_tokenizer)
        self._backend_decode = _backend_decode(hf_tokenizer)
        self._control_pattern = control_pattern(hf_tokenizer)

    @classmethod
    def from_dir(cls, model_dir: Path, extra_eos: list[int] | None = None) -> "Tokenizer":
        """From a checkpoint directory, or from a GGUF file's metadata (see resolve_model)."""
        from verispec.loading.gguf import GGUFCheckpoint, is_gguf

        if is_gguf(model_dir):
            tokenizer = GGUFCheckpoint(model_dir).tokenizer()
            if extra_eos:
                tokenizer.eos_token_ids = sorted(set(tokenizer.eos_token_ids) | set(extra_eos))
            return tokenizer
        from transformers import AutoTokenizer  # (its module imports transformers' model code)

        try:
            hf = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as exc:  # transformers raises many types; the user needs the path + cause
            raise VerispecError(f"could not load a tokenizer from {model_dir}: {exc}") from exc
        eos: list[int] = list(extra_eos or [])
        if hf.eos_token_id is not None:
            eos.append(int(hf.eos_token_id))
        eos.extend(_generation_config_eos(model_dir))
        return cls(hf, eos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one token decodes to on its own (for logprobs)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes one token stands for (a token may hold part of a UTF-8 character, whose
        decoded text would be U+FFFD). Byte-level BPE tokens map back through the GPT-2 byte
        table; sentencepiece byte-fallback tokens look like <0xAB>."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return list(self.token_text(token_id).encode("utf-8"))
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return [int(piece[3:5], 16)]
            except ValueError:
                pass
        table = _byte_decoder()
        if self._byte_level and token_id not in self._special_ids and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    def render_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                    tools: list | None = None) -> str:
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions with a raw prompt "
                "(or `--no-chat-template` on the command line)", param="messages")
        kwargs = dict(chat_template_kwargs or {})
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # jinja raises on messages the template does not accept
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}",
                                      param="messages") from exc

    def render_chat_prompt(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                           tools: list | None = None) -> MaskedPrompt:
        """The rendered prompt, not yet tokenized (`encode_chat` does that). A control token's spelling
        inside the messages or tools stays text (loading/control_text.py): only the template writes
        control tokens."""
        mask = ControlTextMask(self._control_pattern)
        masked_messages, masked_tools = mask.mask(messages), mask.mask(tools)
        return MaskedPrompt(self.render_chat(masked_messages, chat_template_kwargs, tools=masked_tools), mask)

    def encode_chat(self, prompt: MaskedPrompt) -> list[int]:
        if not prompt.mask.found:
            # The template already wrote any BOS/special tokens into the text.
            return self.encode(prompt.rendered, add_special_tokens=False)
        return prompt.mask.encode(prompt.rendered, self.hf)

    def chat_prompt_ids(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                        tools: list | None = None) -> tuple[str, list[int]]:
        prompt = self.render_chat_prompt(messages, chat_template_kwargs, tools)
        return prompt.text, self.encode_chat(prompt)

    def prompt_opens_thinking(self, prompt_text: str) -> bool:
        """True when the template itself opened <think>: generation starts inside reasoning."""
        if not self.supports_thinking:
            return False
        tail = prompt_text.rstrip()
        return tail.endswith(THINK_OPEN)


def _generation_config_eos(model_dir: Path) -> list[int]:
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as exc:
        raise VerispecError(f"{path} is not valid JSON: {exc}") from exc
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _is_byte_level(hf_tokenizer) -> bool:
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return "ByteLevel" in type(backend.decoder).__name__ or "ByteLevel" in repr(backend.decoder)


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character -> its byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
            list(range(ord("\xae"), ord("\xff") + 1))
        chars = printable[:]
        extra = 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                chars.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(printable, chars)}
    return _BYTE_DECODER


def _backend_decode(hf_tokenizer):
    """The Rust tokenizer's own decode when transformers' decode would return exactly its text: a
    fast tokenizer whose class keeps the stock `_decode` and does no clean-up of spaces. The
    engine decodes twice per sequence per round (engine/detok.py), and transformers' wrapper costs
    several times the decode itself (argument conversion, batching checks). None: use transformers'."""
    from verispec.loading.saved_tokenizer import SavedTokenizer

    if isinstance(hf_tokenizer, SavedTokenizer):  # its decode is the backend's already
        return hf_tokenizer.backend_tokenizer.decode
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
        return None
    if type(hf_tokenizer)._decode is not PreTrainedTokenizerFast._decode:
        return None
    if getattr(hf_tokenizer, "clean_up_tokenization_spaces", False):
        return None
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    return getattr(backend, "decode", None)
