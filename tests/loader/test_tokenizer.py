"""Tokenizer loading (GGUF and HF directory), chat templates, and incremental detokenization."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch

from pagellm.config import ModelConfig
from pagellm.loader.default_model import default_model_path
from pagellm.loader.tokenizer import (BUILTIN_CHAT_TEMPLATES, GEMMA_CHAT_TEMPLATE, IncrementalDetokenizer,
                                      load_tokenizer)
from tests.loader.gguf_builders import write_tiny_gguf
from tests.models.tiny_checkpoints import save_hf_tokenizer

MULTI_BYTE = "héllo wörld 日本語 🙂 𝔘𝔫𝔦 ꙮ 𓀀 á"

# a small SentencePiece vocabulary in llama.cpp's layout: specials, 256 byte tokens, pieces
PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁he", "▁hel", "▁hell", "▁hello",
          "▁w", "▁wo", "▁wor", "▁worl", "▁world"]
TINY_VOCAB = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES


@pytest.fixture(scope="module")
def gemma():
    return load_tokenizer(default_model_path(), ModelConfig().cache_dir)


@pytest.fixture(scope="module")
def gemma_tokenizers():
    """The same vocabulary in its `tokenizers` form (a machine without a C++ compiler runs it)."""
    return load_tokenizer(default_model_path(), ModelConfig().cache_dir, native=False)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf", "llama", vocab=TINY_VOCAB).path


def test_gemma_known_ids_and_special_tokens(gemma):
    # Gemma 3's ids for this prompt (as transformers' AutoTokenizer(gguf_file=...) also gives)
    assert gemma.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert gemma.encode("The capital of France is", add_special_tokens=False) == [818, 5279, 529, 7001, 563]
    assert gemma.decode([2, 818, 5279, 529, 7001, 563]) == "The capital of France is"
    assert gemma.decode([2, 818], skip_special_tokens=False) == "<bos>The"
    assert gemma.bos_token_id == 2 and gemma.vocab_size == 262_144
    # <eos> from the file, <end_of_turn> because an instruction-tuned Gemma ends its turn with it
    assert gemma.eos_token_ids == frozenset({1, 106})
    assert gemma.encode("<start_of_turn>user", add_special_tokens=False) == [105, 2364]  # kept whole


def test_special_token_text_can_be_plain_text(gemma):
    """parse_special=False, as llama.cpp's: control-token text is text (llama.cpp 0.3.36's ids, special=False),
    while user-defined pieces (Gemma's newline) still match; the default still parses it."""
    text = "<start_of_turn>user\nhi"
    assert gemma.encode(text, add_special_tokens=False, parse_special=False) == [
        236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 2202]
    assert gemma.encode(text, add_special_tokens=False) == [105, 2364, 107, 2202]


def test_gemma_round_trips_text(gemma):
    for text in ("  two  spaces\n\nand lines\t", MULTI_BYTE, "x = 3.14159; print(x)"):
        assert gemma.decode(gemma.encode(text)) == text


def test_gemma_chat_template_renders_a_turn(gemma):
    # the embedded GGUF has no tokenizer.chat_template: chat needs one given, and Gemma's format is built in
    assert gemma.chat_template is None
    with pytest.raises(ValueError, match="no chat template .* --chat-template FILE or a built-in name"):
        gemma.apply_chat_template([{"role": "user", "content": "Hi"}])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    prompt = gemma.apply_chat_template(messages, template=GEMMA_CHAT_TEMPLATE)
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = gemma.encode(prompt)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1  # one BOS, not two
    turn = gemma.apply_chat_template(messages[1:2], add_generation_prompt=False, template=GEMMA_CHAT_TEMPLATE)
    assert not turn.endswith("model\n")


def test_chat_template_bad_input(gemma):
    with pytest.raises(ValueError, match="non-empty"):
        gemma.apply_chat_template([], template=GEMMA_CHAT_TEMPLATE)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        gemma.apply_chat_template([{"content": "no role"}], template=GEMMA_CHAT_TEMPLATE)


@pytest.mark.parametrize("prompt", ["", "Say:", "日本"])
def test_incremental_detokenizer_matches_full_decode(gemma, prompt):
    prompt_ids = gemma.encode(prompt)
    ids = gemma.encode(MULTI_BYTE + " end", add_special_tokens=False)
    pieces = [gemma.id_to_token(i) for i in ids]
    assert any(p.startswith("<0x") for p in pieces)  # byte-fallback tokens are exercised
    detok = IncrementalDetokenizer(gemma, prompt_ids)
    outputs = [detok.add(i) for i in ids]
    assert not any("\ufffd" in out for out in outputs)
    full = gemma.decode(prompt_ids + ids)
    assert detok.text == "".join(outputs) == full[len(gemma.decode(prompt_ids)):]
    assert detok.flush() == ""


def test_incremental_detokenizer_holds_an_incomplete_character(gemma):
    ids = gemma.encode("𝔘", add_special_tokens=False)  # four byte tokens
    assert len(ids) == 4
    detok = IncrementalDetokenizer(gemma, [2])
    assert [detok.add(i) for i in ids[:3]] == ["", "", ""]
    # a request cut short mid-character: flush gives what decode gives (one U+FFFD per byte)
    assert detok.flush() == gemma.decode(ids[:3]) == "\ufffd" * 3


def test_sentencepiece_leading_spaces(tiny_gguf):
    # a Llama-style tokenizer strips the leading space when decoding from the start, but a
    # streamed "▁world" after "hello" must still come out as " world"
    tok = load_tokenizer(tiny_gguf)
    assert [tok.id_to_token(i) for i in tok.encode("hello world")] == ["<s>", "▁hello", "▁world"]
    detok = IncrementalDetokenizer(tok, tok.encode("hello"))
    assert [detok.add(i) for i in tok.encode("world hello", add_special_tokens=False)] == [" world", " hello"]
    assert tok.decode(tok.encode("hello  wörld")) == "hello  wörld"  # bytes for ö


def test_built_in_plain_template_and_gguf_eos(tiny_gguf):
    tok = load_tokenizer(tiny_gguf)
    assert tok.eos_token_ids == frozenset({2}) and tok.bos_token_id == 1
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    plain = BUILTIN_CHAT_TEMPLATES["plain"]
    assert tok.apply_chat_template(messages, template=plain) == "system: S\nuser: hi\nassistant:"
    chatml = tok.apply_chat_template(messages, template=BUILTIN_CHAT_TEMPLATES["chatml"])
    assert chatml == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_chat_template_metadata_is_used(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    def add_template(writer):
        writer.add_chat_template(template)

    path = write_tiny_gguf(tmp_path / "t.gguf", vocab=TINY_VOCAB, extra_metadata=add_template).path
    assert load_tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"


def test_hf_directory(tmp_path, tiny_gguf):
    source = load_tokenizer(tiny_gguf, native=False)
    save_hf_tokenizer(source, tmp_path, "{{ messages[-1]['content'] }}?")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello world") == source.encode("hello world")
    assert tok.eos_token_ids == frozenset({2, 7, 9})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi?"


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_tokenizer(tmp_path / "empty")


def _random_ids(tokenizer, seed: int) -> list[int]:
    """Random ids (byte-fallback pieces, special tokens, broken characters included) for detokenizer checks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tokenizer.vocab_size, (200,), generator=g).tolist()
    ids[50:54] = tokenizer.encode("𝔘", add_special_tokens=False)  # a character in four byte tokens
    return ids + tokenizer.encode("𝔘", add_special_tokens=False)[:2]  # and one cut short at the end


@pytest.mark.parametrize("seed", range(4))
def test_decode_stream_gives_what_the_python_form_gives(gemma_tokenizers, seed):
    """The Rust DecodeStream path and the two-decode Python form emit the same text, piece by piece, on random
    ids, and flush alike."""
    tok = gemma_tokenizers
    prompt_ids, ids = tok.encode("Say: " + MULTI_BYTE), _random_ids(tok, seed)
    stream, python = IncrementalDetokenizer(tok, prompt_ids), IncrementalDetokenizer(tok, prompt_ids)
    python._stream = None
    assert stream._stream is not None
    assert [stream.add(i) for i in ids] == [python.add(i) for i in ids]
    assert stream.flush() == python.flush() != ""


@pytest.mark.parametrize("seed", range(4))
def test_the_native_vocabulary_decodes_as_the_tokenizers_form(gemma, gemma_tokenizers, seed):
    """Gemma's C++ vocabulary (loader/gguf_sentencepiece.py) against its `tokenizers` form: the same ids for
    texts with special-token text, and the same text, whole and streamed, for random ids."""
    text = "<start_of_turn>user\n" + MULTI_BYTE + "  <b>x</b>\t\t" + " " * 40 + "<end_of_turn><eos>"
    for parse_special in (True, False):
        assert gemma.encode(text, parse_special=parse_special) == gemma_tokenizers.encode(text, parse_special=parse_special)
    ids = _random_ids(gemma_tokenizers, seed)
    for skip in (True, False):
        assert gemma.decode(ids, skip) == gemma_tokenizers.decode(ids, skip)
    prompt_ids = gemma.encode("Say: " + MULTI_BYTE)
    native, reference = IncrementalDetokenizer(gemma, prompt_ids), IncrementalDetokenizer(gemma_tokenizers, prompt_ids)
    assert native._stream is None  # decoding windows: one C++ call each
    assert [native.add(i) for i in ids] == [reference.add(i) for i in ids]
    assert native.flush() == reference.flush() != ""
    assert [gemma.id_to_token(i) for i in ids] == [gemma_tokenizers.id_to_token(i) for i in ids]


def test_a_template_override_and_template_variables(gemma):
    """--chat-template replaces the model's template; chat_template_kwargs become template variables."""
    messages = [{"role": "user", "content": "hi"}]
    template = "{% if enable_thinking is defined and not enable_thinking %}[quiet]{% endif %}{{ messages[0]['content'] }}"
    assert gemma.apply_chat_template(messages, template=template) == "hi"
    assert gemma.apply_chat_template(messages, template=template, enable_thinking=False) == "[quiet]hi"
    with pytest.raises(ValueError, match="no chat template"):  # the model has none of its own to fall back on
        gemma.apply_chat_template(messages)


def test_a_vocabulary_without_byte_pieces_leaves_out_what_it_cannot_spell(tmp_path):
    """Both forms alike: a run of characters it cannot spell is one <unk>, or nothing without one (llama.cpp
    fails there; real SentencePiece files have all 256 byte pieces)."""
    vocab = ["<unk>", "<s>", "</s>", "▁", "h", "e", "l", "o", "he", "ll", "hell", "hello", "▁hello", "é"]
    path = write_tiny_gguf(tmp_path / "no-bytes.gguf", "llama", vocab=vocab).path
    texts = {"hello Zé hello": [12, 3, 0, 13, 12], "ZZü hello": [3, 0, 12], "h Z": [3, 4, 3, 0]}
    for native in (True, False):
        tok = load_tokenizer(path, native=native)
        assert {text: tok.encode(text, add_special_tokens=False) for text in texts} == texts, native
    path = write_tiny_gguf(tmp_path / "no-unk.gguf", "llama").path  # tok0..tok63: nothing spells text
    for native in (True, False):
        assert load_tokenizer(path, native=native).encode("hello", add_special_tokens=False) == []


def test_max_chars_per_token_is_the_longest_piece_doubled(gemma, gemma_tokenizers, tiny_gguf):
    # read id by id (no vocabulary dict); must agree with the dict, added tokens included
    longest = max(map(len, gemma_tokenizers.backend.get_vocab(with_added_tokens=True)))
    assert gemma.max_chars_per_token == gemma_tokenizers.max_chars_per_token == 2 * longest
    assert load_tokenizer(tiny_gguf).max_chars_per_token == 2 * len("▁hello")
    tok = load_tokenizer(tiny_gguf, native=False)
    assert tok.max_chars_per_token == 2 * len("▁hello")
    # as the file's own added tokens are: matched on the raw text (not normalized: no "▁" prefix)
    tok.backend.add_tokens([tokenizers.AddedToken("<a-very-long-added-token>", normalized=False)])
    tok.__dict__.pop("max_chars_per_token", None)
    assert tok.max_chars_per_token == 2 * len("<a-very-long-added-token>")
