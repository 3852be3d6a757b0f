"""The kernel settings (config.KernelConfig): cpu_isa validated against the CPU, on every command, reported."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.cli import build_parser, engine_config_from_args
from pagellm.config import CacheConfig, EngineConfig, KernelConfig, ModelConfig
from pagellm.kernels.build import native
from pagellm.kernels import selection
from pagellm.kernels.build.errors import KernelBuildError
from pagellm.layers.kernel_user import KernelUser
from pagellm.runner.backend import backend_kind, wants_decode_graphs
from tests.kernels import EVERY_KERNEL, kernels_at, requires_compiler


def test_unknown_level_is_a_clear_error():
    with pytest.raises(ValueError, match="cpu_isa must be one of auto, avx512, avx2, generic"):
        KernelConfig(cpu_isa="avx9")


def test_a_level_the_cpu_lacks_names_what_is_missing(monkeypatch):
    avx2_only = native.LEVEL_CPU_FLAGS["avx2"] | {"sse4_2"}
    monkeypatch.setattr(native, "cpu_flags", lambda: avx2_only)
    assert native.host_levels() == ("avx2", "generic")
    assert native.resolve("auto") == "avx2"
    with pytest.raises(ValueError, match=r"cpu_isa 'avx512' needs .*avx512_bf16.* it can run avx2, generic"):
        native.resolve("avx512")
    with pytest.raises(ValueError, match="^cpu_isa: "):
        selection.select_kernels(KernelConfig(cpu_isa="avx512"))


def test_environment_sets_defaults_read_in_the_config(monkeypatch):
    monkeypatch.setenv("PAGELLM_CPU_ISA", "generic")
    monkeypatch.setenv("PAGELLM_BOUND_LAYERS", "0")
    config = KernelConfig()
    assert config.cpu_isa == "generic" and not config.bound_layers and config.int8_activations
    assert EngineConfig().kernels == config
    monkeypatch.setenv("PAGELLM_CPU_ISA", "")  # `PAGELLM_CPU_ISA= pagellm serve`: unset, as a shell user means it
    assert KernelConfig().cpu_isa == "auto"


def test_every_engine_command_takes_the_kernel_flags():
    for command in (["generate", "--prompt", "x"], ["serve"]):
        args = build_parser().parse_args([*command, "--cpu-isa", "generic", "--no-bound-layers",
                                          "--no-int8-activations"])
        kernels = engine_config_from_args(args).kernels
        assert (kernels.cpu_isa, kernels.bound_layers, kernels.int8_activations) == ("generic", False, False)
    assert build_parser().parse_args(["bench", "batched", "--cpu-isa", "avx2"]).cpu_isa == "avx2"


def test_kv_cache_dtype_auto_is_16_bits_under_an_auto_fp32_on_cpu():
    """auto: 16-bit K/V where auto chose fp32 compute on a CPU (fp16 for a GGUF's blocks, as llama.cpp stores
    them; bf16 for the rest); the compute dtype wherever a dtype was named."""
    assert selection.kv_cache_dtype("auto", None, "cpu", "avx2") == "bfloat16"
    for level in ("avx2", "generic"):
        assert selection.kv_cache_dtype("auto", None, "cpu", level, gguf_blocks=True) == "float16"
    assert selection.kv_cache_dtype("auto", None, "cpu", "avx512", gguf_blocks=True) == "float16"
    assert selection.kv_cache_dtype("auto", "float32", "cpu", "avx2", gguf_blocks=True) == "float32"
    assert selection.kv_cache_dtype("auto", None, "cpu", None, gguf_blocks=True) == "float32"
    assert selection.kv_cache_dtype("auto", "auto", "cpu", "avx2") == "bfloat16"
    assert selection.kv_cache_dtype("auto", "float32", "cpu", "avx2") == "float32"  # the HF-parity mode stays fp32
    assert selection.kv_cache_dtype("auto", "float16", "cpu", "avx2") == "float16"
    assert selection.kv_cache_dtype("float32", None, "cpu", "avx2") == "float32"
    assert selection.kv_cache_dtype("auto", None, "cpu", "avx512") == "bfloat16"  # the compute dtype itself
    assert selection.kv_cache_dtype("auto", None, "cpu", None) == "float32"  # torch's ops: nothing to gain
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, bfloat16 or float16, got 'int8'"):
        CacheConfig(kv_cache_dtype="int8")
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "float32"])
    assert engine_config_from_args(args).cache.kv_cache_dtype == "float32"


@pytest.mark.parametrize("bf16_gpu", [True, False])
def test_auto_dtype_on_cuda_is_bf16_or_fp16_and_the_cache_follows(monkeypatch, bf16_gpu):
    """As vLLM: bf16 on a GPU that computes it (Ampere and later), fp16 on older ones; K/V in the same dtype."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_gpu)
    expected = "bfloat16" if bf16_gpu else "float16"
    for device in ("cuda", "cuda:1"):
        assert selection.compute_dtype(None, device, None) == selection.compute_dtype("auto", device, None) == expected
        assert selection.kv_cache_dtype("auto", None, device, None) == expected
    assert selection.compute_dtype("float32", "cuda", None) == "float32"  # a dtype named is kept
    assert selection.kv_cache_dtype("auto", "float32", "cuda", None) == "float32"
    assert selection.compute_dtype(None, "meta", None) == "float32"  # other devices


