"""A tokenizer that transformers saved (tokenizer.json, tokenizer_config.json, chat_template.jinja),
read back with the `tokenizers` library and rendered with jinja2, without importing transformers.

transformers' tokenizer classes import most of the library: +88 MiB of a process's memory where
the `tokenizers` backend and jinja2 take 36 (on a CPU the default model's whole process is ~400).
This class answers what loading/tokenizer.py and its callers ask of a transformers fast tokenizer
whose class adds nothing to the backend (`PLAIN_CLASSES`): the same ids, text, special tokens and
rendered chat (tests/gguf/test_saved_tokenizer.py holds it to transformers' on the same files). The chat template is rendered as transformers renders it: the
same sandboxed jinja2 environment, filters and globals, with the named special tokens as variables.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

# the tokenizer classes whose encode / decode / chat are the backend's and transformers' template code,
# checked against transformers on saved files (SmolLM2's GGUF gives TokenizersBackend, Qwen's
# Qwen2Tokenizer); sentencepiece-style classes (Llama 2, Gemma) keep transformers' own
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer")
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def readable(directory: Path) -> bool:
    """Whether `SavedTokenizer` reads this directory the way transformers would."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("tokenizer_class") in PLAIN_CLASSES and (directory / "tokenizer.json").is_file()


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or a dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class SavedTokenizer:
    """The subset of a transformers fast tokenizer verispec uses, over its saved files."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as Backend

        directory = Path(directory)
        self.name_or_path = str(directory)
        self.backend_tokenizer = Backend.from_file(str(directory / "tokenizer.json"))
        self._splitting = None  # the backend's copy for split_special_tokens (built on first use)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        self.special_tokens_map = {name: text for name in NAMED_SPECIAL
                                   if (text := _token_text(config.get(name))) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # a name -> token map
            extra = list(extra.values())
        named = list(self.special_tokens_map.values())
        self.all_special_tokens = list(dict.fromkeys(named + [t for t in map(_token_text, extra) if t is not None]))
        template_file = directory / "chat_template.jinja"
        template = config.get("chat_template")
        if template is None and template_file.is_file():
            template = template_file.read_text()
        self.chat_template = template if isinstance(template, str) else None
        self.clean_up_tokenization_spaces = False  # decode returns what the backend decodes
        self._compiled: tuple[str, object] | None = None

    # ---- the vocabulary -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    def _token_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    # ---- text -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """split_special_tokens: a special token's spelling in `text` is text, not that token.

        As a batch of one: the backend's batch calls release the GIL (the server prepares requests
        on two threads beside its event loop, and a plain `encode` held it throughout) and the fast
        one computes no offsets, which nothing here reads: the same ids in 0.75x the time."""
        backend = self._splitting_backend() if split_special_tokens else self.backend_tokenizer
        batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # (tokenizers < 0.21: no fast one)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _splitting_backend(self):
        """A copy of the backend that reads special tokens' spellings as text: set once on its own
        copy, since toggling the shared one's flag would race with encodes on other threads."""
        if self._splitting is None:
            from tokenizers import Tokenizer as Backend

            copy = Backend.from_str(self.backend_tokenizer.to_str())
            copy.encode_special_tokens = True
            self._splitting = copy
        return self._splitting

    def __call__(self, texts, add_special_tokens: bool = True, verbose: bool = True) -> dict:
        """{"input_ids": ...} of a text or a list of texts, as transformers' call gives them (the
        drafter trainer's batches; no attention mask, which nothing here reads)."""
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens=add_special_tokens)}
        encoded = self.backend_tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encoded]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs):
        """transformers' rendering of one conversation (tools as JSON schemas); tokenize=True gives ids."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        for tool in tools or []:
            if not isinstance(tool, dict):
                raise ValueError("tools must be JSON schemas (dicts)")
        variables = {**self.special_tokens_map, **kwargs}
        rendered = self._template().render(messages=messages, tools=tools, documents=variables.pop("documents", None),
                                           add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

    def _template(self):
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _environment().from_string(self.chat_template))
        return self._compiled[1]


@functools.cache
def _environment():
    """transformers' chat-template environment: sandboxed, blocks trimmed, loop controls, its
    `tojson` (no HTML escaping), `raise_exception` and `strftime_now`; `{% generation %}` blocks
    (which mark assistant text for training masks) render their body."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
