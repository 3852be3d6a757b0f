"""llama.cpp's token ids for hard texts, recorded once into tests/loader/fixtures/llama_cpp_tokens.json, so that CI
checks pagellm's GGUF tokenizer (loader/gguf_tokenizer.py) against llama.cpp without building it.

Vocabularies: the embedded Gemma 3 GGUF (a real SentencePiece vocabulary, scores and user-defined whitespace
pieces, no space prefix); a small SentencePiece vocabulary with llama.cpp's default space prefix (Llama 2 and
Mistral files); and a small byte-level BPE vocabulary trained here on mixed text and code, written into
tokenizer-only GGUFs under each tokenizer.ggml.pre we support (the pre-tokenizer regexes differ on exactly these
texts). The small vocabularies are stored in the fixture, so the test rebuilds the same files whatever version
of tokenizers trains.

Regenerate (needs llama.cpp's libraries, built by ../shared/peers/build-llama-cpp.sh, and the llama-cpp-python
package of the same sdist on PYTHONPATH, with diskcache):

    LLAMA_CPP_LIB_PATH=~/.cache/llama-cpp-peer/build/bin \\
    PYTHONPATH=<dir with diskcache>:~/.cache/llama-cpp-peer/llama_cpp_python-0.3.36 \\
        .venv/bin/python -m tests.loader.llama_cpp_tokens
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf

FIXTURE = Path(__file__).parent / "fixtures" / "llama_cpp_tokens.json"
BPE_PRES = ("default", "llama-bpe", "qwen2", "qwen35", "gpt-2", "smollm", "dbrx", "tekken")

TEXTS = (
    [" " * n for n in range(1, 65)]
    + ["\t" * n for n in (1, 2, 3, 8)] + ["\n" * n for n in (1, 2, 3, 5)]
    + [" \t  \t", "\t  x", "  \t\n  y", "\n\n   1", "\n \n", "x\r\ny", "a  \n  b"]
    + ["def f(x):\n    return x  # comment\n\tpass\n", "if (a && b) { return c[i]; }", "    for i in range(10):",
       "<div class=\"x\">&nbsp;</div>", "SELECT * FROM t WHERE id=42;", "x+=1;y-=2", "path/to/file.py:12"]
    + ["1", "12", "123", "1234", "12345678901234567890", "3.14159", "1,000,000", "2026-11-26", "v1.2.3", "0x1F"]
    + ["日本語のテキスト", "中文分词测试，标点。", "한국어 텍스트", "Ελληνικά", "Кириллица текст", "עברית", "العربية"]
    + ["😀", "👍🏽 emoji", "🇫🇷 flag", "a😀b", "\u200b", "\u00a0nbsp", "\ufeffbom"]
    + ["café naïve résumé", "Ä Ö Ü ß", "e\u0301 combining", "ÀÉÎõü", "ﬁ ligature", "aÉ", "dataÀ", "ÉcoleNormale"]
    + ["Hello world", " Hello", "  leading", "trailing  ", "it's we're I'd they'll IT'S", "don't", "x" * 200,
       "The quick brown fox jumps over the lazy dog.", "$$$ +++ === ^^^ ||| ~~~", "a_b-c.d", "@user #tag"]
    + ["<bos>text", "a<eos>b", "<start_of_turn>user\nhi<end_of_turn>\n", "<unused0>", "<start_of_image>",
       "<|endoftext|>", "<|im_start|>user<|im_end|>", "<s>", "</s>", "<unk>", "[INST] x [/INST]"]
)
# what the small byte-level BPE vocabulary is trained on: a bit of everything TEXTS has, so merges exist
_TRAINING_TEXT = "\n".join(TEXTS[64:]) + "\n" + "\n".join(
    ["    return value", "        if x:", "\t\tindent", "   three", "1000 2000 3000", "hello world hello world",
     "the cat sat on the mat", "def main():", "print('hi')", "  ", "    ", "\n\n", "\n\n\n"] * 4)
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<s>", "</s>")


# a SentencePiece vocabulary: byte pieces, single characters, and merged pieces of words and space runs
SPM_VOCAB = (["<unk>", "<s>", "</s>", "<start_of_turn>"] + [f"<0x{b:02X}>" for b in range(256)]
             + list("▁abcdefghijklmnopqrstuvwxyzTHEQ1234567890.,'") + ["▁▁", "▁▁▁▁", "▁t", "▁th", "▁the", "he",
                "▁a", "an", "▁an", "in", "▁in", "er", "▁w", "▁wo", "▁wor", "▁worl", "▁world", "▁h", "▁he",
                "▁hel", "▁hell", "▁hello", "12", "123", "▁1", "re", "▁re", "▁T", "▁The", "ll", "▁d", "on", "'t"])


def bpe_gguf(path: Path, vocab: list[str], merges: list[str], pre: str) -> Path:
    """A tokenizer-only GGUF (llama architecture, no tensors) of a byte-level BPE vocabulary."""
    writer = _tokenizer_only_writer(path, "gpt2", vocab)
    writer.add_tokenizer_pre(pre)
    writer.add_token_types([gguf.TokenType.CONTROL if t in _SPECIALS else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_merges(merges)
    return _close(writer)


def spm_gguf(path: Path, vocab: list[str]) -> Path:
    """A tokenizer-only GGUF of a SentencePiece vocabulary: scores by position, no add_space_prefix key (so
    llama.cpp's default, a space prefix)."""
    writer = _tokenizer_only_writer(path, "llama", vocab)
    writer.add_token_scores([-float(i) for i in range(len(vocab))])
    types = [gguf.TokenType.BYTE if t.startswith("<0x") else gguf.TokenType.NORMAL for t in vocab]
    types[:4] = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 3
    writer.add_token_types(types)
    return _close(writer)


def _tokenizer_only_writer(path: Path, model: str, vocab: list[str]) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 1), (writer.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    writer.add_tokenizer_model(model)
    writer.add_token_list(vocab)
    writer.add_bos_token_id(vocab.index("<s>"))
    writer.add_eos_token_id(vocab.index("</s>"))
    return writer


def _close(writer: gguf.GGUFWriter) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(writer.path)


def _train_bpe() -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=list(_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_TRAINING_TEXT], trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    return vocab, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]


