"""A GGUF file's tokenizer as llama.cpp tokenizes it, built on the `tokenizers` library, without transformers.

llama.cpp is the reference implementation of the format's tokenizer: other GGUF runtimes give its ids, so the
same text must give the same ids here (the prefix cache, token counts and limits depend on them). What it does,
and how each step maps onto a `tokenizers.Tokenizer`:

1. Special partition: the text is first cut at every occurrence of a control, unknown or user-defined token's
   text (llama.cpp's tokenizer_st_partition). -> each becomes an added token, matched on the raw text
   (normalized=False); control and unknown ones are `special`. User-defined pieces matter: Gemma's runs of
   spaces, tabs and newlines are user-defined tokens, so 33 spaces are [31 spaces][2 spaces], not whatever
   merges would build.
2. SentencePiece vocabularies (tokenizer.ggml.model "llama"): each remaining fragment, a space prefixed when
   the file says add_space_prefix and the fragment is first or follows a token, spaces escaped as "▁", is
   merged as one word: repeatedly the adjacent pair whose concatenation is the vocabulary piece with the best
   score; pieces that are not tokens become byte tokens. -> a BPE model whose merges are every split of every
   piece into two pieces, ranked by the merged piece's score (the file has scores, not merges), with byte
   fallback; a Prepend/Replace normalizer (tokenizers normalizes each fragment between added tokens on its
   own, so the prefix lands where llama.cpp puts it), and no pre-tokenizer.
3. Byte-level BPE vocabularies ("gpt2"): each fragment is split by the regexes the file's tokenizer.ggml.pre
   names (applied one after the other, each to the pieces of the one before), bytes mapped to GPT-2's
   printable characters, and merged by the file's merges. -> Split pre-tokenizers and ByteLevel, BPE with
   the file's merges (ignore_merges where llama.cpp sets it: a word that is itself a token stays whole).

The one known gap: when two different splits of the same piece are mergeable at once, llama.cpp merges the
leftmost and tokenizers the lower-ranked split (its ranks are per pair). The fixtures of tests/loader record
llama.cpp's ids on hard cases (tests/loader/llama_cpp_tokens.py regenerates them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from pagellm.loader.gguf_file import GGUFHeader

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's end-of-generation ids, where a GGUF states them
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# the chat-template variables transformers passes (bos_token, ...), from the file's ids
_SPECIAL_KEYS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "sep_token": "seperator",
                 "pad_token": "padding", "cls_token": "cls", "mask_token": "mask"}

# Pre-tokenizer regexes by tokenizer.ggml.pre: the models' own tokenizer.json patterns in the form llama.cpp
# applies them (llama-vocab.cpp: case-insensitive groups spelled out; several regexes run one after the other).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
# llama.cpp's ASCII-case form of Tekken's pattern (not tokenizer.json's case categories: they split "aÉ"
# differently, and llama.cpp's ids are the reference)
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?"
           r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE = {  # name -> (regexes, ignore_merges, add_bos when the file does not say)
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    "llama3": ((_LLAMA3,), True, True),
    "dbrx": ((_LLAMA3,), False, False),
    "qwen2": ((_QWEN2,), False, False),
    "qwen35": ((_QWEN35,), False, False),
    "gpt-2": ((_GPT2,), False, False),
    "smollm": ((r"\p{N}", _GPT2), False, False),
    "tekken": ((_TEKKEN,), True, True),
}
_PRE_ALIASES = {"llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3",
                "smaug-bpe": "dbrx", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2", "phi-2": "gpt-2",
                "mpt": "gpt-2", "olmo": "gpt-2", "starcoder": "smollm", "refact": "smollm", "command-r": "smollm"}


def convert(header: GGUFHeader) -> tuple[tokenizers.Tokenizer, dict]:
    """(the tokenizer, the fields of its tokenizer_cache.TokenizerInfo)."""
    metadata = header.metadata
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        raise FileNotFoundError(f"GGUF file {str(header.path)!r} has no tokenizer (no tokenizer.ggml.model metadata)")
    tokens = header.strings("tokenizer.ggml.tokens")
    types = token_types(header).tolist()
    vocab = {token: i for i, token in enumerate(tokens)}  # a repeated text maps to its last id, as in llama.cpp
    if kind == "llama":
        backend = _sentencepiece(tokens, token_scores(header).tolist(), vocab, adds_space_prefix(header))
    elif kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre", "default")
        backend = _byte_level(vocab, header.strings("tokenizer.ggml.merges") or [], pre, header)
    else:
        raise ValueError(f"{str(header.path)!r}: tokenizer.ggml.model {kind!r} is not supported; pagellm reads "
                         "'llama' (SentencePiece) and 'gpt2' (byte-level BPE) vocabularies")
    backend.add_tokens([AddedToken(tokens[i], special=t != USER_DEFINED, normalized=False)
                        for i, t in enumerate(types) if t in (UNKNOWN, CONTROL, USER_DEFINED)])
    info = info_fields(header, tokens.__getitem__, types)
    _add_bos_eos(backend, tokens, special_token_ids(header, len(tokens)), *bos_eos(header))
    return backend, info


def token_types(header: GGUFHeader) -> np.ndarray:
    """Each piece's tokenizer.ggml.token_type (all normal where the file has none) as int32: a view of the file
    where its array is int32 and aligned."""
    types = header.numbers("tokenizer.ggml.token_type")
    n = header.array_lengths["tokenizer.ggml.tokens"]
    return np.full(n, NORMAL, np.int32) if types is None else np.require(types, np.int32, "CA")


def token_scores(header: GGUFHeader) -> np.ndarray:
    """A SentencePiece vocabulary's scores (where the file has none, earlier pieces rank higher) as float32: a
    view of the file where its array is aligned."""
    scores = header.numbers("tokenizer.ggml.scores")
    n = header.array_lengths["tokenizer.ggml.tokens"]
    return -np.arange(n, dtype=np.float32) if scores is None else np.require(scores, np.float32, "CA")


def adds_space_prefix(header: GGUFHeader) -> bool:
    """Whether a SentencePiece vocabulary puts a space before a text's first fragment (llama.cpp's default: yes)."""
    return header.metadata.get("tokenizer.ggml.add_space_prefix", True)


def bos_eos(header: GGUFHeader) -> tuple[bool, bool]:
    """Whether an encoded text gets BOS before it and EOS after it (add_special_tokens): the file's flags, else
    llama.cpp's default for the vocabulary's kind and pre-tokenizer."""
    metadata = header.metadata
    if metadata.get("tokenizer.ggml.model") == "llama":
        add_bos_default = True
    else:
        pre = metadata.get("tokenizer.ggml.pre", "default")
        add_bos_default = _PRE.get(_PRE_ALIASES.get(pre, pre), ((), False, False))[2]
    return (metadata.get("tokenizer.ggml.add_bos_token", add_bos_default),
            metadata.get("tokenizer.ggml.add_eos_token", False))


def special_token_ids(header: GGUFHeader, n: int) -> dict[str, int]:
    """{bos_token: id, eos_token: id, ...}: the chat-template variables the file names, valid ids only."""
    ids = {name: header.metadata.get(f"tokenizer.ggml.{key}_token_id") for name, key in _SPECIAL_KEYS.items()}
    return {name: i for name, i in ids.items() if i is not None and 0 <= i < n}


def info_fields(header: GGUFHeader, text_of, types: Sequence[int] | np.ndarray) -> dict:
    """The fields of tokenizer_cache.TokenizerInfo from the file's metadata; text_of(id): a piece's text."""
    metadata, n = header.metadata, len(types)
    ids = special_token_ids(header, n)
    eos = {metadata[k] for k in _EOS_KEYS if k in metadata}
    return dict(special_tokens={name: text_of(i) for name, i in ids.items()},
                bos_token=text_of(ids["bos_token"]) if "bos_token" in ids else None,
                bos_token_id=ids.get("bos_token"), eos_token_ids=tuple(sorted(eos)),
                # with numpy: a scan of a large vocabulary in Python slows every start
                special_ids=tuple(np.flatnonzero(np.isin(types, (UNKNOWN, CONTROL))).tolist()),
                chat_template=metadata.get("tokenizer.chat_template"), clean_up_spaces=False, vocab_size=n,
                fim_ids={role: metadata[f"tokenizer.ggml.fim_{role}_token_id"]
                         for role in ("pre", "suf", "mid", "pad", "rep", "sep")
                         if f"tokenizer.ggml.fim_{role}_token_id" in metadata})


def _sentencepiece(tokens: list[str], scores: list[float], vocab: dict[str, int],
                   add_space_prefix: bool) -> tokenizers.Tokenizer:
    """Step 2 of the module doc: score-ranked merges of every two-piece split, byte fallback, "▁" for spaces."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))  # best score first, as llama.cpp pops
    merges = []
    for i in order:
        piece = tokens[i]
        if vocab[piece] != i:
            continue
        merges += [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
    unk = next((t for t in ("<unk>",) if t in vocab), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    escape = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if add_space_prefix else escape
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return backend


def _byte_level(vocab: dict[str, int], merges: list[str], pre: str, header: GGUFHeader) -> tokenizers.Tokenizer:
    """Step 3 of the module doc."""
    name = _PRE_ALIASES.get(pre, pre)
    if name not in _PRE:
        raise ValueError(f"{str(header.path)!r}: tokenizer.ggml.pre {pre!r} is not supported; known: "
                         f"{', '.join(sorted({*_PRE, *_PRE_ALIASES}))}")
    regexes, ignore_merges, _ = _PRE[name]
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_bos_eos(backend: tokenizers.Tokenizer, tokens: list[str], ids: dict[str, int], add_bos: bool,
                 add_eos: bool) -> None:
    """BOS before and EOS after an encoded text, as the file asks (add_special_tokens=True)."""
    bos = [(tokens[ids["bos_token"]], ids["bos_token"])] if add_bos and "bos_token" in ids else []
    eos = [(tokens[ids["eos_token"]], ids["eos_token"])] if add_eos and "eos_token" in ids else []
    if not bos and not eos:
        return
    single = " ".join([*(t for t, _ in bos), "$A", *(t for t, _ in eos)])
    pair = " ".join([single, *(t for t, _ in bos), "$B:1", *(t for t, _ in eos)])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=bos + eos)
