"""The device backend: what one device runs, decided once from the engine's config.

`choose_backend(config, rank)` is the one place that derives the device policy: the device a rank runs on, the
CPU kernels' instruction-set level (and every kernel built for it), whether a GGUF runs on its own blocks, the
compute, K/V and attention dtypes. The engine, every tensor-parallel worker, `eval` and `bench` ask it, with the
same frozen config, so they cannot disagree (a worker that re-derived the dtypes once dropped the GGUF-blocks
rule). What differs by device kind is answered by the two classes, never by a device test at the call site:

    CpuBackend    host memory: the KV pool reserved and its released pages handed back (MADV_DONTNEED), a
                  prefix-cache budget by default, the kernels' scratch and the heap given back at idle; no graph
                  capture (padded decode buffers run eagerly where a test forces them); collectives over Gloo
    CudaBackend   device memory reserved up front (gpu_memory_utilization); decode graphs captured; collectives
                  over NCCL; async scheduling where graphs replay

Which kernel runs each layer op is the plan's (models/bound_layers.py), bound to the backend's level and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from pagellm.config import EngineConfig, KernelConfig
from pagellm.kernels.build import native
from pagellm.kernels.ops import LayerOps, native_ops, triton_ops
from pagellm.kernels.selection import (compute_dtype, kv_cache_dtype, narrow_dtype, narrow_sites,
                                       release_thread_scratch, select_kernels)
from pagellm.models.bound_layers import StepKernels, native_step_kernels, triton_step_kernels
from pagellm.platform import DTYPES, release_freed_heap


@dataclass(frozen=True)
class Backend:
    device: torch.device
    level: str | None  # the CPU kernels' instruction-set level; None on a GPU, or with native kernels off
    kernels: str  # every CPU kernel and where it runs, in words (kernels/selection.py's start-up line)
    gguf_blocks: bool  # a GGUF file runs on its own blocks (the CPU block kernels), not dequantized
    compute_dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    narrow_dtype: torch.dtype | None  # attention's, where narrower than the activations
    # Pure-decode steps padded to graph_sizes and replayed from graphs (captured where captures_graphs, else run
    # eagerly from the same buffers); graph_sizes without decode_graphs: padded steps only. graphs_required: a
    # capture that fails is an error, not a warning.
    decode_graphs: bool = False
    graph_sizes: tuple[int, ...] = ()
    graphs_required: bool = False

    host_memory: ClassVar[bool] = True  # memory is the host's: released pages and freed heap go back to the OS
    captures_graphs: ClassVar[bool] = False  # decode graphs are captured (else their buffers replay eagerly)
    collective: ClassVar[str] = "gloo"  # tensor parallel's collectives on this device's tensors
    runs_cpu_kernels: ClassVar[bool] = True  # the native CPU kernels (at `level`) apply

    def dtype_description(self) -> str:
        """The activations' dtype, and attention's where narrower ("float32, bfloat16 attention")."""
        return str(self.compute_dtype).removeprefix("torch.") + narrow_sites(self.narrow_dtype)

    def ops_description(self) -> str:
        """The kernels this device runs, in words, for the backend line."""
        return f"native kernels at {self.level}" if self.level is not None else "torch reference ops"

    def step_kernels(self) -> tuple[StepKernels | None, str]:
        """The kernels the layers' plan binds (models/bound_layers.py), or (None, why not)."""
        return self.kernels_at(self.level)

    @staticmethod
    def kernels_at(level: str | None) -> tuple[StepKernels | None, str]:
        """This kind's step kernels at a CPU kernel level: the native ones."""
        return native_step_kernels(level)

    def layer_ops(self) -> LayerOps:
        """The layer ops the modules call (kernels/ops.py), bound by the plan."""
        return self.ops_at(self.level, self.compute_dtype)

    @staticmethod
    def ops_at(level: str | None, dtype: torch.dtype) -> LayerOps:
        """This kind's layer ops at a CPU kernel level, for `dtype` activations: the native kernels it takes."""
        return native_ops(level, dtype)

    def settle(self) -> None:
        """Nothing runs until the next request: give back what steps keep for the next one. On a CPU the
        kernels' per-thread scratch, then the heap's freed step buffers (platform.keep_step_buffers_in_heap):
        both grow to the largest step run and would stay resident."""
        release_thread_scratch()
        release_freed_heap()


@dataclass(frozen=True)
class CpuBackend(Backend):
    pass  # Backend's answers are the host's


