"""Tokenizers for HF checkpoint directories and GGUF files, with chat templates and streaming decode.

An HF directory loads with transformers' AutoTokenizer (tokenizer.json, tokenizer_config.json,
chat_template.jinja). A GGUF file's tokenizer is rebuilt by transformers from the file's metadata
(vocabulary, scores or merges, special ids); we call the fast-tokenizer class directly, because
AutoTokenizer would first rebuild the model config through gguf.GGUFReader, which is slow on a large
vocabulary (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md).
Nothing is fetched from the network (local_files_only).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagellm.loader.gguf import read_gguf_header
from pagellm.loader.hf_configs import own_config_of_dir

# Tokens that end a turn or a text in the families we serve. llama.cpp treats these as
# end-of-generation whenever the vocabulary has them as control tokens (llama-vocab.cpp),
# because files rarely list them: Gemma's GGUF says eos = <eos> (1), yet an instruction-tuned
# Gemma ends its answer with <end_of_turn> (106), as its generation_config.json [1, 106] says.
END_OF_TURN_TOKENS = (
    "<end_of_turn>",  # Gemma
    "<|im_end|>",  # ChatML: Qwen
    "<|endoftext|>",  # Qwen base models, GPT-2 family
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3 tool calls
    "<|end_of_text|>",  # Llama 3 base
    "<|end|>",  # Phi-3
)

# Gemma's chat format, for Gemma GGUFs that carry no tokenizer.chat_template (such as the embedded
# one: llama.cpp's converter did not read the separate chat_template.jinja of newer HF repos).
# This is the text part of the template Google ships with Gemma 3: the system prompt is folded
# into the first user turn, and the assistant's role is called "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# For a model with no chat template at all (a base model): one "role: content" line per message.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ message['role'] + ': ' + message['content'] + '\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer:
    """A transformers tokenizer with the few operations the engine needs."""

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int], chat_template: str | None
    ):
        self.hf_tokenizer = hf_tokenizer
        self.chat_template = chat_template or _fallback_chat_template(hf_tokenizer)
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids) | _end_of_turn_ids(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)  # with added tokens; the model's embedding may be larger

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # A rendered chat template often starts with the BOS text itself (Gemma's does); adding
        # BOS again would feed the model two, which it never saw in training.
        bos = self.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos] and text.startswith(self._bos_text):
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, **template_kwargs: Any) -> str:
        """The prompt text for a conversation: [{"role": "user", "content": "..."}, ...]. `template` replaces the
        model's own; `template_kwargs` are extra template variables (e.g. Qwen3's enable_thinking)."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        return self.hf_tokenizer.apply_chat_template(
            messages, chat_template=template or self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **template_kwargs)

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (added tokens too), or None. Why not get_vocab(): it builds the whole
        vocabulary as a dict each call (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md)."""
        backend = getattr(self.hf_tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.token_to_id(token)
        return self._slow_vocab.get(token)

    @functools.cached_property
    def _slow_vocab(self) -> dict[str, int]:
        return self.hf_tokenizer.get_vocab()

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token can stand for (its longest vocabulary piece), doubled for normalizers
        that shrink text: a text longer than this times n cannot encode to n tokens or fewer. Read id by id from a
        Rust tokenizer: get_vocab() would build the whole vocabulary as a dict, whose freed pages the step-buffer
        heap then keeps (measured: docs/PERFORMANCE.md, "Peak RSS of the server")."""
        backend = getattr(self.hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            return 2 * max(map(len, self._slow_vocab), default=1)
        pieces = (backend.id_to_token(i) or "" for i in range(backend.get_vocab_size(with_added_tokens=True)))
        return 2 * max(map(len, pieces), default=1)

    @property
    def _bos_text(self) -> str:
        return self.hf_tokenizer.bos_token or "\0"  # no BOS text: a prefix no prompt starts with


def has_tokenizer(path: str | Path) -> bool:
    """Whether a GGUF file or an HF directory carries a tokenizer (a GGUF always does)."""
    path = Path(path)
    return path.is_file() or any((path / name).is_file() for name in _HF_TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of an HF checkpoint directory or of a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {str(path)!r} (expected a GGUF file or an HF directory)")
    if path.is_file():
        return _load_gguf_tokenizer(path)
    if not any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {str(path)!r}: expected one of {list(_HF_TOKENIZER_FILES)}")
    # AutoTokenizer reads the model config to choose a class: given pagellm's, it does not import transformers' own
    hf = AutoTokenizer.from_pretrained(str(path), config=own_config_of_dir(path), local_files_only=True)
    eos = {hf.eos_token_id} | _config_eos_ids(path / "config.json")
    eos |= _config_eos_ids(path / "generation_config.json")  # e.g. Gemma: [1, 106]
    return Tokenizer(hf, {i for i in eos if i is not None}, hf.chat_template)


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive, without ever cutting a character in half.

    With a Rust (fast) tokenizer, `tokenizers.decoders.DecodeStream` does it in one call per id: it keeps
    a few ids of left context (seeded with the prompt's tail, so SentencePiece's leading spaces come out
    right: a lone "▁Paris" may decode as "Paris") and answers nothing until the ids complete a
    character. Why: the Python form below costs two `decode` calls per id on the engine thread, several
    times the time (docs/PERFORMANCE.md). Other tokenizers take that form, as vLLM does it: decode
    ids[prefix:read] and ids[prefix:] and emit the difference, holding back a text that ends in U+FFFD.
    `flush` gives what is held back at the end (an incomplete character as U+FFFD), as decode would.
    """

    _CONTEXT = 5  # prompt ids kept as left context for the first decoded window

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-self._CONTEXT:])  # left context, then the generated ids
        self._read = len(self._ids)  # ids before this are already emitted (or are the context)
        self._prefix = 0  # window start: left context for decoding
        self._text_parts: list[str] = []
        self._backend = getattr(tokenizer.hf_tokenizer, "backend_tokenizer", None)  # the Rust tokenizer, if any
        self._stream = None if self._backend is None else DecodeStream(self._ids, skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated id; returns the text it completes (often "", sometimes several chars)."""
        self._ids.append(token_id)
        if self._stream is None:
            return self._emit(final=False)
        text = self._stream.step(self._backend, token_id)
        if not text:
            return ""
        # the stream has emitted every id so far: the Python form's window restarts here, for flush
        self._prefix, self._read = max(len(self._ids) - self._CONTEXT, 0), len(self._ids)
        self._text_parts.append(text)
        return text

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character shows as U+FFFD); for a finished request."""
        return self._emit(final=True)

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip_special)
        full_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._text_parts.append(new_text)
        return new_text


def _load_gguf_tokenizer(path: Path) -> Tokenizer:
    metadata = read_gguf_header(path).metadata
    if "tokenizer.ggml.model" not in metadata:
        raise FileNotFoundError(f"GGUF file {str(path)!r} has no tokenizer (no tokenizer.ggml.model metadata)")
    hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    # llama.cpp's end-of-generation ids, where the file states them
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos = {metadata[k] for k in keys if k in metadata}
    return Tokenizer(hf, eos, metadata.get("tokenizer.chat_template"))


def _config_eos_ids(config_file: Path) -> set[int]:
    """eos_token_id of a config.json / generation_config.json: absent, one id, or a list."""
    if not config_file.is_file():
        return set()
    value = json.loads(config_file.read_text()).get("eos_token_id")
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}


def _special_ids(hf: PreTrainedTokenizerBase, tokens: Iterable[str]) -> dict[str, int]:
    """The ids of those of `tokens` that this vocabulary has as special (control) tokens. Looked up one by one:
    get_vocab() builds the whole vocabulary as a dict (~0.2 s for Gemma 3's 262k entries)."""
    special = {i for i, tok in hf.added_tokens_decoder.items() if tok.special}
    backend = getattr(hf, "backend_tokenizer", None)
    lookup = backend.token_to_id if backend is not None else hf.get_vocab().get
    return {t: i for t in tokens if (i := lookup(t)) is not None and i in special}


def _end_of_turn_ids(hf: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of END_OF_TURN_TOKENS that this vocabulary has as special (control) tokens."""
    return frozenset(_special_ids(hf, END_OF_TURN_TOKENS).values())


def _fallback_chat_template(hf: PreTrainedTokenizerBase) -> str:
    """Gemma's format when the vocabulary has Gemma's turn markers as special tokens, else plain lines."""
    if len(_special_ids(hf, ("<start_of_turn>", "<end_of_turn>"))) == 2:
        return GEMMA_CHAT_TEMPLATE
    return PLAIN_CHAT_TEMPLATE
