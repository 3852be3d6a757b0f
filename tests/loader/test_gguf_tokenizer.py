"""A GGUF's tokenizer gives llama.cpp's ids, on the hard texts whose ids llama.cpp recorded into
fixtures/llama_cpp_tokens.json (tests/loader/llama_cpp_tokens.py regenerates them): a SentencePiece-style
vocabulary in C++ (loader/gguf_sentencepiece.py, the default) and in its `tokenizers` form
(loader/gguf_tokenizer.py, the path without a C++ compiler), a byte-level BPE one in `tokenizers`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagellm.loader.default_model import default_model_path
from pagellm.loader.gguf_file import read_gguf_header
from pagellm.loader.gguf_tokenizer import convert
from pagellm.loader.tokenizer import load_tokenizer
from tests.loader.llama_cpp_tokens import FIXTURE, bpe_gguf, spm_gguf

RECORDED = json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocabularies")
    built = {"gemma3-embedded": default_model_path(), "spm-small": spm_gguf(root / "spm.gguf", RECORDED["spm_vocab"])}
    for name in RECORDED["ids"]:
        if name.startswith("bpe-"):
            built[name] = bpe_gguf(root / f"{name}.gguf", RECORDED["bpe_vocab"], RECORDED["bpe_merges"], name[4:])
    return built


def _tokenize_in_a_fresh_interpreter(cache, native: bool = False) -> str:
    """Gemma's ids for 33 spaces, and the transformers modules imported, as a new process loads them."""
    script = (f"import sys\nfrom pagellm.loader.tokenizer import load_tokenizer\n"
              f"ids = load_tokenizer({str(default_model_path())!r}, {str(cache)!r}, native={native})"
              ".encode(' ' * 33)\n"
              f"print(ids, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding Gemma's tokenizer as a fresh interpreter converted it (seconds: done once), which must not
    import transformers to do so."""
    cache = tmp_path_factory.mktemp("cache")
    assert _tokenize_in_a_fresh_interpreter(cache) == "[2, 167, 138] []"
    return cache


def test_a_warm_cache_loads_without_transformers(cache):
    assert _tokenize_in_a_fresh_interpreter(cache) == "[2, 167, 138] []"


def test_the_native_vocabulary_is_built_from_the_file_alone(tmp_path):
    """The default for a SentencePiece-style GGUF: nothing converted, nothing cached, no transformers."""
    assert _tokenize_in_a_fresh_interpreter(tmp_path, native=True) == "[2, 167, 138] []"
    assert list(tmp_path.iterdir()) == []


_FORMS = [(name, form) for name in sorted(RECORDED["ids"])
          for form in (("tokenizers",) if name.startswith("bpe-") else ("native", "tokenizers"))]


@pytest.mark.parametrize(("name", "form"), _FORMS)
def test_ids_are_llama_cpps_converted_and_from_the_cache(files, cache, name, form):
    """Small vocabularies converted here, then read back; Gemma's read from the cold conversion's entry. The
    native form of a SentencePiece-style vocabulary is built from the file each time (no cache entry)."""
    entries, native = len(list((cache / "tokenizers").iterdir())), form == "native"
    for tokenizer in (load_tokenizer(files[name], cache, native=native), load_tokenizer(files[name], cache, native=native)):
        bos, bos_text = tokenizer.bos_token_id, tokenizer.info.bos_token
        for text, (plain, with_special) in RECORDED["ids"][name].items():
            assert tokenizer.encode(text, add_special_tokens=False) == plain, (name, text)
            if with_special[:2] == [bos, bos] and text.startswith(bos_text):
                with_special = with_special[1:]  # pagellm drops a second BOS when the text itself starts with it
            assert tokenizer.encode(text) == with_special, (name, text)
    assert type(tokenizer).__name__ == ("SentencePieceTokenizer" if native else "Tokenizer")
    assert len(list((cache / "tokenizers").iterdir())) == entries + (name != "gemma3-embedded" and not native)


def test_space_runs_are_the_user_defined_pieces_as_in_llama_cpp(files, cache):
    """The case that made llama.cpp the reference: Gemma's space runs are user-defined pieces, matched longest
    first; transformers' conversion built 33 spaces from merges instead ([16][17] spaces)."""
    assert RECORDED["ids"]["gemma3-embedded"][" " * 33][0] == [167, 138]  # llama.cpp: 31 spaces, 2 spaces
    assert load_tokenizer(files["gemma3-embedded"], cache).encode(" " * 33, add_special_tokens=False) == [167, 138]


def test_the_tokenizers_facts_come_from_the_file(files, cache):
    info = load_tokenizer(files["gemma3-embedded"], cache).info
    assert (info.bos_token, info.bos_token_id, info.eos_token_ids) == ("<bos>", 2, (1,))
    assert info.special_tokens == {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                                   "pad_token": "<pad>"}
    assert len(info.special_ids) == 6249 and 105 in info.special_ids and 138 not in info.special_ids
    assert info.vocab_size == 262_144 and info.clean_up_spaces is False


def test_a_vocabulary_pagellm_cannot_tokenize_as_llama_cpp_is_a_clear_error(tmp_path):
    import gguf

    unknown_pre = bpe_gguf(tmp_path / "pre.gguf", RECORDED["bpe_vocab"], RECORDED["bpe_merges"], "no-such-pre")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre 'no-such-pre' is not supported; known: .*qwen2"):
        convert(read_gguf_header(unknown_pre))
    writer = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "llama")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "a"])
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 't5' is not supported"):
        convert(read_gguf_header(tmp_path / "t5.gguf"))


def test_without_a_compiler_the_tokenizers_form_serves(files, cache, monkeypatch):
    """The native vocabulary needs a C++ compiler; without one (no build), the same ids from `tokenizers`."""
    from pagellm.loader import gguf_sentencepiece

    monkeypatch.setattr(gguf_sentencepiece, "library", lambda: None)
    tokenizer = load_tokenizer(files["spm-small"], cache)
    assert type(tokenizer).__name__ == "Tokenizer"
    for text, (plain, _) in RECORDED["ids"]["spm-small"].items():
        assert tokenizer.encode(text, add_special_tokens=False) == plain, text
