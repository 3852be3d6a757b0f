"""Tokenizers without transformers at run time: converted once, kept by content (loader/tokenizer_cache.py),
decoded and rendered as transformers does (loader/tokenizer.py, loader/chat_template.py), encoded as transformers
does for an HF directory (a GGUF's ids are llama.cpp's: test_gguf_tokenizer.py)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest

from pagellm.loader.default_model import default_model_path
from pagellm.loader.tokenizer import GEMMA_CHAT_TEMPLATE, load_tokenizer
from tests.loader.gguf_builders import write_tiny_gguf
from tests.loader.test_tokenizer import TINY_VOCAB

HERMES = (Path(__file__).parents[1] / "server" / "templates" / "hermes_tools.jinja").read_text()
CHATML_THINKING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% if 'tool_calls' in m %}[calls]{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{{ bos_token if False else '' }}{{ strftime_now('%Y') | length }}{{ {'a': 'é<>'} | tojson }}")
CORPUS = [
    "The capital of France is", "  two  spaces\n\nand lines\t", "héllo wörld 日本語 🙂 𝔘𝔫𝔦 ꙮ á",
    "def f(x):\n\tif x:\n\t\treturn [1, 2]  # done\n", "1234567890 3.14159 1e-9 -42", "\n\n   1",
    "<start_of_turn>user\nhi<end_of_turn>", "<bos>already", "don't , it's . ok ?",
    *[" " * n for n in (1, 2, 3, 15, 16, 17, 31, 33, 64)], "\t \t  \n \n", "Ünïcödé — “quotes” …",
]
MESSAGES = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"},
     {"role": "assistant", "content": "Paris.", "reasoning_content": "easy", "tool_calls": None},
     {"role": "user", "content": "And Spain?"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _byte_level_bpe_dir(directory: Path) -> Path:
    """An HF directory with a byte-level BPE (Llama 3 / Qwen style) trained on a little text, ChatML special
    tokens and a template, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 3 + ["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML_THINKING
    hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {"embedded-gemma": Path(default_model_path()),
            "sentencepiece-gguf": write_tiny_gguf(root / "tiny.gguf", "llama", vocab=TINY_VOCAB).path,
            "byte-level-bpe-dir": _byte_level_bpe_dir(root / "bpe")}


def _transformers(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# native: Gemma's vocabulary in C++ (the default); the tiny SentencePiece GGUF in its `tokenizers` form, from the
# cache (the other form of the same code: test_tokenizer.py holds the two forms to each other)
@pytest.mark.parametrize(("name", "native"), [("embedded-gemma", True), ("sentencepiece-gguf", False),
                                              ("byte-level-bpe-dir", True)])
def test_a_cached_tokenizer_decodes_renders_and_encodes_as_its_reference(sources, name, native, tmp_path):
    path = sources[name]
    load_tokenizer(path, tmp_path, native=native)  # converted and stored (but a native vocabulary)
    ours, theirs = load_tokenizer(path, tmp_path, native=native), _transformers(path)  # ours from the cache
    for text in CORPUS:
        for special in (True, False):
            expected = theirs.encode(text, add_special_tokens=special)
            if path.is_dir():  # a GGUF's reference ids are llama.cpp's (test_gguf_tokenizer.py)
                bos = theirs.bos_token_id
                if special and bos is not None and expected[:2] == [bos, bos] and text.startswith(theirs.bos_token):
                    expected = expected[1:]  # ours drops a second BOS when the text itself starts with it
                assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
            assert ours.decode(expected, skip_special_tokens=special) == theirs.decode(
                expected, skip_special_tokens=special)
    for template in [t for t in (ours.chat_template, GEMMA_CHAT_TEMPLATE, HERMES, CHATML_THINKING) if t]:
        for messages in MESSAGES:
            if template is GEMMA_CHAT_TEMPLATE and messages[0]["role"] == "system" and len(messages) == 1:
                continue
            for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
                rendered = theirs.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=True, **kwargs)
                assert ours.apply_chat_template(messages, template=template, **kwargs) == rendered


def test_a_damaged_entry_is_rebuilt_never_used(sources, tmp_path, caplog):
    path = sources["sentencepiece-gguf"]
    load = functools.partial(load_tokenizer, native=False)  # the `tokenizers` form: the one that is cached
    expected = load(path, tmp_path).encode("hello world")
    (entry,) = (tmp_path / "tokenizers").iterdir()
    saved = json.loads((entry / "tokenizer.json").read_text())
    saved["model"]["vocab"]["▁hello"], saved["model"]["vocab"]["▁world"] = 11, 12  # a stale or tampered file
    (entry / "tokenizer.json").write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="pagellm.loader"):
        assert load(path, tmp_path).encode("hello world") == expected
    assert "corrupt or stale: rebuilt" in caplog.text
    caplog.clear()
    (entry / "info.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pagellm.loader"):
        assert load(path, tmp_path).encode("hello world") == expected
    assert "rebuilt" in caplog.text and load(path, tmp_path).encode("hello world") == expected


def test_changed_content_is_another_entry(sources, tmp_path):
    """The key is the content: a directory whose template changed is converted again, not served stale."""
    directory = tmp_path / "bpe"
    _byte_level_bpe_dir(directory)
    cache = tmp_path / "cache"
    assert load_tokenizer(directory, cache).chat_template == CHATML_THINKING
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = "{{ messages[0]['content'] }}!"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(directory, cache).apply_chat_template([{"role": "user", "content": "a"}]) == "a!"
    assert len(list((cache / "tokenizers").iterdir())) == 2


def test_a_cache_that_cannot_be_written_is_skipped(sources, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="pagellm.loader"):
        tok = load_tokenizer(sources["sentencepiece-gguf"], blocker, native=False)
    assert tok.encode("hello") == [1, TINY_VOCAB.index("▁hello")] and "not written" in caplog.text
