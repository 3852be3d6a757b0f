"""A model's tokenizer converted once, kept on disk by content, loaded as tokenizers' JSON at later starts.

Why: converting a vocabulary costs seconds at every start (a GGUF's SentencePiece merges are generated from the
scores: ~3.5 s for Gemma 3's 262k pieces; an HF directory's slow-tokenizer files need transformers, whose
import costs time and resident memory for nothing the server runs). What a conversion builds is a
`tokenizers.Tokenizer` (its JSON) plus a few facts (special tokens, end-of-generation ids, chat template,
decode clean-up): both are written here, and a later start builds the tokenizer from the JSON alone, as
llama.cpp and vLLM cache what they derive from a file. A GGUF is converted by loader/gguf_tokenizer.py (as
llama.cpp tokenizes, no transformers), an HF directory by transformers (loader/tokenizer_conversion.py).

    <cache_dir>/tokenizers/<key>/tokenizer.json, info.json, manifest.json
    key       sha256 of this format's version, the tokenizers version, the converting module's code (and for a
              directory transformers' version), and the bytes the tokenizer is made from: a GGUF's header (its
              metadata holds the whole vocabulary), or every file of an HF directory but its weights
    manifest  sha256 of the two files: an entry that does not match, or does not parse, is rebuilt (logged),
              never used; entries are written to a temporary directory and renamed into place
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import tokenizers

from pagellm.loader.cache_staging import remove_abandoned, staging_folder
from pagellm.loader.gguf_file import GGUFHeader, header_of

logger = logging.getLogger("pagellm.loader")

FORMAT = 1
# Weights and other large files an HF directory's tokenizer is never made from; every other file in it (and in
# its subdirectories: additional_chat_templates/) is part of the key, whatever tokenizer class reads which.
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the engine needs of a tokenizer beyond its `tokenizers.Tokenizer`."""

    special_tokens: dict[str, str]  # bos_token, eos_token, unk_token, pad_token, ...: chat-template variables
    bos_token: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # the file's and configs' ids (the end-of-turn tokens are added on load)
    special_ids: tuple[int, ...]  # added tokens marked special (control tokens)
    chat_template: str | None  # the model's own; None: it has none
    clean_up_spaces: bool  # transformers' clean_up_tokenization after decode (WordPiece-style models)
    vocab_size: int  # with added tokens
    fim_ids: dict[str, int] = dataclasses.field(default_factory=dict)  # a GGUF's fill-in-the-middle ids by role


def converted(path: Path, cache_dir: Path | None, header: GGUFHeader | None = None
              ) -> tuple[tokenizers.Tokenizer, TokenizerInfo]:
    """The tokenizer of a GGUF file or HF directory: from the cache when it holds a sound entry for its content,
    else converted (and stored when there is a cache)."""
    entry = cache_dir / "tokenizers" / _key(path, header) if cache_dir is not None else None
    if entry is not None:
        remove_abandoned(entry.parent)
    if entry is not None and entry.is_dir():
        loaded = _read(entry)
        if loaded is not None:
            return loaded
        logger.warning("tokenizer cache entry %s is corrupt or stale: rebuilt", entry)
        shutil.rmtree(entry, ignore_errors=True)
    if path.is_file():
        from pagellm.loader.gguf_tokenizer import convert as convert_gguf

        backend, fields = convert_gguf(header_of(header if header is not None else path))
    else:
        from pagellm.loader.tokenizer_conversion import convert  # transformers, only on a directory's miss

        backend, fields = convert(path)
    info = TokenizerInfo(**fields)
    if entry is not None:
        _write(entry, backend, info)
    return backend, info


def _key(path: Path, header: GGUFHeader | None) -> str:
    digest = hashlib.sha256(f"{FORMAT} {tokenizers.__version__}".encode())
    converter = "gguf_tokenizer.py" if path.is_file() else "tokenizer_conversion.py"
    digest.update((Path(__file__).parent / converter).read_bytes())  # what converts, as it is now
    if not path.is_file():
        digest.update(version("transformers").encode())
    if path.is_file():  # GGUF: the header bytes, read through the same map as the loader's
        header = header_of(header if header is not None else path)
        with open(path, "rb") as f:
            digest.update(f.read(header.data_start))
    else:
        for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.endswith(_NOT_TOKENIZER)):
            name = file.relative_to(path).as_posix()
            digest.update(name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _read(entry: Path) -> tuple[tokenizers.Tokenizer, TokenizerInfo] | None:
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        texts = {name: (entry / name).read_bytes() for name in ("tokenizer.json", "info.json")}
        if any(hashlib.sha256(data).hexdigest() != manifest.get(name) for name, data in texts.items()):
            return None
        info = json.loads(texts["info.json"])
        info = TokenizerInfo(**{**info, "eos_token_ids": tuple(info["eos_token_ids"]),
                                "special_ids": tuple(info["special_ids"])})
        # from the file, not a str of it: tokenizers then parses as it reads (lower peak memory, faster)
        return tokenizers.Tokenizer.from_file(str(entry / "tokenizer.json")), info
    except Exception:  # noqa: BLE001 - any damage (a missing file, bad JSON, a tokenizer that fails to parse)
        return None


def _write(entry: Path, backend: tokenizers.Tokenizer, info: TokenizerInfo) -> None:
    """Atomically: a reader sees a whole entry or none. A cache that cannot be written is skipped (logged)."""
    try:
        staging = staging_folder(entry.parent)
        texts = {"tokenizer.json": backend.to_str().encode(),
                 "info.json": json.dumps(dataclasses.asdict(info)).encode()}
        for name, data in texts.items():
            (staging / name).write_bytes(data)
        manifest = {name: hashlib.sha256(data).hexdigest() for name, data in texts.items()}
        (staging / "manifest.json").write_text(json.dumps(manifest))
        try:
            os.rename(staging, entry)
        except OSError:  # another process wrote it first: theirs stands
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written must not fail the load
        logger.warning("tokenizer cache not written to %s: %s", entry, exc)
