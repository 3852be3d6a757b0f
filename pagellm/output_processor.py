"""RequestState: turns a request's sampled tokens into text, finds stop strings, builds outputs.

Stop strings are matched on the incrementally detokenized text; the stop
string itself is not returned. While a request runs, the last
(longest stop string - 1) characters are held back from streaming, because
they could be the start of a stop string that the next token completes.
"""

from __future__ import annotations

from pagellm.core.types import TokenLogprobs
from pagellm.loader.tokenizer import IncrementalDetokenizer
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.request import Request, RequestStatus


class RequestState:
    def __init__(self, request: Request, prompt: str | None, tokenizer):
        self.request = request
        self.prompt = prompt
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids) if tokenizer else None
        self.stop = request.sampling_params.stop
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self._sent = 0  # characters of text already streamed
        self._new_token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if request.sampling_params.logprobs is not None else None
        self.stop_reason: str | int | None = None

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None) -> RequestStatus | None:
        """Record one sampled token; return FINISHED_STOPPED if it completed a stop string."""
        self._new_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if token_id in self.request.sampling_params.stop_token_ids:
            self.stop_reason = token_id
        if self.detokenizer is None:
            return None
        self.text += self.detokenizer.add(token_id)
        if not self.stop:
            return None
        # Only the tail can hold a new match: what was added plus a stop string's length before it.
        search_from = max(0, self._sent - max(len(s) for s in self.stop))
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        self.stop_reason = stop
        return RequestStatus.FINISHED_STOPPED

    def make_output(self, status: RequestStatus | None) -> RequestOutput:
        finished = status is not None
        visible = len(self.text) if finished else max(self._sent, len(self.text) - self._hold_back)
        new_text, self._sent = self.text[self._sent : visible], visible
        new_ids, self._new_token_ids = self._new_token_ids, []
        completion = CompletionOutput(
            index=0,
            text=self.text if finished else self.text[:visible],
            token_ids=list(self.request.output_token_ids),
            finish_reason=status.value if finished else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            stop_reason=self.stop_reason if finished else None,
        )
        return RequestOutput(
            request_id=self.request.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(self.request.num_cached_tokens, 0),
            new_token_ids=new_ids,
            new_text=new_text,
        )
