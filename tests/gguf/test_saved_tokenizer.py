"""A tokenizer transformers saved, read back without transformers (loading/saved_tokenizer.py), against
transformers' own tokenizer on the same files: ids, text, special tokens and rendered chats. The files:
the tests' tiny BPE tokenizer (special, extra special and added plain tokens) and the tokenizer
transformers builds from a Qwen3 GGUF file's vocabulary (class Qwen2Tokenizer), as the GGUF loader
caches it; the default model's (TokenizersBackend) in tests/gguf/test_smollm2.py."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from verispec.loading import saved_tokenizer
from verispec.loading.gguf import GGUFCheckpoint

TEXTS = ["", "hello world", "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)",
         "ünïcödé — 漢字 🙂 tabs\tand\nnewlines  double  spaces", "<|im_start|>user\nhi<|im_end|>\n",
         "text <|im_end|> inside, <think>a thought</think> and <|endoftext|>", " leading space", "trailing space "]

# every feature transformers' template environment gives a template: its tojson (indent, no HTML
# escaping), loop controls, {% generation %} blocks, raise_exception, tools, the special tokens as variables
TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools: {{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if message['role'] == 'bad' %}{{ raise_exception('bad role: ' + message['content']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% if loop.index > 6 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}{% endif %}"
    "{{ '' if eos_token is undefined else '' }}"
)
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief <b>&</b>"}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "y"}, {"role": "skip", "content": "z"}, {"role": "user", "content": "ü"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=["tiny", "qwen3"])
def pair(request, tokenizer_dir, tmp_path_factory):
    """(transformers' tokenizer, the SavedTokenizer) read from the same saved directory."""
    from transformers import AutoTokenizer

    if request.param == "tiny":
        directory = tokenizer_dir
    else:
        gguf_files = request.getfixturevalue("gguf_files")
        cache = tmp_path_factory.mktemp("tokenizer-cache")
        mp = pytest.MonkeyPatch()
        mp.setenv("VERISPEC_CACHE_DIR", str(cache))
        GGUFCheckpoint(gguf_files.get("qwen3", "Q4_0").path).tokenizer()
        mp.undo()
        [directory] = (cache / "gguf-tokenizers").iterdir()
    assert saved_tokenizer.readable(directory)
    theirs = AutoTokenizer.from_pretrained(str(directory))
    theirs.clean_up_tokenization_spaces = False  # as the GGUF loader sets it; ours never cleans up
    return theirs, saved_tokenizer.SavedTokenizer(directory)


def test_the_vocabulary_and_special_tokens_are_transformers(pair):
    theirs, ours = pair
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.eos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id)
    assert [ours.convert_ids_to_tokens(i) for i in range(len(ours))] == \
        [theirs.convert_ids_to_tokens(i) for i in range(len(theirs))]
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()}
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_text_encodes_and_decodes_as_transformers_does(pair, text):
    theirs, ours = pair
    for add in (False, True):
        assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add)
        assert ours.encode(text, add_special_tokens=add, split_special_tokens=True) == \
            theirs.encode(text, add_special_tokens=add, split_special_tokens=True)
    ids = theirs.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_a_batch_of_texts_encodes_as_transformers_call_does(pair):
    theirs, ours = pair
    for add in (False, True):
        want = theirs(TEXTS, add_special_tokens=add, verbose=False)["input_ids"]
        assert ours(TEXTS, add_special_tokens=add, verbose=False)["input_ids"] == want
        assert ours(TEXTS[2], add_special_tokens=add)["input_ids"] == want[2]


def test_any_ids_decode_as_transformers_decodes_them(pair):
    theirs, ours = pair
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 24))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["plain", "no-thinking"])
def test_a_chat_renders_as_transformers_renders_it(pair, chat, tools, kwargs):
    theirs, ours = pair
    for template in filter(None, (theirs.chat_template, TEMPLATE)):
        theirs.chat_template = ours.chat_template = template
        for prompt in (False, True):
            want = theirs.apply_chat_template(CHATS[chat], tools=tools, add_generation_prompt=prompt, tokenize=False,
                                              **kwargs)
            assert ours.apply_chat_template(CHATS[chat], tools=tools, add_generation_prompt=prompt, tokenize=False,
                                            **kwargs) == want
    theirs.chat_template = ours.chat_template = TEMPLATE
    bad = [{"role": "bad", "content": "nope"}]
    with pytest.raises(Exception, match="bad role: nope") as raised:
        ours.apply_chat_template(bad, tokenize=False)
    with pytest.raises(type(raised.value), match="bad role: nope"):
        theirs.apply_chat_template(bad, tokenize=False)


def test_reading_a_gguf_tokenizer_from_the_cache_imports_no_transformers(gguf_files, tmp_path):
    """The engine's tokenizer of a GGUF file, read from the verispec cache, in a fresh process: no
    transformers module is imported (its classes cost the CPU server ~50 MiB)."""
    path = gguf_files.get("qwen3", "Q4_0").path
    script = (
        "import sys\n"
        "from verispec.loading.gguf import GGUFCheckpoint\n"
        f"tok = GGUFCheckpoint({str(path)!r}).tokenizer()\n"
        "print(type(tok.hf).__name__, tok.decode(tok.encode('hello world')),\n"
        "      sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {"VERISPEC_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True)  # builds it
    done = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True)
    assert done.stdout.split(None, 1)[0] == "SavedTokenizer"
    assert done.stdout.rstrip().endswith("hello world []"), done.stdout


def test_other_tokenizer_classes_stay_with_transformers(tmp_path):
    """A class that may add to the backend (sentencepiece-style Llama 2 / Gemma) is read by transformers."""
    (tmp_path / "tokenizer.json").write_text("{}")
    for named, readable in (("GemmaTokenizer", False), ("LlamaTokenizer", False), ("TokenizersBackend", True)):
        (tmp_path / "tokenizer_config.json").write_text(f'{{"tokenizer_class": "{named}"}}')
        assert saved_tokenizer.readable(tmp_path) is readable, named
