"""Prometheus metrics of one server, in its own CollectorRegistry (no process-wide state).

Latency histograms are observed by the engine thread as outputs arrive. Counters and gauges
are read at scrape time from the engine's latest stats snapshot (`AsyncEngine.stats()`), so a
scrape never waits for the engine and the engine never does work for a scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagellm:"

# vLLM's buckets, extended downwards for tiny models and upwards for slow CPUs.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                          0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)

# (name, help, key in the stats snapshot)
_COUNTERS = (
    ("prompt_tokens", "Prompt tokens of accepted requests.", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generation_tokens"),
    ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queried_tokens"),
    ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", "prefix_cache_hit_tokens"),
    ("num_preemptions", "Requests preempted (KV freed, recomputed later).", "num_preemptions"),
    ("kv_blocks_released", "KV blocks whose pages went back to the OS past the prefix cache's budget.",
     "kv_blocks_released"),
    ("request_success", "Requests that finished (stop or length).", "num_requests_finished"),
    ("request_aborted", "Requests aborted (client gone, shutdown).", "num_requests_aborted"),
    ("request_failed", "Requests failed alone by an engine error (the others went on).", "num_requests_failed"),
    ("engine_step_failures", "Engine steps that raised (their culprit isolated and failed).", "engine_step_failures"),
    ("engine_thread_deaths", "Times the engine thread ended on an error (then every request is a 503).",
     "engine_thread_deaths"),
    ("step_reuse_hits", "Pure-decode steps whose inputs were prepared by diff from the previous step.",
     "step_reuse_hits"),
    ("step_reuse_misses", "Pure-decode steps whose inputs were rebuilt.", "step_reuse_misses"),
    ("decode_graph_replays", "Pure-decode steps whose forward replayed a CUDA graph.", "decode_graph_replays"),
    ("steps_launched_ahead", "Steps launched while the previous one still ran (async scheduling).",
     "steps_launched_ahead"),
    ("spec_decode_num_drafts", "Speculative decoding: verify steps (one per request and step).", "spec_verify_steps"),
    ("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.", "spec_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.", "spec_accepted_tokens"),
)
_GAUGES = (
    ("num_requests_running", "Requests running (holding KV blocks and a slot).", "num_requests_running"),
    ("num_requests_waiting", "Requests queued, not yet running.", "num_requests_waiting"),
    ("kv_cache_usage_ratio", "Fraction of KV blocks in use (1 = full).", "kv_cache_usage_ratio"),
    ("kv_blocks_free", "KV blocks free (cached-but-unreferenced blocks count as free).", "kv_blocks_free"),
    ("kv_blocks_total", "KV blocks in the pool.", "kv_blocks_total"),
    ("kv_pool_bytes", "KV pool size, bytes (on a CPU reserved address space; resident as written).",
     "kv_pool_bytes"),
    ("kv_resident_bytes", "KV blocks written and not released since (live, cached, kept for reuse), bytes.",
     "kv_resident_bytes"),
    ("prefix_cache_resident_bytes", "Free KV blocks kept resident for the prefix they hold, bytes.",
     "prefix_cache_resident_bytes"),
    ("prefix_cache_budget_bytes", "Idle KV blocks that may stay resident (prefix_cache_memory), bytes.",
     "prefix_cache_budget_bytes"),
    ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache over those looked up.",
     "prefix_cache_hit_rate"),
    ("host_ms_per_step",
     "Mean host time per engine step before the model runs (scheduling, input lists; tensor copies excluded), ms.",
     "host_ms_per_step"),
    ("model_ms_per_step", "Mean model forward time per engine step, ms.", "model_ms_per_step"),
    ("sample_ms_per_step", "Mean sampling time per engine step, ms.", "sample_ms_per_step"),
    ("host_syncs_per_step", "Mean blocking device-to-host reads per engine step.", "host_syncs_per_step"),
    ("num_steps", "Engine steps run.", "num_steps"),
    ("spec_decode_mean_accepted_length", "Speculative decoding: tokens a verify step emits on average (accepted "
     "proposals + the model's own).", "spec_mean_accepted_length"),
)
_GAUGE_KEYS = {key for _, _, key in _GAUGES}


class _SnapshotCollector(Collector):
    def __init__(self, read_stats: Callable[[], dict]):
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        if not stats:  # still loading: no engine numbers yet
            return
        for name, doc, key in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=stats.get(key, 0))
        for name, doc, key in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=stats.get(key, 0))
        # Step instrumentation the engine adds later (step reuse, input copies, ...) is exported as is.
        for key in sorted(stats):
            if key.endswith(("_per_step", "_rate")) and key not in _GAUGE_KEYS:
                yield GaugeMetricFamily(PREFIX + key, f"Engine step instrumentation: {key}.", value=stats[key])


class ServerMetrics:
    """The histograms the engine thread observes, plus the snapshot-backed counters and gauges."""

    def __init__(self, read_stats: Callable[[], dict]):
        self.registry = CollectorRegistry(auto_describe=True)
        hist = dict(registry=self.registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS, **hist)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive tokens of a request.",
            buckets=_TOKEN_LATENCY_BUCKETS, **hist)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to last token of a finished request.",
            buckets=_LATENCY_BUCKETS, **hist)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.",
            buckets=_LATENCY_BUCKETS, **hist)
        self.registry.register(_SnapshotCollector(read_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