def main() -> None:
    import os
    import tempfile

    import llama_cpp  # noqa: F401 - checked first: without it nothing can be recorded

    from pagellm.loader.default_model import default_model_path

    vocab, merges = _train_bpe()
    files = {"gemma3-embedded": default_model_path()}
    with tempfile.TemporaryDirectory() as tmp:
        files["spm-small"] = spm_gguf(Path(tmp) / "spm.gguf", SPM_VOCAB)
        files |= {f"bpe-{pre}": bpe_gguf(Path(tmp) / f"{pre}.gguf", vocab, merges, pre) for pre in BPE_PRES}
        recorded = {name: _tokenize_all(path) for name, path in files.items()}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({"llama_cpp": os.environ.get("LLAMA_CPP_LIB_PATH", ""), "texts": list(TEXTS),
                                   "spm_vocab": SPM_VOCAB, "bpe_vocab": vocab, "bpe_merges": merges,
                                   "ids": recorded}, ensure_ascii=False))
    print(f"wrote {FIXTURE}: {len(TEXTS)} texts x {len(files)} vocabularies")


def _tokenize_all(path: Path) -> dict[str, list[list[int]]]:
    """Per text: [ids without BOS/EOS, ids with them], special-token text parsed (as a server prompt is)."""
    import llama_cpp

    model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return {text: [model.tokenize(text.encode(), add_bos=add, special=True) for add in (False, True)]
            for text in TEXTS}


if __name__ == "__main__":
    main()
