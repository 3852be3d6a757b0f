"""The device policy is derived once (runner/backend.py): the engine, every tensor-parallel rank, `eval` and `bench`
get the same backend for the same config, and what differs by device kind is the backend's answer."""

import dataclasses

import pytest
import torch

from pagellm.config import CacheConfig, EngineConfig, KernelConfig, ModelConfig, ParallelConfig
from pagellm.eval.forward import mode_backend
from pagellm.kernels.build import native
from pagellm.loader.default_model import default_model_path
from pagellm.runner.backend import CpuBackend, CudaBackend, backend_kind, choose_backend, rank_device
from tests.models.tiny_checkpoints import write_tiny_checkpoint


def test_the_engine_and_eval_get_the_same_backend_for_the_embedded_gguf(embedded_llm):
    backend = embedded_llm.engine.backend
    assert backend == choose_backend(EngineConfig()) == mode_backend(default_model_path())
    assert isinstance(backend, CpuBackend) and backend.gguf_blocks  # the file as stored: its blocks
    assert (backend.compute_dtype, backend.kv_cache_dtype) == (torch.float32, torch.float16)
    assert backend.level == native.default_level() and backend.narrow_dtype is None


@pytest.mark.parametrize("level", native.host_levels())
def test_every_rank_of_a_parallel_engine_gets_the_heads_backend(level):
    """A GGUF under tensor parallel runs dequantized (its blocks are one rank's layout): every rank alike, the
    dtypes that choice implies included (a worker that re-derived them once dropped the blocks rule)."""
    model = ModelConfig(model=str(default_model_path()))
    kernels = KernelConfig(cpu_isa=level)
    single = choose_backend(EngineConfig(model=model, kernels=kernels))
    parallel = EngineConfig(model=model, kernels=kernels, parallel=ParallelConfig(tensor_parallel_size=2))
    ranks = [choose_backend(parallel, rank) for rank in range(2)]
    assert ranks[0] == ranks[1] and not ranks[0].gguf_blocks and single.gguf_blocks
    assert ranks[0] == dataclasses.replace(single, gguf_blocks=False, **_dtypes_without_blocks(level))


def _dtypes_without_blocks(level: str) -> dict:
    """A dequantized GGUF's "auto" dtypes: as an HF checkpoint's (bf16 where the level computes it)."""
    compute = torch.bfloat16 if level == "avx512" else torch.float32
    return {"compute_dtype": compute, "kv_cache_dtype": torch.bfloat16, "narrow_dtype": None}


def test_bench_and_eval_modes_are_the_engines_for_the_same_flags(tmp_path):
    write_tiny_checkpoint("llama", tmp_path)
    kernels = KernelConfig(cpu_isa="generic")
    for dtype, kv in ((None, "auto"), ("float32", "bfloat16"), ("bfloat16", "auto")):
        engine = EngineConfig(model=ModelConfig(model=str(tmp_path), dtype=dtype), cache=CacheConfig(kv_cache_dtype=kv),
                              kernels=kernels)
        assert mode_backend(tmp_path, "auto", dtype, kv, kernels) == choose_backend(engine)


def test_device_kinds_answer_for_themselves():
    cpu = choose_backend(EngineConfig(kernels=KernelConfig(native_kernels=False)))
    assert (cpu.host_memory, cpu.captures_graphs, cpu.collective) == (True, False, "gloo")
    assert cpu.level is None and cpu.ops_description() == "torch reference ops"
    assert cpu.step_kernels()[0] is None  # the layers plan their modules, and say why
    native = choose_backend(EngineConfig())
    assert native.step_kernels()[0].name == f"the kernels at {native.level}"
    cuda = CudaBackend(torch.device("cuda", 0), None, "", False, torch.bfloat16, torch.bfloat16, None, True)
    assert (cuda.host_memory, cuda.captures_graphs, cuda.collective) == (False, True, "nccl")
    cuda.settle()  # nothing to give back: device memory is reserved whole
    assert rank_device("cuda", 3, 4, gpus=2) == torch.device("cuda", 1)


def test_a_device_without_a_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'mps'"):
        ModelConfig(device="mps")
    with pytest.raises(ValueError, match="pagellm runs on cpu or cuda, not 'meta'"):
        backend_kind(torch.device("meta"))
