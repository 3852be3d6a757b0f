"""transformers' tokenizer of an HF checkpoint directory, reduced to what pagellm keeps of it.

Only loader/tokenizer_cache.py imports this, on a directory's cache miss (or with no cache): transformers builds
the tokenizer from the directory's tokenizer files, and the result is its `tokenizers.Tokenizer` plus the facts
of a TokenizerInfo. A GGUF's tokenizer is loader/gguf_tokenizer.py's (llama.cpp's ids, no transformers).
Nothing is fetched from the network (local_files_only).
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagellm.loader.hf_configs import own_config_of_dir


def convert(path: Path) -> tuple[tokenizers.Tokenizer, dict]:
    """(the tokenizer, the fields of its tokenizer_cache.TokenizerInfo)."""
    # AutoTokenizer reads the model config to choose a class: given pagellm's, it imports no transformers model
    hf = AutoTokenizer.from_pretrained(str(path), config=own_config_of_dir(path), local_files_only=True)
    eos = {hf.eos_token_id} | _config_eos_ids(path / "config.json")
    eos |= _config_eos_ids(path / "generation_config.json")  # e.g. Gemma: [1, 106]
    template = hf.chat_template
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{str(path)!r}: transformers gives a slow (Python) tokenizer here; pagellm needs one the "
                         "tokenizers library runs (a tokenizer.json)")
    backend.no_padding()  # as saved: no padding or truncation, whatever the directory asked (hf is dropped after)
    backend.no_truncation()
    info = dict(
        special_tokens=_special_tokens_map(hf), bos_token=hf.bos_token, bos_token_id=hf.bos_token_id,
        eos_token_ids=tuple(sorted(i for i in eos if i is not None)),
        special_ids=tuple(sorted(i for i, token in hf.added_tokens_decoder.items() if token.special)),
        chat_template=template, clean_up_spaces=_cleans_up(hf, backend), vocab_size=len(hf))
    return backend, info


def _special_tokens_map(hf: PreTrainedTokenizerBase) -> dict:
    """transformers' special_tokens_map (what it passes a chat template) as plain strings."""
    plain = {}
    for name, value in hf.special_tokens_map.items():
        plain[name] = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value)
    return plain


def _cleans_up(hf: PreTrainedTokenizerBase, backend: tokenizers.Tokenizer) -> bool:
    """Whether transformers' decode runs clean_up_tokenization: asked for, and not skipped for a BPE model."""
    if not hf.clean_up_tokenization_spaces:
        return False
    forced = getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or bool(forced)


def _config_eos_ids(config_file: Path) -> set[int]:
    """eos_token_id of a config.json / generation_config.json: absent, one id, or a list."""
    if not config_file.is_file():
        return set()
    value = json.loads(config_file.read_text()).get("eos_token_id")
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}
