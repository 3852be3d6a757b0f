"""LLMEngine: add_request / step / abort over the scheduler and the model runner.

    step():  Scheduler.schedule() -> ModelRunner.launch() -> .collect() -> Scheduler.update()
             -> detokenize, stop strings, finish -> RequestOutput per updated request

With async scheduling (vLLM's --async-scheduling) the next step is scheduled and launched between the two:
its decodes feed the tokens being read back (PLACEHOLDERs, filled on the device), so the host prepares step
N+1 while the device runs step N. Greedy ids are the same; a request that stops at step N also ran in step N+1
(that token is dropped).
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from pagellm.config import EngineConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.snapshot_pool import SnapshotPool
from pagellm.core.state_pool import StatePool
from pagellm.distributed.executor import HeadExecutor, LocalExecutor
from pagellm.distributed.parallel_state import DistributedError, ParallelState
from pagellm.distributed.sharding import ShardSpec, install_all_reduce, vocab_parallel_logits
from pagellm.distributed.worker import publish_runner_setup, start_head
from pagellm.engine_draft import make_drafter
from pagellm.engine_errors import StepError
from pagellm.engine_stats import EngineStats
from pagellm.engine_steps import InFlightStep, needs_host_tokens
from pagellm.loader.model_loader import load_model
from pagellm.loader.quantization import weight_bytes
from pagellm.collector import collector_paused
from pagellm.output_processor import RequestState
from pagellm.outputs import RequestOutput
from pagellm.platform import (GIB, freeze_loaded_objects, keep_step_buffers_in_heap,
                              limit_threads_to_cores, resident_bytes)
from pagellm.request import Request, RequestStatus, stop_ids_of
from pagellm.runner.grammar import Grammars
from pagellm.runner.kv_budget import DeviceMemory, idle_budget_blocks, size_kv_pool, start_measuring
from pagellm.runner.backend import choose_backend
from pagellm.runner.model_runner import ModelRunner, RankLinks, RunnerSetup, state_bytes_per_slot
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False):
        self.config = config
        # What this device runs, decided once (every worker derives the same from the same config).
        self.backend = backend = choose_backend(config, rank=0)
        if backend.captures_graphs and self.device.index is not None:  # Triton launches on the current device,
            torch.cuda.set_device(self.device)                          # not the tensors': make it this one
        limit_threads_to_cores()
        parallel, workers, shard = None, None, None
        if config.parallel.tensor_parallel_size > 1:
            parallel, workers = start_head(config)
            shard = ShardSpec(0, parallel.world_size, config.parallel.enable_expert_parallel)
        try:
            if parallel is not None:
                parallel.use_device(self.device, self.backend.collective)
            with collector_paused():
                self._build(config, skip_tokenizer_init, shard, parallel)
            if parallel is not None:
                publish_runner_setup(parallel, self._runner_setup(), workers, config.parallel.join_timeout)
        except BaseException:
            if workers is not None:
                workers.stop(grace=0)
            raise
        self.executor = HeadExecutor(self.runner, parallel, workers) if parallel else LocalExecutor(self.runner)
        self.drafter = make_drafter(self, LLMEngine)  # speculative_config methods draft_model, mtp
        self.eos_token_ids = self._eos_ids()
        self._states: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.counters = EngineStats()
        # Async scheduling: the step launched ahead, whose tokens the next step() reads back.
        self._async = config.scheduler.async_scheduling
        if self._async is None:  # unset: where it pays, a graph-replayed decode (measured: docs/PERFORMANCE.md)
            self._async = self.runner.decode_graphs is not None and self.backend.captures_graphs
        self._in_flight: InFlightStep | None = None
        freeze_loaded_objects()
        keep_step_buffers_in_heap(config.kernels.heap_tuning)

    # What the backend chose, under the names the engine's users read.
    device = property(lambda self: self.backend.device)
    dtype = property(lambda self: self.backend.compute_dtype)
    kv_cache_dtype = property(lambda self: self.backend.kv_cache_dtype)
    narrow_dtype = property(lambda self: self.backend.narrow_dtype)
    kernels = property(lambda self: self.backend.kernels)  # every CPU kernel and where it runs, in words
    kernel_level = property(lambda self: self.backend.level)

    def _build(self, config: EngineConfig, skip_tokenizer_init: bool, shard: ShardSpec | None,
               parallel: ParallelState | None) -> None:
        """Load the model (this rank's shard of it when parallel) and size the KV cache and state slots."""
        mc, cc = config.model, config.cache
        from_device = not self.backend.host_memory and cc.kv_cache_memory is None  # from gpu_memory_utilization
        if from_device and parallel is not None:
            raise ValueError("tensor parallel on CUDA needs kv_cache_memory (GiB per rank): the profiling step that "
                             "sizes the KV cache from gpu_memory_utilization runs on one device")
        before = start_measuring(self.device) if from_device else None
        loaded = load_model(mc.model, self.dtype, self.device, with_tokenizer=not skip_tokenizer_init,
                            quantization=mc.quantization, shard=shard, kernels=config.kernels,
                            load_format=mc.load_format, cache_dir=mc.cache_dir or None,
                            state_dtype=cc.mamba_ssm_cache_dtype,
                            mtp=config.speculative is not None and config.speculative.method == "mtp")
        self.model, self.hf_config, self.tokenizer = loaded.model, loaded.hf_config, loaded.tokenizer
        logits = None
        if parallel is not None:
            install_all_reduce(self.model, parallel.all_reduce_)
            logits = vocab_parallel_logits(self.model, parallel)
        self.quantization = loaded.quantization  # {module path: scheme}; empty when every weight is dense
        self.model_path = loaded.path
        context = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        self.max_model_len = min(mc.max_model_len or context, context)
        num_blocks = self._kv_blocks(before, logits)
        self.state_pool = self._make_state_pool()
        # Hybrid models: a prefix hit must also restore the recurrent state after the prefix, so their
        # prefix cache needs state snapshots at block boundaries (none budgeted: the cache stays off).
        snapshots = self._make_snapshot_pool(num_blocks) if cc.enable_prefix_caching else None
        prefix_caching = cc.enable_prefix_caching and (self.state_pool is None or snapshots is not None)
        idle_budget = idle_budget_blocks(cc.prefix_cache_memory, num_blocks, self.kv_bytes_per_block,
                                         self.backend.host_memory)
        self.kv_cache = KVCacheManager(num_blocks, cc.block_size, prefix_caching, snapshots, idle_budget,
                                       cc.snapshot_interval())
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, self.state_pool,
                                   config.speculative)
        setup = self._runner_setup()
        # Structured output needs the vocabulary's text; nothing is built until a request asks for it.
        self.grammars = Grammars(self.tokenizer, self.hf_config.vocab_size) if self.tokenizer is not None else None
        links = RankLinks(parallel.all_reduce_, logits, samples=True) if parallel is not None else None
        self.runner = ModelRunner(self.model, config, self.backend, setup, links, self.grammars)
        self.memory = {"weight_bytes": weight_bytes(self.model), "rss_after_load_bytes": resident_bytes(),
                       "model_file_bytes": self.model_path.stat().st_size if self.model_path.is_file() else None}

    def _kv_blocks(self, before: DeviceMemory | None, logits) -> int:
        """KV blocks from the configured budget, or (before: the device's memory before loading) from what
        gpu_memory_utilization leaves after the weights and a profiling step (runner/kv_budget.py)."""
        cc = self.config.cache
        pool = size_kv_pool(self.model, logits or self.model.compute_logits, self.config, self.max_model_len,
                            self.kv_cache_dtype, self.device, self.hf_config.vocab_size, before)
        self.max_model_len, self.kv_bytes_per_block = pool.max_model_len, pool.bytes_per_block
        logger.info("backend: %s (%s, %s, KV %.2f GiB: %d blocks of %d tokens)", self.device.type,
                    self.backend.ops_description(), self.backend.dtype_description(),
                    pool.num_blocks * pool.bytes_per_block / GIB, pool.num_blocks, cc.block_size)
        return pool.num_blocks

    def _runner_setup(self) -> RunnerSetup:
        """The cache sizes every runner (and, when parallel, every rank's) is built with."""
        snapshots, spec = self.kv_cache.snapshots, self.config.speculative
        num_slots = self.state_pool.num_slots if self.state_pool else 0
        draft_rows = num_slots * spec.num_speculative_tokens if spec is not None else 0
        return RunnerSetup(self.kv_cache.pool.num_blocks, num_slots, snapshots.num_rows if snapshots else 0,
                           self.max_model_len, draft_rows)

    def _make_state_pool(self) -> StatePool | None:
        """One recurrent-state slot per running request, budgeted apart from the KV blocks."""
        per_slot = state_bytes_per_slot(self.model)
        if per_slot == 0:
            return None
        max_seqs = self.config.scheduler.max_num_seqs
        budget = self.config.cache.state_cache_memory
        num_slots = max_seqs if budget is None else min(max_seqs, int(budget * GIB // per_slot))
        if num_slots < 1:
            raise ValueError(f"state_cache_memory {budget} GiB holds no state slot of {per_slot} bytes")
        return StatePool(num_slots)

    def _make_snapshot_pool(self, num_blocks: int) -> SnapshotPool | None:
        """Hybrid models: state snapshot rows after the running slots, at most one per KV block."""
        if self.state_pool is None:
            return None
        budget = self.config.cache.state_snapshot_memory
        num_rows = min(num_blocks, int(budget * GIB // state_bytes_per_slot(self.model)))
        return SnapshotPool(num_rows, first_row=self.state_pool.num_slots) if num_rows > 0 else None

    def _eos_ids(self) -> frozenset[int]:
        if self.tokenizer is not None:
            return frozenset(self.tokenizer.eos_token_ids)
        eos = getattr(self.hf_config, "eos_token_id", None)
        return frozenset(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids: this engine was started without a tokenizer")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of integer token ids")
        self._check_ids("prompt", prompt)
        return list(prompt)

    def _check_ids(self, field: str, ids) -> None:
        """A ValueError naming `field` (its first word: the server maps it to the request field) for ids the
        model has no row for."""
        vocab = self.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{field} token ids out of range [0, {vocab}): {bad[:5]}")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; raises ValueError for a prompt that could never run."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self._in_flight is not None and any(item.request_id == request_id
                                               for item in self._in_flight.output.scheduled):
            # an aborted request's last step still runs (async scheduling): its token must not reach a new one
            raise ValueError(f"request id {request_id!r} is still in use: its last step is running")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        self._check_ids("logit_bias", [t for t, _ in params.logit_bias])  # the sampler indexes logits by them
        self._check_ids("stop_token_ids", params.stop_token_ids)
        request = Request(request_id, token_ids, params, self.config.cache.block_size,
                          self.eos_token_ids, arrival_time)
        if params.structured_outputs is not None:
            self.check_structured_outputs(params)
        self.scheduler.add_request(request)
        self._states[request_id] = RequestState(request, prompt if isinstance(prompt, str) else None,
                                                self.tokenizer)
        self.counters.prompt_tokens += len(token_ids)
        return request_id

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (cached for its slot; the server calls this off its event loop):
        a ValueError naming structured_outputs if it cannot run."""
        if self.grammars is None:
            raise ValueError("structured_outputs need the model's tokenizer; this engine was started without one")
        self.grammars.check(params.structured_outputs, stop_ids_of(params, self.eos_token_ids))

    def abort(self, request_id: str) -> bool:
        self._states.pop(request_id, None)
        aborted = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED) is not None
        if aborted:
            self._settle_when_idle()
        return aborted

    @property
    def failure(self) -> Exception | None:
        """Why a parallel engine can no longer step (a worker rank died or hung), else None."""
        return self.executor.failure

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step's outputs. With async scheduling the step after it is launched before its tokens are read
        back (ids as without): a step is then in flight between calls."""
        current = self._in_flight or self._launch_next()
        self._in_flight = None
        if current is None:
            return []
        if self._runs_ahead(current):
            self._in_flight = self._launch_next(after=current)
            self.counters.steps_launched_ahead += self._in_flight is not None
        try:
            model_output = self.executor.collect(current.launched)
        except DistributedError:
            raise
        except Exception as exc:
            self._recover(current, exc)
        outputs = self._process(current.output, current.schedule_ms, model_output)
        self._settle_when_idle()
        return outputs

    def _settle_when_idle(self) -> None:
        """With nothing left to run, memory goes back to what idles, now (one step with no model work), not with
        the next request's first step: the free KV blocks past the prefix cache's budget, warm ones included
        (kept for reuse while steps run); on a CPU also the step buffers every rank keeps (Backend.settle)."""
        if self._in_flight is not None or self.scheduler.has_unfinished():
            return
        self.kv_cache.release_warm()
        if self.kv_cache.has_released() or self.backend.host_memory:
            self.executor.execute(self.scheduler.schedule())

    def _launch_next(self, after: InFlightStep | None = None) -> InFlightStep | None:
        proposals = self._proposals(after) if self.drafter is not None else None
        t0 = time.perf_counter()
        output = self.scheduler.schedule(proposals)
        schedule_ms = (time.perf_counter() - t0) * 1e3
        if output.is_empty:
            return None
        step = InFlightStep(output, schedule_ms)
        try:
            step.launched = self.executor.launch(output)
        except DistributedError:
            raise
        except Exception as exc:
            self._recover(step, exc, also=after)
        return step

    def _proposals(self, after: InFlightStep | None) -> dict[str, tuple[int, ...]]:
        """The drafter's (methods draft_model, mtp). One that fails fails as a launch does: `after` (launched, its
        tokens unread) goes back to waiting, the StepError naming the requests the drafter ran for."""
        try:
            return self.drafter.propose(self.scheduler.draft_requests())
        except DistributedError:
            raise
        except Exception as exc:
            self._recover(None, exc, also=after, blamed=self.drafter.ran_for())

    def _runs_ahead(self, current: InFlightStep) -> bool:
        """Launch the next step now? Only where its decodes need nothing of `current`'s tokens on the host:
        penalties count them and grammars advance on them."""
        return (self._async and not self.scheduler.held
                and not needs_host_tokens(current.output, self.scheduler.requests, self.scheduler.speculation))

    def _recover(self, failed: InFlightStep | None, exc: Exception, also: InFlightStep | None = None,
                 blamed: tuple[str, ...] = ()) -> None:
        """A step failed: it, `also` (the step before it, when it fails at launch: that one's tokens are never read)
        and any launched after it go back to waiting (recomputed from the prefix cache). The StepError names the
        failed step's requests (no step: `blamed`, a drafter's): the server looks for the culprit among them."""
        self.runner.reset_step_reuse()
        steps = [s for s in (failed, also, self._in_flight) if s is not None]
        self._in_flight = None
        for step in steps:
            self.scheduler.recover_failed_step(step.output)
        if failed is not None:
            blamed = tuple(item.request_id for item in failed.output.scheduled)
        raise StepError(blamed, exc) from exc

    def _process(self, output, schedule_ms: float, model_output) -> list[RequestOutput]:
        """A collected step: tokens to their requests, detokenized, stop strings and limits checked."""
        updated = self.scheduler.update(output, model_output)
        self.counters.record_step(output, schedule_ms, model_output, self.scheduler)
        logprobs: dict[str, list] = {}  # each request's entries, in token order (several from a verify step)
        for request_id, entry in zip(model_output.request_ids, model_output.logprobs or ()):
            logprobs.setdefault(request_id, []).append(entry)
        for chunk in model_output.prompt_logprobs:  # before outputs: a prompt's last chunk also samples
            state = self._states.get(chunk.request_id)
            if state is not None:  # None: aborted while the step ran
                state.add_prompt_logprobs(chunk)
        results = [self.fail_request(rid, why) for rid, why in model_output.failed if rid in self._states]
        for request_id, vector in model_output.pooled:  # embedding requests: done once their prompt ran
            state = self._states.pop(request_id, None)
            if state is not None:  # None: aborted while the step ran
                state.embedding = list(vector)
                self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
                results.append(state.make_output(RequestStatus.FINISHED_STOPPED))
        for request, num_new in updated:
            state = self._states[request.request_id]
            try:
                finish = state.add_tokens(num_new, logprobs.get(request.request_id))
            except Exception as exc:  # noqa: BLE001 - detokenizing or stop strings of this request alone
                results.append(self.fail_request(request.request_id, f"{type(exc).__name__}: {exc}"))
                continue
            status = finish or self.scheduler.check_length_stop(request)
            if status is not None:
                self.scheduler.finish(request.request_id, status)
                del self._states[request.request_id]
            results.append(state.make_output(status))
        return results

    def hold(self, request_ids) -> None:
        """Leave these requests out of the next steps until hold(()): a StepError's requests, split to find
        which one fails."""
        self.scheduler.hold(request_ids)

    def fail_request(self, request_id: str, why: str) -> RequestOutput:
        """Finish one request with an error (its output so far, finish_reason "abort", `error` set)."""
        state = self._states.pop(request_id)
        self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        output = state.make_output(RequestStatus.FINISHED_ABORTED)
        output.error = why
        return output

    def shutdown(self) -> None:
        """Stop the worker ranks of a parallel engine (nothing to do for one process); safe to call twice."""
        self.executor.shutdown()
        if self.drafter is not None:
            self.drafter.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; False (and nothing done) while requests are unfinished."""
        return not self.has_unfinished_requests() and self.kv_cache.reset_prefix_cache()

    def stats(self) -> dict:
        stats = self.counters.as_dict(self.kv_cache, self.scheduler, self.kv_bytes_per_block)
        stats["tensor_parallel_size"] = self.executor.world_size
        stats["kernels"] = self.kernels
        stats["dtype"] = self.backend.dtype_description()
        stats["kv_cache_dtype"] = str(self.kv_cache_dtype).removeprefix("torch.")
        stats["layers"] = self.runner.plan.description  # bound to the kernels, or modules and why
        for kind, graphs in (("decode", self.runner.decode_graphs), ("verify", self.runner.verify_graphs)):
            stats[f"{kind}_graphs"] = "off (eager)" if graphs is None else graphs.summary
        stats["async_scheduling"] = self._async
        stats.update(self.memory)  # weights, and the process with its KV pool still empty, as loaded
        return stats