def test_llm_runs_the_level_asked_and_reports_every_kernel():
    """The engine's level reaches every module through its plan, and nothing process-wide changes."""
    llm = LLM(cpu_isa="generic", kv_cache_memory=0.05, max_model_len=64, skip_tokenizer_init=True)
    engine = llm.engine
    assert engine.kernel_level == engine.runner.kernel_level == "generic"
    assert selection.kernel_levels("generic") == kernels_at("generic")  # the whole set, not a prefix
    assert llm.stats()["kernels"] == selection.describe("generic")
    assert llm.stats()["layers"] == "bound to the kernels at generic (18 layers)"  # the embedded model, planned once
    assert (llm.stats()["dtype"], llm.stats()["kv_cache_dtype"]) == ("float32", "float16")  # a GGUF's auto there
    levels = {m.kernel_level for m in engine.model.modules() if isinstance(m, KernelUser)}
    assert levels == {"generic"}  # every module that calls a CPU kernel, bound by the plan
    ops = {m.ops.name for m in engine.model.modules() if isinstance(m, KernelUser)}
    assert ops == {"the kernels at generic"}  # and every module's table of layer ops
    assert engine.runner.sampler._argmax.keywords == {"at": "generic"}  # the sampler's argmax, chosen once
    params = SamplingParams(max_tokens=2)  # that it runs: a generic step of this model is slow
    out = llm.generate([[2, 818, 5279, 529, 7001, 563]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 2
    llm.shutdown()


@requires_compiler
@pytest.mark.parametrize("level", native.host_levels())
def test_every_kernel_the_level_promises_builds(level):
    """Each host level builds every kernel it promises (a KernelBuildError here otherwise), and says so."""
    assert selection.kernel_levels(level) == kernels_at(level)


@requires_compiler
def test_the_kernels_line_names_every_kernel_and_where_it_runs():
    # generic: the one level every host has, with no extensions
    assert selection.describe("generic") == (
        "generic (GGUF blocks x int8 matmul, int4 x int8 matmul, int4 weight layout, paged attention, fused "
        "layer ops, logits epilogue, Gated DeltaNet decode, RMS norm, rotary embedding, fp32 matmul of "
        "batch-independent rows, GGUF block layout at load); torch reference ops: "
        "int4/int8 x bf16 matmul, sampled-token draw, bf16 x bf16 matmul of a few rows (not at generic)")
    if "avx512" in native.host_levels():
        assert selection.describe("avx512") == "avx512 (" + ", ".join(EVERY_KERNEL) + ")"


def test_native_kernels_off_is_said_as_such():
    assert selection.select_kernels(KernelConfig(native_kernels=False)) == selection.Kernels(
        None, "off (torch reference ops)")
    assert set(selection.kernel_levels(None).values()) == {"torch"}


def fresh_kernels(monkeypatch, compiler: str | None) -> None:
    """The kernels as a new process would find them with `compiler` (None: none), over an empty cache."""
    monkeypatch.setattr(native, "compiler", lambda: compiler)
    monkeypatch.setattr(native, "_load", functools.cache(native._load.__wrapped__))  # nothing kept from before
    fresh = tuple(native.Library(lib.name, lib.functions.values(), lib.title, lib.levels, lib.exports_if,
                                 lib.extensions) for lib in selection.LIBRARIES)  # none of this process's builds
    monkeypatch.setattr(selection, "LIBRARIES", fresh)


def test_a_broken_build_stops_a_cpu_engine_only(monkeypatch, tmp_path):
    """A compiler that fails every build: selecting kernels for a CPU model raises, names the first kernel and the
    level and says how to run anyway; for a model on another device, which runs none of the CPU kernels, nothing
    is built and nothing fails."""
    monkeypatch.setenv("PAGELLM_KERNEL_CACHE", str(tmp_path))
    fresh_kernels(monkeypatch, "false")  # POSIX false: exits 1, says nothing
    with pytest.raises(KernelBuildError, match=r"(?s)^GGUF blocks x int8 matmul: native kernel 'quant_gguf' "
                                               r"failed to build at level generic: false failed on quant_gguf.cpp"
                                               r".*a lower --cpu-isa, or --no-native-kernels"):
        selection.select_kernels(KernelConfig(cpu_isa="generic"))
    assert selection.select_kernels(KernelConfig(cpu_isa="generic"), "cuda:0") == selection.Kernels(
        None, "CPU kernels not used on cuda (see the backend line)")


def test_without_a_compiler_the_fallback_is_logged_once_naming_every_kernel(monkeypatch, caplog):
    """The one case that runs torch with native kernels on: no compiler at all (a build failure raises)."""
    fresh_kernels(monkeypatch, None)
    with caplog.at_level(logging.INFO, logger="pagellm.kernels"):
        chosen = selection.select_kernels(KernelConfig(cpu_isa="generic"))
    description = chosen.description
    assert chosen.level == "generic" and description == ("generic: no C++ compiler (set CXX or install g++), torch reference ops for "
                           + ", ".join(EVERY_KERNEL))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", f"kernels: {description}")]


def test_decode_graph_flags_reach_the_config_and_are_checked():
    """--no-enforce-eager and --cuda-graph-sizes (vLLM's flags): on CUDA only, sizes only with graphs."""
    args = build_parser().parse_args(["serve", "--device", "cuda", "--no-enforce-eager", "--cuda-graph-sizes",
                                      "8", "1", "4", "4"])
    model = engine_config_from_args(args).model
    assert model.enforce_eager is False and model.cuda_graph_sizes == (1, 4, 8)  # ascending, once each
    assert engine_config_from_args(build_parser().parse_args(["serve"])).model.enforce_eager is None
    # unset: graphs on CUDA (measured on an H200), none elsewhere; --enforce-eager turns them off
    def graphs(model: ModelConfig) -> bool:  # as the backend decides them
        return wants_decode_graphs(model.enforce_eager, backend_kind(torch.device(model.device)))
    assert graphs(ModelConfig(device="cuda")) and graphs(ModelConfig(device="cuda:1"))
    assert not graphs(ModelConfig()) and not graphs(ModelConfig(device="cuda", enforce_eager=True))
    assert graphs(engine_config_from_args(build_parser().parse_args(["serve", "--device", "cuda", "--enforce-eager"])
                                          ).model) is False
    assert ModelConfig(device="cuda", cuda_graph_sizes=(2, 1)).cuda_graph_sizes == (1, 2)
    with pytest.raises(ValueError, match="device 'cpu' has none"):
        ModelConfig(enforce_eager=False)
    with pytest.raises(ValueError, match="need a CUDA device and no enforce_eager"):
        ModelConfig(device="cuda", enforce_eager=True, cuda_graph_sizes=(1, 2))
    with pytest.raises(ValueError, match="need a CUDA device and no enforce_eager"):
        ModelConfig(cuda_graph_sizes=(1, 2))
    with pytest.raises(ValueError, match="integers >= 1"):
        ModelConfig(device="cuda", enforce_eager=False, cuda_graph_sizes=(0, 2))
    assert ModelConfig.from_dict({"device": "cuda:1", "enforce_eager": False,
                                  "cuda_graph_sizes": [2, 1]}).cuda_graph_sizes == (1, 2)
