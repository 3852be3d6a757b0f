"""The step the engine keeps in flight under async scheduling, and when it may launch one ahead (engine.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagellm.core.speculative import Speculation
from pagellm.core.types import SchedulerOutput
from pagellm.request import Request
from pagellm.runner.sampled_tokens import LaunchedStep


@dataclass
class InFlightStep:
    """A scheduled step, launched on the device (`launched`) and not yet collected."""

    output: SchedulerOutput
    schedule_ms: float
    launched: LaunchedStep | None = None


def needs_host_tokens(output: SchedulerOutput, requests: Mapping[str, Request],
                      speculation: Speculation | None = None) -> bool:
    """Whether a step after `output` needs its sampled tokens on the host before it is prepared: penalties count
    a request's tokens and grammars advance on them, how many tokens a verify step emits is known only once
    read, and a request that may speculate at its next decode looks its drafts up in its tokens (a decode
    launched ahead proposes nothing), so such a step is not launched ahead. Past disable_by_batch_size decodes
    nothing speculates."""
    decodes = sum(item.sample for item in output.scheduled)
    speculating = speculation is not None and decodes <= speculation.config.disable_by_batch_size
    for item in output.scheduled:
        if item.num_draft:
            return True
        request = requests.get(item.request_id)
        if item.sample and request is not None and (request.sampling_params.needs_penalties
                                                    or request.sampling_params.structured_outputs
                                                    or speculating and speculation.may_propose(request)):
            return True
    return False
