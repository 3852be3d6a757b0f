"""Structured output: grammars checked against the model's vocabulary, and the per-step token masks.

    StructuredOutputs ─► Grammars.compile() ─► llguidance grammar text (validated, cached by spec)
    new slot ─► Grammars.matcher() ─► RowGrammar (per request; replays the tokens already out on resume)
    each step: fill the bitmasks of the rows with a grammar (in parallel, off the GIL) ─► logits of tokens
               they disallow = -inf ─► sample ─► the sampled token advances the row's matcher

The grammar engine is llguidance: against xgrammar, with the embedded Gemma vocabulary, both fill plain JSON
schemas' masks alike, but llguidance is faster on strings with maxLength and has no long compile
(docs/PERFORMANCE.md). It is imported on the first structured request only.
measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from pagellm.kernels.cpu import logits as logits_kernels
from pagellm.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import llguidance


class GrammarError(RuntimeError):
    """A sampled token the request's grammar does not accept: the mask was not applied to its row."""


class RowGrammar:
    """One request's matcher, ending on the request's own stop ids rather than the tokenizer's EOS."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: Sequence[int], tokenizer_eos: frozenset[int]):
        self.matcher = matcher
        self.stop_ids = frozenset(stop_ids)
        # llguidance allows the tokenizer's EOS ids where the grammar may end; a request whose stop ids differ
        # (stop_token_ids, ignore_eos) has its mask patched to allow its own instead.
        self._patch = self.stop_ids != tokenizer_eos
        self._tokenizer_eos = tokenizer_eos

    def accept(self, token: int) -> bool:
        if token in self.stop_ids:  # the request ends here; valid only where the grammar may end
            return self.matcher.is_accepting()
        return self.matcher.consume_token(token)

    def after(self, tokens: Sequence[int]) -> RowGrammar | None:
        """A copy of this matcher advanced by `tokens` (a verify step's drafts), or None where the grammar refuses
        one of them or one ends the request (no position after it is kept)."""
        copy = RowGrammar(self.matcher.deep_copy(), tuple(self.stop_ids), self._tokenizer_eos)
        for token in tokens:
            if token in self.stop_ids or not copy.matcher.consume_token(token):
                return None
        return copy

    def patch_stop_bits(self, bitmask_row: torch.Tensor) -> None:
        """After the fill: the request's stop ids allowed exactly where the grammar may end."""
        if not self._patch:
            return
        words = bitmask_row.view(torch.int32)
        for token in self._tokenizer_eos - self.stop_ids:
            _set_bit(words, token, False)
        accepting = self.matcher.is_accepting()
        for token in self.stop_ids:
            _set_bit(words, token, accepting)


def _set_bit(words: torch.Tensor, token: int, value: bool) -> None:
    bit = 1 << (token % 32)
    word = int(words[token // 32]) & 0xFFFFFFFF
    word = (word | bit) if value else (word & ~bit)
    words[token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # back to int32's range


class Vocabulary(Protocol):
    """What grammars need of a tokenizer (loader/tokenizer.Tokenizer; a step reads no files)."""

    eos_token_ids: Iterable[int]

    def llguidance_source(self):
        """What llguidance builds its tokenizer from (asked on the first grammar only)."""


class Grammars:
    """Checks and builds grammars for one tokenizer; safe to call from several threads (the server checks off
    its event loop, the engine again at add_request, which is then a cache hit)."""

    def __init__(self, tokenizer: Vocabulary, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: dict[StructuredOutputs, str] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> str:
        """The grammar as llguidance takes it; ValueError naming structured_outputs when it is invalid."""
        with self._lock:
            grammar = self._compiled.get(spec)
        if grammar is not None:
            return grammar
        from llguidance import LLMatcher

        try:
            grammar = _grammar_text(spec)
        except Exception as exc:  # noqa: BLE001  llguidance's GBNF converter raises bare Exceptions
            error = str(exc)
        else:
            error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer())
        if error:
            kind = next(n for n in ("json", "regex", "choice", "grammar") if getattr(spec, n) is not None)
            raise ValueError(f"structured_outputs.{kind} does not compile: {error.strip()}")
        with self._lock:
            if len(self._compiled) >= 1024:  # bounded: every request may bring its own schema
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = grammar
        return grammar

    def check(self, spec: StructuredOutputs, stop_ids: Sequence[int]) -> str:
        """The compiled grammar, if a request with these stop ids can run it; ValueError naming the field if not."""
        if not stop_ids:
            raise ValueError("ignore_eos with structured_outputs needs stop_token_ids: the output must be able "
                             "to end where the grammar does")
        return self.compile(spec)

    def matcher(self, spec: StructuredOutputs, stop_ids: Sequence[int],
                output_token_ids: Sequence[int] = ()) -> RowGrammar:
        """A fresh matcher advanced past the tokens already out (a request resumed after preemption)."""
        from llguidance import LLMatcher

        row = RowGrammar(LLMatcher(self.ll_tokenizer(), self.check(spec, stop_ids)), stop_ids, self.eos_ids)
        for token in output_token_ids:
            if not row.accept(token):
                raise GrammarError(f"token {token} does not continue the grammar: {row.matcher.get_error()}")
        return row

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # the vocabulary is scanned once (a few seconds for 262k tokens)
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.llguidance_source(), n_vocab=self.vocab_size,
                                                            eos_token=sorted(self.eos_ids))
            return self._ll_tokenizer


def _grammar_text(spec: StructuredOutputs) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.json is not None or spec.json_object:
        # OpenAI's json_object is an object, not any JSON value. Compact JSON (no free whitespace): a small
        # model at temperature 1 can otherwise spin on spaces.
        return LLMatcher.grammar_from_json_schema(spec.json or '{"type": "object"}',
                                                  defaults={"whitespace_flexible": False})
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # JSON string literals are valid Lark string literals: quotes, backslashes and controls escaped.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in spec.choice))
    return LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))  # GBNF (vLLM, llama.cpp) or Lark


class GrammarMasks:
    """The sampler's reusable bitmask buffer, grown to the most grammar rows seen: [rows, ceil(V / 32)] int32."""

    def __init__(self, kernel_level: str | None, pinned: bool = False):
        # the CPU kernel applying the masks where the level has it, else torch's ops: chosen once
        self._mask_rows = (functools.partial(logits_kernels.mask_rows, at=kernel_level)
                           if logits_kernels.available("mask_rows", kernel_level) else logits_kernels.mask_rows_torch)
        self._pinned = pinned  # the masks are copied to a device
        self._bitmask: torch.Tensor | None = None
        self._executor = None

    def apply(self, logits: torch.Tensor, grammars: Sequence[RowGrammar | None]) -> None:
        """Set, in place, the logits [B, V] of tokens row i's grammar does not allow to -inf (rows without one
        are untouched)."""
        import llguidance
        import llguidance.torch

        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        words = (logits.shape[1] + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            # pinned for a device: its copy then waits for nothing (kernels/transfers.py); the next step refills it
            # only after this step's tokens were read back, when the copy has run
            self._bitmask = torch.empty(max(len(rows), logits.shape[0]), words, dtype=torch.int32,
                                        pin_memory=self._pinned)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = self._bitmask[:len(rows)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(grammars[i].matcher, j)
                                                                      for j, i in enumerate(rows)], bitmask)
        for j, i in enumerate(rows):
            grammars[i].patch_stop_bits(bitmask[j])
        self._mask_rows(logits, bitmask.to(logits.device, non_blocking=True), rows)


def accept_sampled(request_id: str, grammar: RowGrammar, token: int) -> None:
    if not grammar.accept(token):
        raise GrammarError(f"request {request_id}: sampled token {token} is outside its grammar: "
                           f"{grammar.matcher.get_error()}")
