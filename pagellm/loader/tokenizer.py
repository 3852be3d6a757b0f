"""Tokenizers for HF checkpoint directories and GGUF files, with chat templates and streaming decode.

A tokenizer is a `tokenizers.Tokenizer` (the Rust library) plus a TokenizerInfo, converted once (a GGUF's as
llama.cpp tokenizes, by loader/gguf_tokenizer.py; an HF directory's by transformers,
loader/tokenizer_conversion.py) and kept on disk by content by loader/tokenizer_cache.py, so a later start
loads it without converting. A SentencePiece-style GGUF's is instead a SentencePieceTokenizer over its
vocabulary in C++ (loader/gguf_sentencepiece.py), built from the file at every start in ~0.1 s. Chat
templates are rendered by loader/chat_template.py as transformers renders them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from pagellm.loader import chat_template, gguf_sentencepiece
from pagellm.loader.gguf_file import header_of
from pagellm.loader.tokenizer_cache import TokenizerInfo, converted

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

# Gemma's chat format (the text part of the template Google ships with Gemma 3: the system prompt folded into the
# first user turn, the assistant's role called "model"), for Gemma GGUFs that carry no tokenizer.chat_template
# (llama.cpp's converter did not read the separate chat_template.jinja of newer HF repos): `--chat-template gemma`.
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
# ChatML (Qwen and many fine-tunes): `--chat-template chatml`
CHATML_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
# One "role: content" line per message: `--chat-template plain`, a conversation as text for a base model.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ message['role'] + ': ' + message['content'] + '\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)
# --chat-template NAME, as llama-server takes built-in names (a path to a file works too)
BUILTIN_CHAT_TEMPLATES = {"gemma": GEMMA_CHAT_TEMPLATE, "chatml": CHATML_CHAT_TEMPLATE, "plain": PLAIN_CHAT_TEMPLATE}
NO_CHAT_TEMPLATE = ("this model has no chat template (a base model continues text: use /v1/completions); serve it "
                    "with --chat-template FILE or a built-in name (" + ", ".join(BUILTIN_CHAT_TEMPLATES) + ")")

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# transformers' clean_up_tokenization: spaces a WordPiece decode leaves before punctuation and contractions
_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
              (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """A `tokenizers.Tokenizer` with the few operations the engine needs."""

    def __init__(self, backend: tokenizers.Tokenizer, info: TokenizerInfo):
        self.backend, self.info = backend, info
        self.special_ids = frozenset(info.special_ids)
        # The model's own; None: it has none, and chat needs one given (vLLM's rule: no guessed format, whose
        # answers from a base model are noise)
        self.chat_template: str | None = info.chat_template
        self.eos_token_ids: frozenset[int] = frozenset(info.eos_token_ids) | _end_of_turn_ids(self)
        self.bos_token_id: int | None = info.bos_token_id
        self.vocab_size: int = info.vocab_size  # with added tokens; the model's embedding may be larger
        self._templates: dict[str, Any] = {}  # compiled, by text
        self._plain: tokenizers.Tokenizer | None = None  # _plain_backend's, once built
        self._plain_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """parse_special False: special-token text (`<|im_end|>`, `<bos>`) is plain text, as llama.cpp's
        parse_special=false has it (user-defined pieces still match)."""
        ids = self._encode(text, add_special_tokens, parse_special)
        # A rendered chat template often starts with the BOS text itself (Gemma's does); adding
        # BOS again would feed the model two, which it never saw in training.
        bos = self.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos] and text.startswith(self._bos_text):
            ids = ids[1:]
        return ids

    def _encode(self, text: str, add_special_tokens: bool, parse_special: bool) -> list[int]:
        backend = self.backend if parse_special else self._plain_backend()
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A second backend that leaves special tokens unmatched, built on first use (a parse of the vocabulary:
        only what needs it pays). Why a copy: tokenizers' switch is the tokenizer object's own, and the server's
        text pool encodes on several threads at once, so it cannot be flipped for one call."""
        with self._plain_lock:
            if self._plain is None:
                plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.info.clean_up_spaces:
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, **template_kwargs: Any) -> str:
        """The prompt text for a conversation: [{"role": "user", "content": "..."}, ...]. `template` replaces the
        model's own; `template_kwargs` are extra template variables (e.g. Qwen3's enable_thinking, tools)."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        text = template or self.chat_template
        if text is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        compiled = self._templates.get(text)
        if compiled is None:
            compiled = self._templates[text] = chat_template.compile_template(text)
        return chat_template.render(compiled, messages, add_generation_prompt, self.info.special_tokens,
                                    **template_kwargs)

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (added tokens too), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """A vocabulary entry's text as the vocabulary spells it ("▁world", "<0x0A>"), or None."""
        return self.backend.id_to_token(i)

    def llguidance_source(self) -> Any:
        """What llguidance.LLTokenizer builds its token trie from: the tokenizer as tokenizers' JSON."""
        return self.backend.to_str()

    @property
    def stream_backend(self) -> tokenizers.Tokenizer | None:
        """What tokenizers' DecodeStream steps with (IncrementalDetokenizer); None: decode windows instead."""
        return self.backend

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token can stand for (its longest vocabulary piece), doubled for normalizers
        that shrink text: a text longer than this times n cannot encode to n tokens or fewer. Read id by id:
        get_vocab() would build the whole vocabulary as a dict, whose freed pages the step-buffer heap then keeps
        (measured: docs/PERFORMANCE.md, "Peak RSS of the server")."""
        backend = self.backend
        pieces = (backend.id_to_token(i) or "" for i in range(backend.get_vocab_size(with_added_tokens=True)))
        return 2 * max(map(len, pieces), default=1)

    @property
    def _bos_text(self) -> str:
        return self.info.bos_token or "\0"  # no BOS text: a prefix no prompt starts with


def has_tokenizer(path: str | Path) -> bool:
    """Whether a GGUF file or an HF directory carries a tokenizer (a GGUF always does)."""
    path = Path(path)
    return path.is_file() or any((path / name).is_file() for name in _HF_TOKENIZER_FILES)


def load_tokenizer(path: str | Path, cache_dir: str | Path | None = None, header=None,
                   native: bool = True) -> Tokenizer:
    """The tokenizer of an HF checkpoint directory or of a GGUF file. cache_dir: where converted tokenizers are
    kept by content (loader/tokenizer_cache.py); None: converted each time. header: the GGUF's,
    when the caller has read it (loader/gguf_file.py). native False: a SentencePiece-style GGUF's vocabulary
    converted for `tokenizers` too (the form a machine without a C++ compiler runs; the same ids)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {str(path)!r} (expected a GGUF file or an HF directory)")
    if path.is_dir() and not any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {str(path)!r}: expected one of {list(_HF_TOKENIZER_FILES)}")
    if path.is_file() and native:
        header = header_of(header if header is not None else path)
        loaded = gguf_sentencepiece.load(header)
        if loaded is not None:
            vocab, fields, before, after = loaded
            return SentencePieceTokenizer(vocab, TokenizerInfo(**fields), before, after)
    backend, info = converted(path, Path(cache_dir) if cache_dir else None, header)
    return Tokenizer(backend, info)


