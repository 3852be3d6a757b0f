"""A thinking model's answer split into `reasoning_content` and `content`, as vLLM's Qwen3 / DeepSeek-R1 parsers do.

Models that think (Qwen3, DeepSeek-R1, QwQ) write their reasoning between `<think>` and `</think>`, then the
answer. Reasoning starts when the output opens with `<think>`, or at once when the chat template already
opened it at the end of the prompt; it ends at `</think>` (both markers are dropped). An output that never
thinks is all content. Streaming, a chunk that ends in what may be the start of a marker holds that tail back
until the next chunk decides it, so a marker is never split across two deltas.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def thinks(tokenizer) -> bool:
    """Whether the model's vocabulary has both markers as tokens: only then is the answer split."""
    return tokenizer is not None and None not in (tokenizer.token_id(START), tokenizer.token_id(END))


def opened_by_prompt(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` (the template started the reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith(START) or (START in tail and tail.rfind(START) > tail.rfind(END))


class ReasoningSplitter:
    """Feeds text deltas of one answer; returns (reasoning delta, content delta) for each."""

    def __init__(self, in_reasoning: bool):
        self._state = "reasoning" if in_reasoning else "start"  # start: the output may still open <think>
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning, content = [], []
        while text:
            if self._state == "start":
                if START.startswith(text) and not final:  # could still become "<think>"
                    self._held = text
                    break
                self._state = "reasoning" if text.startswith(START) else "content"
                text = text[len(START):] if self._state == "reasoning" else text
            elif self._state == "reasoning":
                end = text.find(END)
                if end >= 0:
                    reasoning.append(text[:end])
                    text, self._state = text[end + len(END):], "content"
                    continue
                keep = 0 if final else _partial_marker(text, END)
                reasoning.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (0: none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole answer; None for a part that is absent."""
    reasoning, content = ReasoningSplitter(in_reasoning).feed(text, final=True)
    thought = in_reasoning or text.startswith(START)
    return (reasoning if thought else None), (content if content or not thought else None)
