"""RequestState: turns a request's sampled tokens into text, finds stop strings, builds outputs.

Stop strings are matched on the incrementally detokenized text; the stop
string itself is not returned. While a request runs, the last
(longest stop string - 1) characters are held back from streaming, because
they could be the start of a stop string that the next token completes.
"""

from __future__ import annotations

from collections.abc import Callable

from pagellm.core.types import PromptLogprobs, TokenLogprobs
from pagellm.loader.tokenizer import IncrementalDetokenizer
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.request import Request, RequestStatus


class RequestState:
    def __init__(self, request: Request, prompt: str | None, tokenizer):
        self.request = request
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids) if tokenizer else None
        self.stop = request.sampling_params.stop
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self._sent = 0  # characters of text already streamed
        self._new_token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if request.sampling_params.logprobs is not None else None
        self.stop_reason: str | int | None = None
        # prompt_logprobs: entries[i] scores prompt token i + 1, as the chunks arrive; the vLLM shape is built once
        self._prompt_entries: list[TokenLogprobs] | None = (
            [] if request.sampling_params.prompt_logprobs is not None else None)
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.embedding: list[float] | None = None  # an embedding request's, once its prompt ran

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """One chunk's prompt logprobs; prompt tokens already held (recomputed after a preemption) are skipped."""
        next_index = len(self._prompt_entries) + 1  # prompt token 0 is never scored
        if chunk.first_index > next_index:
            raise RuntimeError(f"prompt logprobs of {self.request.request_id} skip tokens {next_index}.."
                               f"{chunk.first_index - 1}")
        self._prompt_entries.extend(chunk.entries[next_index - chunk.first_index:])

    def add_tokens(self, num_new: int, logprobs: list[TokenLogprobs | None] | None) -> RequestStatus | None:
        """The request's last num_new output tokens, this step's (more than one from a verify step), in order; a
        stop string ends it at its token, and the tokens after that are dropped."""
        request = self.request
        first = request.num_output_tokens - num_new
        for i in range(num_new):
            finish = self.add_token(request.output_token_ids[first + i], logprobs[i] if logprobs else None,
                                    num_output=first + i + 1)
            if finish is not None:
                request.truncate_output(first + i + 1)
                return finish
        return None

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None,
                  num_output: int | None = None) -> RequestStatus | None:
        """Record one sampled token, the num_output-th of the request's output (default: its last); return
        FINISHED_STOPPED if it completed a stop string."""
        self._new_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if token_id in self.request.sampling_params.stop_token_ids:
            self.stop_reason = token_id
        if self.detokenizer is None:
            return None
        searched = len(self.text)  # no stop string ends within this text (checked as it came)
        self.text += self.detokenizer.add(token_id)
        if not self.stop or len(self.text) == searched:
            return None
        if (num_output or self.request.num_output_tokens) < self.request.sampling_params.min_tokens:
            return None  # vLLM's min_tokens: no stop string ends the output before it (matches may span it)
        # A new match ends in the added text, so it starts at most len(s) - 1 characters before it.
        hits = [(self.text.find(s, max(0, searched - len(s) + 1)), s) for s in self.stop]
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
            first_scheduled_time=self.request.first_scheduled_time,
            new_text=new_text,
            prompt_logprobs=self._prompt_logprobs_output(),
            embedding=self.embedding,
        )

    def _prompt_logprobs_output(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's prompt_logprobs once every prompt token is scored (always so by the first output)."""
        entries = self._prompt_entries
        complete = entries is not None and len(entries) == self.request.num_prompt_tokens - 1
        if self._prompt_logprobs is None and complete:
            decode = _cached_decoder(self.tokenizer)
            self._prompt_logprobs = [None] + [_logprob_dict(entry, decode) for entry in entries]
        return self._prompt_logprobs


def _cached_decoder(tokenizer) -> Callable[[int], str | None]:
    """Token id -> its text alone (None without a tokenizer), each id decoded once: the top-k repeat."""
    texts: dict[int, str | None] = {}

    def decode(token_id: int) -> str | None:
        if token_id not in texts:
            # vLLM decodes special tokens too: the first scored position often predicts after <bos>
            texts[token_id] = None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)
        return texts[token_id]

    return decode


def _logprob_dict(entry: TokenLogprobs, decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """vLLM's entry for one prompt position: the prompt token (its own rank), then the top-k (ranks 1..k)."""
    result = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        result.setdefault(token_id, Logprob(logprob, rank, decode(token_id)))
    return result
