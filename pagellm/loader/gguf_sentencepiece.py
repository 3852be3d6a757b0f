"""A GGUF SentencePiece-style vocabulary (tokenizer.ggml.model "llama": Gemma, Llama 2, Mistral's older files)
tokenized in C++ exactly as llama.cpp tokenizes it: loader/csrc/sentencepiece_vocab.cpp.

Why not the `tokenizers` form of loader/gguf_tokenizer.py: it needs a merge for every two-piece split of every
piece (the file has scores, not merges), 515k for the embedded Gemma 3, which cost ~3.5 s to build on a first
start and ~1 s and ~100 MB resident to load from the cache on every later one. This table is built from the
file's own string array in milliseconds and is never cached. It also follows llama.cpp where that form could
not: two splits of one piece mergeable at once merge leftmost. That form stays the path on a machine without a
C++ compiler (the ids are the same: tests/loader/test_gguf_tokenizer.py holds both to llama.cpp's).
"""

from __future__ import annotations

import array
import ctypes
import logging
import re

import numpy as np

from pagellm.kernels.build import native
from pagellm.loader.gguf_file import VOCABULARY, GGUFHeader
from pagellm.loader.gguf_tokenizer import (adds_space_prefix, bos_eos, info_fields, special_token_ids,
                                          token_scores, token_types)

logger = logging.getLogger("pagellm.loader")
_BYTE_PIECE = re.compile(rb"<0x[0-9A-Fa-f]{2}>")

_FUNCTIONS = {  # symbol: (argtypes, restype)
    "sentencepiece_new": ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32),
                          ctypes.c_void_p),
    "sentencepiece_free": ((ctypes.c_void_p,), None),
    "sentencepiece_encode": ((ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                              ctypes.c_void_p, ctypes.c_int64), ctypes.c_int64),
    "sentencepiece_decode": ((ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                              ctypes.c_int64), ctypes.c_int64),
    "sentencepiece_token_id": ((ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64), ctypes.c_int32),
    "sentencepiece_token_text": ((ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)),
                                 ctypes.c_void_p),
    "sentencepiece_longest_piece": ((ctypes.c_void_p,), ctypes.c_int64),
}


def library() -> ctypes.CDLL | None:
    """The compiled vocabulary code (one build for every CPU: no vector code in it), None without a compiler."""
    lib = native.load(*VOCABULARY)
    if lib is not None and lib.sentencepiece_new.restype is not ctypes.c_void_p:
        for symbol, (argtypes, restype) in _FUNCTIONS.items():
            getattr(lib, symbol).argtypes, getattr(lib, symbol).restype = argtypes, restype
    return lib


class SentencePieceVocab:
    """One file's pieces, scores and types in C++; thread-safe (each call keeps its state on its own stack)."""

    def __init__(self, lib: ctypes.CDLL, header: GGUFHeader):
        n = header.array_lengths["tokenizer.ggml.tokens"]
        self.types = token_types(header)
        blob = np.memmap(header.path, mode="r", dtype=np.uint8)[header.string_arrays["tokenizer.ggml.tokens"]:]
        scores = token_scores(header)  # views of the file where it can: no conversion of a long list
        self._lib, self.size = lib, n
        self._handle = lib.sentencepiece_new(blob.ctypes.data, n, scores.ctypes.data, self.types.ctypes.data,
                                             int(adds_space_prefix(header)))
        del blob  # the table holds its own copy of the pieces

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.sentencepiece_free(handle)

    def encode(self, text: str, parse_special: bool = True, space_prefix_first: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            out = array.array("i", bytes(4 * cap))
            n = self._lib.sentencepiece_encode(self._handle, data, len(data), parse_special, space_prefix_first,
                                               out.buffer_info()[0], cap)
            if n <= cap:
                return out[:n].tolist()
            cap = n

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = array.array("i", ids)
        cap = 16 * len(ids) + 16
        while True:
            out = ctypes.create_string_buffer(cap)
            n = self._lib.sentencepiece_decode(self._handle, ids.buffer_info()[0], len(ids), skip_special_tokens,
                                               out, cap)
            if n <= cap:
                return out.raw[:n].decode("utf-8", errors="replace")
            cap = n

    def token_id(self, text: str) -> int | None:
        data = text.encode("utf-8")
        i = self._lib.sentencepiece_token_id(self._handle, data, len(data))
        return None if i < 0 else i

    def token_bytes(self, i: int) -> bytes:
        """A piece's text as stored (UTF-8, spaces as U+2581)."""
        length = ctypes.c_int64()
        address = self._lib.sentencepiece_token_text(self._handle, i, ctypes.byref(length))
        return ctypes.string_at(address, length.value)

    def token_piece(self, i: int) -> bytes:
        """The bytes a piece stands for in a text: U+2581 as a space, a byte piece ("<0x0A>") as its byte."""
        raw = self.token_bytes(i)
        if _BYTE_PIECE.fullmatch(raw):
            return bytes([int(raw[3:5], 16)])
        return raw.replace("\u2581".encode(), b" ")

    def token_text(self, i: int) -> str:
        return self.token_bytes(i).decode("utf-8", errors="replace")

    @property
    def longest_piece(self) -> int:
        """The most characters one piece has."""
        return self._lib.sentencepiece_longest_piece(self._handle)


def load(header: GGUFHeader) -> tuple[SentencePieceVocab, dict, list[int], list[int]] | None:
    """(the vocabulary, the fields of its tokenizer_cache.TokenizerInfo, the ids an encoded text gets before and
    after it when asked for special tokens) of a SentencePiece-style GGUF; None for another kind of vocabulary or
    without a C++ compiler (the caller then builds the `tokenizers` form)."""
    if header.metadata.get("tokenizer.ggml.model") != "llama":
        return None
    lib = library()
    if lib is None:
        logger.info("no C++ compiler: the GGUF's SentencePiece vocabulary is converted for `tokenizers` instead")
        return None
    vocab = SentencePieceVocab(lib, header)
    ids, (add_bos, add_eos) = special_token_ids(header, vocab.size), bos_eos(header)
    before = [ids["bos_token"]] if add_bos and "bos_token" in ids else []
    after = [ids["eos_token"]] if add_eos and "eos_token" in ids else []
    return vocab, info_fields(header, vocab.token_text, vocab.types), before, after
