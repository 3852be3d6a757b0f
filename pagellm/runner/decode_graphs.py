"""Pure-decode forwards replayed from CUDA graphs, one per bucket of runner/decode_inputs.py (issue 31).

Why: an eager decode step is bound by the host, not the GPU: Python and a launch per kernel of every layer
(profiled on an H200: docs/benchmarks/2026-11-26-gpu-h200.md). A graph replays the whole forward at once.

    capture   per bucket, largest first, in one memory pool, GC off: a warm-up run (Triton compiles, cuBLAS
              picks its kernels), then the forward recorded over the padded buffers' fixed addresses
    replay    a step whose rows are a bucket: the buffers filled in place (DecodeInputs), one replay, the
              bucket's hidden states read from the graph's output

What is captured is the bound forward, embedding to the final norm; logits and sampling stay eager. The Triton
attention's host-side choices are fixed at capture from shapes alone (a pure-decode tile, key splits by the
bucket: the capture's metadata says `for_graph`, its contexts are one token). A new plan (runner.replan) drops
the graphs: they hold the old plan's kernels and tensors.

On a CPU nothing is captured and the same padded buffers run eagerly; a test replays a stand-in graph that
reruns the recorded forward over the same tensors, which is what a CUDA graph's replay reads. On an H200 the
replayed steps gave eager's greedy ids (docs/benchmarks/2026-11-26-gpu-decode-graphs.md).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from pagellm.runner.decode_inputs import DecodeInputs

logger = logging.getLogger("pagellm.runner")


class CudaGraphRecorder:
    """torch's CUDA graphs: record(fn) captures fn's kernels into one shared pool -> (replay, output)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy initialisation must not be recorded
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


class DecodeGraphs:
    """forward(input_ids, positions, meta) -> hidden [tokens, E], replayed from a graph where one was captured for
    the step's shape, else run as it is. `inputs` names the shapes (graph_keys: a decode step's row count, or a
    verify step's rows and draft length, runner/verify_inputs.py) and fills their buffers (capture_inputs)."""

    def __init__(self, forward: Callable, inputs: DecodeInputs, kind: str = "decode"):
        self.forward, self.inputs, self.kind = forward, inputs, kind
        self.graphs: dict = {}  # shape -> (replay, hidden)
        self.replays = 0
        self.summary = "none captured"  # LLM.stats()' "decode_graphs" / "verify_graphs"

    def capture(self, recorder) -> None:
        """Every shape, largest first (the pool's largest buffers first, the rest fit in them), logged."""
        gc.collect()  # before the count: a collection frees what an earlier engine left, not the graphs' memory
        start, before = time.perf_counter(), _device_bytes()
        gc.disable()  # a collection mid-capture could free a tensor the graph records
        try:
            for key in sorted(self.inputs.graph_keys(), reverse=True):
                input_ids, positions, meta = self.inputs.capture_inputs(key)
                self.graphs[key] = recorder.record(  # the shape's own buffers bound now, not the loop's last
                    lambda ids=input_ids, pos=positions, m=meta: self.forward(ids, pos, m))
        finally:
            gc.enable()
            self.inputs.invalidate()  # the capture left every row padded
        what = "buckets" if self.kind == "decode" else "shapes (rows, drafts)"
        self.summary = (f"{len(self.graphs)} {what} ({', '.join(map(str, sorted(self.graphs)))}) captured in "
                        f"{time.perf_counter() - start:.1f} s, {(_device_bytes() - before) / 2**20:.0f} MiB")
        logger.info("%s graphs: %s", self.kind, self.summary)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, key=None) -> tuple[torch.Tensor, bool]:
        """(hidden, whether a graph replayed it); key: the step's shape (default: its row count)."""
        entry = self.graphs.get(input_ids.shape[0] if key is None else key)
        if entry is None:
            return self.forward(input_ids, positions, meta), False
        replay, hidden = entry
        replay()
        self.replays += 1
        return hidden, True

    def drop(self) -> None:
        self.graphs.clear()
        self.summary = "dropped by a new layer plan"


def capture_or_run_eagerly(graphs: DecodeGraphs, recorder, required: bool) -> DecodeGraphs | None:
    """The graphs captured; a capture that fails raises if they were asked for, else warns and gives None (the
    model still serves, eagerly)."""
    try:
        graphs.capture(recorder)
    except Exception as exc:  # noqa: BLE001 - torch's, Triton's (compilation, resources) or a kernel's checks
        graphs.graphs.clear()  # what was captured before the failure holds pool memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if required:
            raise RuntimeError(f"capturing the {graphs.kind} graphs failed ({exc}); --enforce-eager runs without "
                               "them") from exc
        logger.warning("%s graphs: capture failed (%s); running eagerly", graphs.kind, exc)
        return None
    return graphs


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's capture sizes; a step pads to at most 7 rows)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return tuple(sorted(set(sizes + [max_num_seqs])))


def _device_bytes() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
