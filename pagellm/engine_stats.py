"""EngineStats: cheap running counters behind LLM.stats() and the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    computed_prefill_tokens: int = 0
    decode_tokens: int = 0
    num_steps: int = 0
    host_ms_total: float = 0.0  # scheduling + input preparation before the model runs, copy excluded
    input_copy_ms_total: float = 0.0  # building the step's input tensors
    model_ms_total: float = 0.0
    sample_ms_total: float = 0.0
    host_syncs_total: int = 0
    step_reuse_hits: int = 0  # pure-decode steps prepared by diff from the previous one
    step_reuse_misses: int = 0  # pure-decode steps whose inputs were rebuilt
    decode_graph_replays: int = 0  # pure-decode steps whose forward replayed a CUDA graph
    steps_launched_ahead: int = 0  # async scheduling: steps launched before the previous one was read back
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    # Tensor parallel: bytes of the head -> workers step messages (0 in one process)
    step_message_bytes_total: int = 0
    step_message_bytes_last: int = 0

    def record_step(self, output, schedule_ms: float, model_output, scheduler) -> None:
        """output: the SchedulerOutput; model_output: the ModelOutput it returned, with its costs."""
        if not output.scheduled:  # a step that only released pages: no model work to count
            return
        timings, message_bytes = model_output.timings, model_output.message_bytes
        self.num_steps += 1
        self.step_message_bytes_total += message_bytes
        self.step_message_bytes_last = message_bytes
        self.decode_tokens += output.num_decode_tokens
        self.computed_prefill_tokens += output.num_prefill_tokens
        self.host_ms_total += schedule_ms + timings.host_ms
        self.input_copy_ms_total += timings.input_copy_ms
        self.model_ms_total += timings.model_ms
        self.sample_ms_total += timings.sample_ms
        self.host_syncs_total += timings.host_syncs
        if output.num_prefill_tokens == 0:  # step reuse applies to pure-decode steps
            if timings.reused_step:
                self.step_reuse_hits += 1
            else:
                self.step_reuse_misses += 1
            self.decode_graph_replays += timings.graph_replayed
        for item in output.scheduled:
            if item.new is not None and not item.new.output_token_ids:  # first admission, not a resume
                request = scheduler.requests.get(item.request_id)
                if request is not None:
                    self.prefix_cache_hit_tokens += request.num_cached_tokens
                    self.prefix_cache_queried_tokens += request.num_prompt_tokens

    def as_dict(self, kv_cache, scheduler, bytes_per_block: int) -> dict:
        """bytes_per_block: one KV block's bytes over every layer (the memory figures are blocks times it)."""
        steps = max(self.num_steps, 1)
        pool, snapshots = kv_cache.pool, kv_cache.snapshots
        return {
            "prompt_tokens": self.prompt_tokens,
            "computed_prefill_tokens": self.computed_prefill_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "prefix_cache_queried_tokens": self.prefix_cache_queried_tokens,
            "prefix_cache_hit_rate": self.prefix_cache_hit_tokens / max(self.prefix_cache_queried_tokens, 1),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_cached": pool.num_cached_blocks,
            "kv_blocks_resident": pool.num_resident_blocks,
            "kv_blocks_released": pool.num_released_total,
            "kv_pool_bytes": pool.num_blocks * bytes_per_block,
            # resident: written and not released since (live, cached, and freed blocks kept for reuse)
            "kv_resident_bytes": pool.num_resident_blocks * bytes_per_block,
            # the free blocks kept resident for the prefix they hold, and their budget (idle blocks in all)
            "prefix_cache_resident_bytes": pool.num_idle_cached_blocks * bytes_per_block,
            "prefix_cache_budget_bytes": (pool.idle_budget if pool.idle_budget is not None else pool.num_blocks)
            * bytes_per_block,
            "num_preemptions": scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "decode_tokens": self.decode_tokens,
            "host_ms_per_step": self.host_ms_total / steps,
            "input_copy_ms_per_step": self.input_copy_ms_total / steps,
            "model_ms_per_step": self.model_ms_total / steps,
            "sample_ms_per_step": self.sample_ms_total / steps,
            "host_syncs_per_step": self.host_syncs_total / steps,
            "step_reuse_hits": self.step_reuse_hits,
            "step_reuse_misses": self.step_reuse_misses,
            "step_reuse_rate": self.step_reuse_hits / max(self.step_reuse_hits + self.step_reuse_misses, 1),
            "decode_graph_replays": self.decode_graph_replays,
            "steps_launched_ahead": self.steps_launched_ahead,
            "decode_graph_replay_rate":  # of pure-decode steps
                self.decode_graph_replays / max(self.step_reuse_hits + self.step_reuse_misses, 1),
            "state_slots_total": scheduler.state_pool.num_slots if scheduler.state_pool else 0,
            "state_slots_used": scheduler.state_pool.num_used if scheduler.state_pool else 0,
            "state_snapshots_total": snapshots.num_rows if snapshots else 0,
            "state_snapshots_used": snapshots.num_used if snapshots else 0,  # pinned by a step; 0 between steps
            "state_snapshots_cached": snapshots.num_cached if snapshots else 0,
            "step_message_bytes_per_step": self.step_message_bytes_total / steps,
            "step_message_bytes_last": self.step_message_bytes_last,
            # speculative decoding: verify steps (one per request and step), drafts proposed and accepted, and
            # the tokens a verify step emitted on average (accepted drafts + the target's own: vLLM's mean
            # acceptance length)
            **_speculation(scheduler.speculation),
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
        }


def _speculation(speculation) -> dict:
    """Speculative decoding's figures (zeros when it is off)."""
    verify_steps = speculation.num_verify_steps if speculation else 0
    drafts = speculation.num_draft_tokens if speculation else 0
    accepted = speculation.num_accepted_tokens if speculation else 0
    return {"spec_verify_steps": verify_steps, "spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / max(drafts, 1),
            "spec_mean_accepted_length": 1 + accepted / verify_steps if verify_steps else 0.0}