class SentencePieceTokenizer(Tokenizer):
    """A GGUF's SentencePiece-style vocabulary in C++ (loader/gguf_sentencepiece.py): the same operations."""

    def __init__(self, vocab: gguf_sentencepiece.SentencePieceVocab, info: TokenizerInfo, before: list[int],
                 after: list[int]):
        self.vocab = vocab
        self._before, self._after = before, after  # BOS / EOS ids added with add_special_tokens, as the file asks
        super().__init__(None, info)

    def _encode(self, text: str, add_special_tokens: bool, parse_special: bool) -> list[int]:
        ids = self.vocab.encode(text, parse_special)
        return [*self._before, *ids, *self._after] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.vocab.decode(ids, skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.vocab.token_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.vocab.token_text(i) if 0 <= i < self.vocab.size else None

    def llguidance_source(self) -> Any:
        """A llguidance TokenizerWrapper: each piece's bytes (U+2581 as a space, byte pieces as their byte) and
        the vocabulary's own tokenization of a text's continuation."""
        from llguidance import TokenizerWrapper

        return TokenizerWrapper(_GuidanceVocabulary(self))

    @property
    def stream_backend(self) -> None:
        return None  # decoding a window is a C++ call: the Python form of IncrementalDetokenizer is cheap here

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        return 2 * self.vocab.longest_piece


class _GuidanceVocabulary:
    """What llguidance.TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tokenizer: SentencePieceTokenizer):
        vocab = tokenizer.vocab
        self.eos_token_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.tokens = [vocab.token_piece(i) for i in range(vocab.size)]
        self._vocab = vocab

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._vocab.encode(text, parse_special=False, space_prefix_first=False)


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive, without ever cutting a character in half.

    With a Rust (fast) tokenizer, `tokenizers.decoders.DecodeStream` does it in one call per id: it keeps
    a few ids of left context (seeded with the prompt's tail, so SentencePiece's leading spaces come out
    right: a lone "▁Paris" may decode as "Paris") and answers nothing until the ids complete a
    character. Why: the Python form below costs two `decode` calls per id on the engine thread, several
    times the time (docs/PERFORMANCE.md). That form, as vLLM has it (decode ids[prefix:read] and ids[prefix:]
    and emit the difference, holding back a text that ends in U+FFFD), is what `flush` runs: it gives what is
    held back at the end (an incomplete character as U+FFFD), as decode would.
    """

    _CONTEXT = 5  # prompt ids kept as left context for the first decoded window

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-self._CONTEXT:])  # left context, then the generated ids
        self._read = len(self._ids)  # ids before this are already emitted (or are the context)
        self._prefix = 0  # window start: left context for decoding
        self._text_parts: list[str] = []
        self._backend = tokenizer.stream_backend
        self._stream = DecodeStream(self._ids, skip_special_tokens) if self._backend is not None else None

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


def _special_ids(tokenizer: Tokenizer, tokens: Iterable[str]) -> dict[str, int]:
    """The ids of those of `tokens` that this vocabulary has as special (control) tokens."""
    return {t: i for t in tokens if (i := tokenizer.token_id(t)) is not None and i in tokenizer.special_ids}


def _end_of_turn_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of END_OF_TURN_TOKENS that this vocabulary has as special (control) tokens."""
    return frozenset(_special_ids(tokenizer, END_OF_TURN_TOKENS).values())