@dataclass(frozen=True)
class CudaBackend(Backend):
    host_memory: ClassVar[bool] = False
    captures_graphs: ClassVar[bool] = True
    collective: ClassVar[str] = "nccl"
    runs_cpu_kernels: ClassVar[bool] = False

    def ops_description(self) -> str:
        return "Triton paged attention and layer ops, cuBLAS matmuls"

    @staticmethod
    def kernels_at(level: str | None) -> tuple[StepKernels | None, str]:
        return triton_step_kernels(), ""  # no CPU level applies

    @staticmethod
    def ops_at(level: str | None, dtype: torch.dtype) -> LayerOps:
        return triton_ops()

    def settle(self) -> None:
        pass  # the caching allocator keeps its blocks for the next step; the KV pool is reserved anyway


DEVICE_KINDS = ("cpu", "cuda")


def backend_kind(device: torch.device) -> type[Backend]:
    """The backend class of `device`: the one device test (what a model already on a device runs with). Other
    devices are refused: nothing allocates or computes on them (ModelConfig refuses them first)."""
    if device.type not in DEVICE_KINDS:
        raise ValueError(f"device: pagellm runs on {' or '.join(DEVICE_KINDS)}, not {device.type!r}")
    return CudaBackend if device.type == "cuda" else CpuBackend


def device_kernels(device: torch.device, kernels: KernelConfig,
                   dtype: torch.dtype) -> tuple[str | None, tuple[StepKernels | None, str], LayerOps]:
    """(the CPU kernels' level, the step kernels, the layer ops) a model already on `device`, its activations in
    `dtype`, is planned with, as its backend would plan it: for code that plans a model outside an engine (eval's
    forward, the tests' harness)."""
    kind = backend_kind(device)
    level = native.level_of(kernels) if kind.runs_cpu_kernels else None
    return level, kind.kernels_at(level), kind.ops_at(level, dtype)


def keeps_gguf_blocks(model: str | None, quantization: str, load_format: str, device: str,
                      tensor_parallel_size: int = 1) -> bool:
    """Whether the loader runs a GGUF's tensors in their own blocks (the CPU block kernels): quantization auto on
    a GGUF file (the embedded model when none is named), real weights, one CPU rank."""
    if quantization != "auto" or load_format == "dummy" or tensor_parallel_size > 1:
        return False
    return torch.device(device).type == "cpu" and (not model or Path(model).expanduser().is_file())


def rank_device(device: str, rank: int, world_size: int, gpus: int | None = None) -> torch.device:
    """The device rank `rank` runs on: the CPU for every rank; on CUDA, GPU rank % `gpus` of its host (`gpus`:
    the host's count, torch.cuda.device_count() unless given), so ranks spread over hosts alike take their
    GPUs in rank order, as vLLM's local ranks do. Tensor parallel names the device "cuda", not one GPU."""
    chosen = torch.device(device)
    if chosen.type != "cuda" or world_size == 1:
        return chosen
    if chosen.index is not None:
        raise ValueError(f"device: tensor parallel over {world_size} GPUs takes device 'cuda' (each rank runs on "
                         f"its own GPU), not one GPU ({device!r})")
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus < 1:
        raise ValueError("device: 'cuda', but this host sees no GPU")
    return torch.device("cuda", rank % gpus)


def wants_decode_graphs(enforce_eager: bool | None, kind: type[Backend]) -> bool:
    """Decode graphs for a backend of `kind`: asked for (enforce_eager False), or unset where it captures them."""
    return enforce_eager is False or (enforce_eager is None and kind.captures_graphs)


def choose_backend(config: EngineConfig, rank: int = 0) -> Backend:
    """Rank `rank`'s backend for `config` (every kernel its level promises built now: a failure raises
    KernelBuildError). "auto" dtypes follow the level and the weights (a GGUF's blocks: fp32 with fp16 K/V)."""
    mc, world = config.model, config.parallel.tensor_parallel_size
    device = rank_device(mc.device, rank, world)
    kernels = select_kernels(config.kernels, mc.device)  # before loading: layouts follow the level's
    blocks = keeps_gguf_blocks(mc.model, mc.quantization, mc.load_format, device.type, world)
    level, kv = kernels.level, config.cache.kv_cache_dtype
    narrow = narrow_dtype(mc.dtype, device.type, level, blocks, kv)
    kind = backend_kind(device)
    return kind(device, level, kernels.description, blocks, DTYPES[compute_dtype(mc.dtype, device.type, level, blocks)],
                DTYPES[kv_cache_dtype(kv, mc.dtype, device.type, level, blocks)], DTYPES[narrow] if narrow else None,
                wants_decode_graphs(mc.enforce_eager, kind), mc.cuda_graph_sizes, mc.enforce_eager is False)
