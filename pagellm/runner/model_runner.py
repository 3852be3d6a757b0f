"""ModelRunner: SchedulerOutput -> packed inputs -> model -> logits of sampled rows -> tokens.

The one blocking host read of a step is the sampled ids (and their logprobs
when asked), copied back as a HostRead; everything before it is queued work,
host values reaching the device through kernels/transfers.py without a sync.
launch() queues a step and collect() waits for its tokens (runner/sampled_tokens.py):
between the two the engine may launch the next step (async scheduling). A step
with prompt_logprobs rows reads those back once more (runner/prompt_logprobs.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
import logging
import time
from collections.abc import Callable

import torch

from pagellm.core.types import PLACEHOLDER, ModelOutput, SchedulerOutput, StepTimings
from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.transfers import to_device
from pagellm.config import EngineConfig
from pagellm.models.bound_layers import LayerPlan, PlanSettings, plan_model
from pagellm.runner.backend import Backend
from pagellm.runner.decode_graphs import CudaGraphRecorder, DecodeGraphs, capture_or_run_eagerly, default_buckets
from pagellm.runner.decode_inputs import DecodeInputs, state_slots_of
from pagellm.runner.grammar import Grammars
from pagellm.runner.host_pages import HostPages, page_aligned_empty
from pagellm.runner.mtp_drafter import MtpDrafter, mtp_scratch_blocks
from pagellm.runner.input_batch import InputBatch, SlotState
from pagellm.runner.prompt_logprobs import logits_passes, prompt_rows, score_prompt_rows
from pagellm.runner.pooling import pool_rows
from pagellm.runner.sampled_tokens import LaunchedStep, SampledTokens, hand_out
from pagellm.runner.sampler import Sampler
from pagellm.runner.speculative import sampling_rows
from pagellm.runner.verify_inputs import VerifyInputs, draft_buckets

logger = logging.getLogger("pagellm.runner")


def state_layers_of(model) -> list:
    """Layers with recurrent state (Gated DeltaNet); empty for attention-only models."""
    return list(getattr(model, "state_layers", list)())


def state_bytes_per_slot(model) -> int:
    """Conv + recurrent state of every linear-attention layer for one request."""
    total = 0
    for layer in state_layers_of(model):
        shapes = layer.state_shapes()
        for shape, dtype in ((shapes.conv_state, shapes.conv_dtype), (shapes.recurrent_state, shapes.recurrent_dtype)):
            total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return total


def kv_cache_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    per_token = sum(2 * layer.num_kv_heads * layer.head_dim for layer in model.attention_layers())
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class RunnerSetup:
    """What the head decided that every rank's runner must share: the cache's sizes, and the longest sequence
    (the fixed block-table width of padded decode steps)."""

    num_blocks: int
    num_state_slots: int
    num_snapshot_slots: int
    max_model_len: int
    num_draft_state_rows: int = 0  # speculative decoding's rollback rows (core/scheduler.py _draft_state_rows)


@dataclass(frozen=True)
class RankLinks:
    """A tensor-parallel rank's ties to the others (distributed/sharding.py): the all-reduce its layers end with,
    and the vocab-parallel LM head [N, E] -> [N, V] fp32 that every rank then runs for every logits pass (the head
    rank gets them gathered; None: the head stays whole on rank 0). `samples`: False on a worker, where the head
    alone samples."""

    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor] | None
    samples: bool


class ModelRunner:
    def __init__(self, model, config: EngineConfig, backend: Backend, setup: RunnerSetup,
                 links: RankLinks | None = None, grammars: Grammars | None = None):
        """Binds the model's KV caches and state rows (`setup`'s sizes) on `backend`'s device, plans its layers
        for the backend's level and dtypes, and sets up the padded decode steps (runner/decode_inputs.py) and
        their graphs (runner/decode_graphs.py): backend.decode_graphs replays the bound forward of pure-decode
        steps at backend.graph_sizes (default_buckets unless given), captured on CUDA, run eagerly from the same
        buffers on a CPU; a model without a bound plan, with recurrent state its decode kernels cannot pad (the
        CPU's), or tensor parallel runs every step eagerly; a capture that fails raises if
        backend.graphs_required, else warns and runs eagerly."""
        self.model, self.backend, self.device = model, backend, backend.device
        self.vocab_parallel = links is not None and links.logits is not None
        self.compute_logits = links.logits if self.vocab_parallel else model.compute_logits
        self.samples = links.samples if links else True  # False on a tensor-parallel worker
        self.block_size = block_size = config.cache.block_size
        max_num_seqs = config.scheduler.max_num_seqs
        self.input_batch = InputBatch(max_num_seqs, self.device, grammars if self.samples else None)
        # a model with recurrent state pads its steps only where its decode kernels skip a padded row's slot
        ops = backend.layer_ops()  # the modules' table, bound by the plan below
        delta = ops.gated_delta_decode
        pads_state = bool(state_layers_of(model)) and delta is not None and delta.skips_padding
        graphs = backend.decode_graphs and links is None and (not state_layers_of(model) or pads_state)
        decode_buckets = backend.graph_sizes
        if backend.decode_graphs and not graphs:  # no graph to replay: padding would cost rows and gain nothing
            decode_buckets = ()
        elif graphs:  # a bucket past max_num_seqs would never be run (vLLM drops those too)
            decode_buckets = tuple(b for b in decode_buckets if b <= max_num_seqs) or default_buckets(max_num_seqs)
        padded_blocks = setup.num_blocks if decode_buckets else None
        table_width = -(-setup.max_model_len // block_size) if decode_buckets else None
        self.decode_inputs: DecodeInputs | None = DecodeInputs(  # None: no reuse
            max_num_seqs, block_size, self.device, decode_buckets, padded_blocks, table_width, pads_state)
        self.decode_graphs: DecodeGraphs | None = None
        self.kernel_level = backend.level  # every module's, bound by the plan
        self.sampler = Sampler(kernel_level=self.kernel_level, pinned=not backend.host_memory)
        # the last launched step's sampled ids [B] (on the device) and each sampling request's row in them
        self._last_samples: tuple[torch.Tensor, dict[str, int]] = (torch.empty(0, dtype=torch.int64), {})
        first_scratch = setup.num_blocks + (1 if decode_buckets else 0)  # after the padded steps' one
        scratch = range(first_scratch, first_scratch + mtp_scratch_blocks(config))
        self.kv_pages = self._bind_kv_caches(scratch.stop)
        self.mtp: MtpDrafter | None = None  # speculative_config method mtp: the model's MTP head proposes
        if config.speculative is not None and config.speculative.method == "mtp":
            self.mtp = MtpDrafter(model, self.compute_logits, block_size, self.device, scratch,
                                  config.speculative.num_speculative_tokens)
        # How the layers run, chosen once for this device, level, dtype and cache: bound to the kernels, or the
        # modules (models/bound_layers.py); tensor parallel's all-reduce goes into a bound plan.
        self.plan_settings = PlanSettings(self.kernel_level, backend.compute_dtype, backend.kv_cache_dtype,
                                          config.kernels.bound_layers, links.all_reduce if links else None,
                                          backend.narrow_dtype, backend.step_kernels(), ops)
        self.plan: LayerPlan = self.replan()
        self.state_layers = state_layers_of(model)
        self.state_pages = self._bind_states(setup.num_state_slots + setup.num_snapshot_slots
                                             + setup.num_draft_state_rows)
        recorder = CudaGraphRecorder() if graphs and backend.captures_graphs else None  # one pool for all
        if graphs and self.plan.bound is not None:
            self.decode_graphs = DecodeGraphs(self._bound_forward, self.decode_inputs)
            if recorder is not None:
                with torch.inference_mode():  # as every step runs
                    self.decode_graphs = capture_or_run_eagerly(self.decode_graphs, recorder,
                                                                backend.graphs_required)
        if graphs and self.decode_graphs is None:  # asked for, none to replay (no bound plan, failed capture)
            self.decode_inputs = DecodeInputs(max_num_seqs, block_size, self.device, (), None, None)
        self.verify_graphs = self._verify_graphs(config, setup, recorder)

    def _verify_graphs(self, config: EngineConfig, setup: RunnerSetup, recorder) -> DecodeGraphs | None:
        """Speculative decoding's verify steps replayed from graphs wherever decode steps are (runner/verify_inputs.py):
        attention-only models, and hybrid ones where the Gated DeltaNet's kernels skip padded slots, at the batch
        buckets up to the first that stops speculation."""
        spec = config.speculative
        recurrent = bool(self.state_layers)
        if spec is None or self.decode_graphs is None or not self.decode_inputs.buckets or (
                recurrent and not self.decode_inputs.pad_state_slots):
            return None
        buckets = self.decode_inputs.buckets
        rows = tuple(b for b in buckets if b < spec.disable_by_batch_size) + tuple(
            b for b in buckets if b >= spec.disable_by_batch_size)[:1]
        inputs = VerifyInputs(rows, draft_buckets(spec.num_speculative_tokens), self.block_size, self.device,
                              setup.num_blocks, self.decode_inputs.block_tables.shape[1], setup.max_model_len,
                              recurrent)
        graphs = DecodeGraphs(self._bound_forward, inputs, kind="verify")
        if recorder is None:
            return graphs
        with torch.inference_mode():
            return capture_or_run_eagerly(graphs, recorder, self.backend.graphs_required)

    def _bind_kv_caches(self, num_blocks: int) -> HostPages:
        """Every attention layer's K and V pools, [num_blocks, block_size, kv_heads, head_dim] each: reserved
        address space only on a CPU, whose pages become resident as blocks are written (runner/host_pages.py)."""
        for layer in self.model.attention_layers():
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_kv_cache(self._empty(shape, self.backend.kv_cache_dtype),
                                self._empty(shape, self.backend.kv_cache_dtype))
        return self._host_pages([t for layer in self.model.attention_layers()
                                 for t in (layer.key_cache, layer.value_cache)])

    def _bind_states(self, rows: int) -> HostPages:
        """Rows [0, num_state_slots) are running requests' slots, the rest prefix-cache snapshots
        (core/snapshot_pool.py). Uninitialised too: a request's first chunk starts from zero state without reading
        its slot, and a snapshot row is read only after a step has written it. Snapshot rows are released with
        their KV blocks."""
        states = []
        for layer in self.state_layers:
            shapes = layer.state_shapes()
            states += [self._empty((rows, *shapes.conv_state), shapes.conv_dtype),
                       self._empty((rows, *shapes.recurrent_state), shapes.recurrent_dtype)]
            layer.bind_state(*states[-2:])
        return self._host_pages(states)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised; in host memory page-aligned, so that released rows free whole pages."""
        if self.backend.host_memory:
            return page_aligned_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _host_pages(self, tensors: list[torch.Tensor]) -> HostPages:
        """Their released rows' pages go back to the OS; device memory stays reserved whole."""
        return HostPages(tensors if self.backend.host_memory else [])

    def _bound_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta, plan=self.plan.bound)

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Run one step and return its tokens (launch, then collect)."""
        return self.collect(self.launch(output))

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """Queue the step on the device, its sampled ids' copy to the host started; waits for nothing (a
        prompt-logprob read aside). A PLACEHOLDER token is the last launched step's sample for its request."""
        t0 = time.perf_counter()
        states = self.input_batch.apply(output.released_request_ids, output.scheduled)
        self.kv_pages.release(output.released_blocks)  # before the step, which may write them again
        if self.mtp is not None:
            self.mtp.forget(output.released_request_ids)
        self.state_pages.release(output.released_snapshot_rows)
        if not output.scheduled:  # an idle engine's last step: only memory to give back
            self.backend.settle()  # what steps keep for the next one, every rank's own
            return LaunchedStep(StepTimings(), done=ModelOutput((), ()))
        graphs, key, reused = None, None, False
        pure_decode = self.decode_inputs is not None and _is_pure_decode(output)
        if pure_decode:
            t_copy, graphs = t0, self.decode_graphs  # its bucket's graph, if one was captured
            input_ids, positions, meta, logits_rows, reused = self.decode_inputs.prepare(output.scheduled, states)
            offsets = range(len(output.scheduled))
        else:
            if self.decode_inputs is not None:
                self.decode_inputs.invalidate()
            key = self.verify_graphs.inputs.key_for(output.scheduled) \
                if self.verify_graphs is not None and _is_verify(output) else None
            if key is not None:  # a verify step padded to its graph's shape
                t_copy, graphs = t0, self.verify_graphs
                input_ids, positions, meta, logits_rows, offsets = graphs.inputs.prepare(output.scheduled, states,
                                                                                        key)
            else:
                host_lists = self._gather_inputs(output, states)
                t_copy = time.perf_counter()
                input_ids, positions, meta, logits_rows = self._build_input_tensors(*host_lists)
                offsets = list(itertools.accumulate((len(item.token_ids) for item in output.scheduled[:-1]),
                                                    initial=0))
        self._fill_placeholders(output.scheduled, input_ids, offsets)
        t1 = time.perf_counter()
        host_ms, copy_ms = (t_copy - t0) * 1e3, (t1 - t_copy) * 1e3
        self._restore_snapshots(output)
        replayed = False
        if graphs is not None:
            hidden, replayed = graphs.run(input_ids, positions, meta, key)  # [tokens, hidden]
        else:
            hidden = self.model(input_ids, positions, meta, plan=self.plan.bound)  # [T, hidden]
        if self.mtp is not None:
            self.mtp.record(output.scheduled, hidden, offsets)
        if not self.samples:  # a tensor-parallel worker: only its share of a vocab-parallel LM head
            self._join_logits_gathers(output, hidden, logits_rows)
            timings = StepTimings(host_ms, copy_ms, _ms_since(t1), 0.0, 0, reused, replayed)
            return LaunchedStep(timings, done=ModelOutput((), (), timings=timings))
        # Requests that asked for prompt_logprobs: their chunks' prompt rows (never in a pure decode step).
        prompt_logprobs = score_prompt_rows(self.compute_logits, hidden, output.scheduled, states)
        pooled = () if pure_decode else pool_rows(hidden, output.scheduled, states)  # embedding requests
        prompt_syncs = bool(prompt_logprobs) + bool(pooled)
        sampled = [s for item, s in zip(output.scheduled, states) if item.sample]
        drafts = [item.token_ids[len(item.token_ids) - item.num_draft:] for item in output.scheduled if item.sample]
        if not sampled:
            timings = StepTimings(host_ms, copy_ms, _ms_since(t1), 0.0, prompt_syncs, reused, replayed)
            return LaunchedStep(timings, done=ModelOutput((), (), prompt_logprobs=prompt_logprobs, pooled=pooled,
                                                          timings=timings))
        logits = self.compute_logits(hidden[logits_rows])  # [R, V], only rows that sample (R >= B: verify items)
        t2 = time.perf_counter()
        for state in sampled:
            state.reseed()
        rows = sampling_rows(sampled, drafts)  # a verify item's every position (runner/speculative.py)
        result = self.sampler(logits, rows, overwrite=True)  # counting only tokens out (min_tokens)
        for state in sampled:
            state.num_pending += 1  # this step's token, on its way until collect
        # each request's row: what a PLACEHOLDER of the next launch stands for (never a verify item's: the
        # scheduler proposes nothing for a request with tokens on their way, nor schedules past a verify item)
        first_rows = itertools.accumulate((len(d) + 1 for d in drafts[:-1]), initial=0)
        self._last_samples = result.token_ids, {s.request_id: i for s, i in zip(sampled, first_rows)}
        timings = StepTimings(host_ms, copy_ms, (t2 - t1) * 1e3, _ms_since(t2), 1 + prompt_syncs, reused, replayed)
        return LaunchedStep(timings, sampled=sampled, drafts=drafts, rows=rows, tokens=SampledTokens(result),
                            prompt_logprobs=prompt_logprobs, pooled=pooled)

    def collect(self, step: LaunchedStep) -> ModelOutput:
        """Wait for a launched step's tokens (the step's one blocking wait) and hand them to their slots."""
        if step.done is not None:
            return step.done
        t0 = time.perf_counter()
        token_ids, logprobs = step.tokens.read(step.rows)
        timings = dataclasses.replace(step.timings, sample_ms=step.timings.sample_ms + _ms_since(t0))
        return hand_out(step, token_ids, logprobs, timings)

    def _fill_placeholders(self, items, input_ids: torch.Tensor, offsets) -> None:
        """input_ids [T]: each PLACEHOLDER replaced, on the device, by its request's sample of the last launch;
        offsets: each item's first row in input_ids."""
        targets, sources = [], []
        for item, offset in zip(items, offsets):
            if item.token_ids[-1] == PLACEHOLDER:  # only ever a decode's one token (the scheduler's rule)
                targets.append(offset + len(item.token_ids) - 1)
                sources.append(self._last_samples[1][item.request_id])
        if targets:
            samples = self._last_samples[0].index_select(0, to_device(sources, torch.int64, self.device))
            input_ids.index_copy_(0, to_device(targets, torch.int64, self.device), samples)

    def replan(self) -> LayerPlan:
        """Choose how the layers run (at start, or again after a layer changed), log it and keep it."""
        self.plan = plan_model(self.model, self.plan_settings)
        for graphs in (getattr(self, "decode_graphs", None), getattr(self, "verify_graphs", None)):
            if graphs is not None:  # they hold the old plan's kernels
                graphs.drop()
        logger.info("layers: %s", self.plan.description)
        if self.mtp is not None:
            logger.info("%s", self.mtp.replan(self.plan_settings))
        return self.plan

    def reset_step_reuse(self) -> None:
        """After a step that failed part-way: the next decode step is prepared from scratch."""
        if self.decode_inputs is not None:
            self.decode_inputs.invalidate()

    def _join_logits_gathers(self, output: SchedulerOutput, hidden: torch.Tensor, logits_rows: torch.Tensor) -> None:
        """A tensor-parallel worker: a vocab-parallel LM head gathers every logits pass to the head rank, so
        this rank runs its share of the head's passes in the head's order (prompt rows, then sampled rows)."""
        if not self.vocab_parallel:
            return
        for _ in logits_passes(self.compute_logits, hidden, prompt_rows(output.scheduled)):
            pass
        if any(item.sample for item in output.scheduled):
            self.compute_logits(hidden[logits_rows])

    def _restore_snapshots(self, output: SchedulerOutput) -> None:
        """Hybrid models: a prefix hit's state slot starts as the snapshot of its prefix, and a request whose
        last verify step rejected drafts goes back to the state after its accepted tokens."""
        if not self.state_layers:
            return
        pairs = [(row, item.state_slot) for item in output.scheduled
                 for row in (item.restore_snapshot, item.rollback_state_row) if row is not None]
        if pairs:
            sources, slots = (list(rows) for rows in zip(*pairs))
            for layer in self.state_layers:
                layer.copy_state(sources, slots)

    @staticmethod
    def _gather_inputs(output: SchedulerOutput, states: list[SlotState]):
        """Host lists of the step's packed tokens, positions, lengths, block tables, sampled rows, state rows."""
        tokens: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, logits_rows = [], [], [], []
        slots = state_slots_of(output.scheduled)
        writes = tuple((b, p, row) for b, item in enumerate(output.scheduled) for p, row in _state_writes(item))
        for item, state in zip(output.scheduled, states):
            n = len(item.token_ids)
            tokens.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + n))
            query_lens.append(n)
            seq_lens.append(item.start_position + n)
            tables.append(state.block_ids)
            if item.sample:  # logits only where a token is sampled: a verify item's every position from its decode
                logits_rows.extend(range(len(tokens) - 1 - item.num_draft, len(tokens)))
        return tokens, positions, query_lens, seq_lens, tables, logits_rows, slots, writes

    def _build_input_tensors(self, tokens, positions, query_lens, seq_lens, tables, logits_rows, slots, writes):
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device, slots, writes)
        input_ids = to_device(tokens, torch.int64, self.device)
        pos = to_device(positions, torch.int64, self.device)
        rows = to_device(logits_rows, torch.int64, self.device)
        return input_ids, pos, meta, rows


def _state_writes(item) -> tuple[tuple[int, int], ...]:
    """(position, state row) pairs the step copies the request's recurrent state to after `position` tokens:
    prefix-cache snapshots, and a verify item's rollback rows (the state after its decode and each draft)."""
    start = item.start_position
    rollback = tuple((start + 1 + i, row) for i, row in enumerate(item.draft_state_rows))
    return item.snapshot_writes + rollback if rollback else item.snapshot_writes


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def _is_verify(output: SchedulerOutput) -> bool:
    """Every request feeds its decode token and its drafts (some have drafts), none new, none snapshotting."""
    return output.num_prefill_tokens == 0 and any(item.num_draft for item in output.scheduled) and all(
        item.new is None and len(item.token_ids) == 1 + item.num_draft and item.sample and not item.snapshot_writes
        for item in output.scheduled)


def _is_pure_decode(output: SchedulerOutput) -> bool:
    """Every request feeds one token of a running decode (none is new or resuming, none snapshots its state).

    (A snapshot write in a one-token step happens once per request at most: its block-aligned
    prompt's last token fed alone.)
    """
    return output.num_prefill_tokens == 0 and all(
        item.new is None and len(item.token_ids) == 1 and item.sample and not item.snapshot_writes
        for item in output.scheduled)
