"""Structured output: grammars compiled against the model's vocabulary, and the per-step token masks.

    StructuredOutputs ─► Grammars.compile() ─► CompiledGrammar (cached by spec; compiling is the slow part)
    new slot ─► Grammars.matcher() ─► GrammarMatcher (per request, replays tokens already out on resume)
    each step: fill the bitmask of the rows with a grammar ─► logits of disallowed tokens = -inf ─► sample
               ─► accept the sampled token into the matcher

The grammar engine is xgrammar: on this project's CPUs it filled masks as fast as llguidance per step, with a
lower worst case and a third of the vocabulary setup time (docs/PERFORMANCE.md). It is imported on the first
structured request only: it costs the other requests nothing.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagellm.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

    from pagellm.loader.tokenizer import Tokenizer

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the message a user needs.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(RuntimeError):
    """A sampled token the request's grammar does not accept: the mask was not applied to its row."""


class Grammars:
    """Compiles StructuredOutputs for one tokenizer; safe to call from several threads (the server compiles
    off its event loop, the engine again at add_request, which is then a cache hit)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """The compiled grammar; ValueError naming structured_outputs when it does not compile."""
        compiler = self._get_compiler()
        try:
            if spec.json is not None or spec.json_object:
                # OpenAI's json_object is an object, not any JSON value. Compact JSON (no free whitespace): a small
                # model at temperature 1 can otherwise spin on spaces.
                return compiler.compile_json_schema(spec.json or '{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                # JSON string literals are valid EBNF string literals: quotes, backslashes and controls escaped.
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                          for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:
            kind = next(n for n in ("json", "regex", "grammar") if getattr(spec, n) is not None)
            raise ValueError(f"structured_outputs.{kind} does not compile: "
                             f"{_SOURCE_PREFIX.sub('', str(exc)).strip()}") from None

    def matcher(self, spec: StructuredOutputs, stop_ids: Sequence[int],
                output_token_ids: Sequence[int] = ()) -> xgrammar.GrammarMatcher:
        """A fresh matcher that ends on the request's own stop ids, advanced past the tokens already out (a
        request resumed after preemption)."""
        import xgrammar

        if not stop_ids:
            raise ValueError("ignore_eos with structured_outputs needs stop_token_ids: the output must be able "
                             "to end where the grammar does")
        matcher = xgrammar.GrammarMatcher(self.compile(spec), override_stop_tokens=list(stop_ids))
        for token in output_token_ids:
            if not matcher.accept_token(token):
                raise GrammarError(f"token {token} does not continue the grammar")
        return matcher

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:  # the vocabulary is scanned once (about a second for 262k tokens)
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer.hf_tokenizer,
                                                               vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler


class GrammarMasks:
    """The sampler's reusable bitmask buffer, grown to the largest batch seen: [B, ceil(V / 32)] int32."""

    def __init__(self):
        self._bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, matchers: Sequence[xgrammar.GrammarMatcher | None]) -> None:
        """Set, in place, the logits [B, V] of tokens row i's matcher does not allow to -inf (rows without one
        are untouched)."""
        import xgrammar

        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        batch, vocab = logits.shape
        if self._bitmask is None or self._bitmask.shape[0] < batch or self._bitmask.shape[1] * 32 < vocab:
            self._bitmask = xgrammar.allocate_token_bitmask(batch, vocab)
        bitmask = self._bitmask[:batch]
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        # Masks are applied where the logits are; a CPU bitmask goes to the device with them.
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=vocab, indices=rows)


def accept_sampled(request_id: str, matcher: xgrammar.GrammarMatcher, token: int) -> None:
    if not matcher.accept_token(token):
        raise GrammarError(f"request {request_id}: sampled token {token} is outside its grammar")
