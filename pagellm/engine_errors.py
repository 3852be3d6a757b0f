"""Errors of LLMEngine.step that callers act on (kept apart: the server imports them before torch loads)."""

from __future__ import annotations


class StepError(RuntimeError):
    """A step failed in a way no single request explains: the requests it held, and the cause. Nothing of the step
    was committed, so the caller may step again (without some of them: LLMEngine.hold)."""

    def __init__(self, request_ids: tuple[str, ...], cause: Exception):
        super().__init__(f"step of {len(request_ids)} request(s) failed: {type(cause).__name__}: {cause}")
        self.request_ids, self.cause = request_ids, cause
