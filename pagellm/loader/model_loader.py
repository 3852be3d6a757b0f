"""Load a model and its tokenizer from a GGUF file, an HF checkpoint directory, or the embedded default."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from pagellm.config import KernelConfig
from pagellm.layers.dense import DenseLinear, use_dense_kernels
from pagellm.loader.dummy import dummy_weights
from pagellm.platform import release_freed_heap
from pagellm.loader.gguf import fill_block_cache, gguf_weight_types, iter_gguf_weights, load_gguf_config
from pagellm.loader.gguf_hybrid import OUT_PROJ_TILED
from pagellm.loader.gguf_file import read_gguf_header
from pagellm.loader.quantization import load_quantized, plan_quantization, weight_bytes, weight_schemes
from pagellm.loader.repack_cache import RepackCache
from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config
from pagellm.kernels.build import native
from pagellm.kernels.cpu import quant_gemv
from pagellm.layers.gated_delta_net import recurrent_state_dtype
from pagellm.layers.quantized import Int4Linear
from pagellm.loader.tokenizer import Tokenizer, has_tokenizer, load_tokenizer
from pagellm.models.registry import build_model

logger = logging.getLogger("pagellm.loader")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: object  # transformers PretrainedConfig
    tokenizer: Tokenizer | None
    path: Path
    quantization: dict[str, str] = field(default_factory=dict)  # {module path: "int8" | "int4" | "gguf"}


def settle_activations(model: nn.Module, kernels: KernelConfig, level: str | None) -> None:
    """int4 layers in the native layout take int8 activations where that kernel runs (every level with a
    compiler) unless switched off. Before join_projections: a joined layer copies its parts' setting."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.int8_activations = (module.layout.native and kernels.int8_activations
                                       and quant_gemv.q8_available(level))


def join_projections(model: nn.Module) -> int:
    """Join each attention's q/k/v and each MLP's gate/up projections into one matmul (after sharding and
    quantization, which work per checkpoint name); returns how many were joined."""
    return sum(module.join_projections() for module in list(model.modules()) if hasattr(module, "join_projections"))


def checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() under the checkpoint's names: joined dense projections split back into q/k/v_proj
    and gate/up_proj (as views, no copies), for handing the weights to HF transformers or writing a
    checkpoint. A joined quantized projection is a ValueError (its buffers have no checkpoint names)."""
    state = {}
    for name, tensor in model.state_dict().items():
        path, _, leaf = name.rpartition(".")
        owner, _, attr = path.rpartition(".")
        module = model.get_submodule(owner) if attr in ("qkv_proj", "gate_up_proj") else None
        joined = getattr(module, attr, None)
        if module is not None and hasattr(module, "join_projections") and type(joined) not in (nn.Linear, DenseLinear):
            raise ValueError(f"{owner}.{attr} is a joined {type(joined).__name__}: checkpoint_state_dict splits "
                             "dense projections only (dequantize first)")
        if attr == "qkv_proj" and hasattr(module, "num_kv_heads"):
            sizes = [module.num_heads * module.head_dim] + [module.num_kv_heads * module.head_dim] * 2
            state.update({f"{owner}.{part}.{leaf}": t for part, t in zip(("q_proj", "k_proj", "v_proj"),
                                                                         tensor.split(sizes))})
        elif attr == "gate_up_proj" and hasattr(module, "join_projections"):
            state.update({f"{owner}.{part}.{leaf}": t for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2))})
        else:
            state[name] = tensor
    return state


def _log_gpu_weights(net: nn.Module, path: Path, plan: dict[str, str], dtype: torch.dtype) -> None:
    """What a GGUF takes on a GPU beside its file (kept in planes, or dequantized with --quantization none)."""
    held, size = weight_bytes(net) / 2**30, path.stat().st_size / 2**30
    if plan:
        from pagellm.kernels.gpu.gguf_matmul import describe_crossovers  # Triton: imported where it runs

        logger.info("GGUF on the GPU: %d layers in their blocks (planes), weights %.2f GiB for a %.2f GiB file "
                    "(%.3fx); matmuls by rows M: %s", len(plan), held, size, held / size, describe_crossovers())
    else:
        logger.info("GGUF on the GPU: weights dequantized to %s at load, %.2f GiB for a %.2f GiB file (%.2fx)",
                    str(dtype).removeprefix("torch."), held, size, held / size)


def resolve_model_path(model: str | None) -> Path:
    if model is None or model == "":
        from pagellm.loader.default_model import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model not found: {model} (expected a .gguf file or an HF checkpoint directory)")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {model} is not a .gguf file; pass a GGUF file or an HF checkpoint directory")
    return path


class WeightShard(Protocol):
    """One rank's part of a model (distributed/sharding.ShardSpec): the loader builds and fills what it says and
    knows nothing of ranks."""

    world_size: int

    def model_config(self, hf_config):
        """The config of this rank's part (its head counts and sizes)."""

    def install(self, model: torch.nn.Module, hf_config) -> None:
        """Changes to the built model before weights arrive (expert parallel: this rank's experts only)."""

    def weights(self, weights: Iterable, hf_config) -> Iterator:
        """This rank's slice of each (HF name, weight) streamed in."""


def _build_net(hf_config, dtype: torch.dtype, device, shard, state_dtype: str, mtp: bool):
    """(the config the weights are read with, the model on the meta device): this rank's shapes, the recurrent
    state's dtype set on its layers, its MTP head built when asked (one rank only)."""
    if mtp and shard is not None:
        raise ValueError("speculative_config method mtp runs on one rank: not with tensor parallel yet")
    if shard is not None and getattr(hf_config, OUT_PROJ_TILED, False):
        hf_config = hf_config.replace(**{OUT_PROJ_TILED: False})  # a shard splits out_proj's columns in HF's order
    net = build_model(shard.model_config(hf_config) if shard else hf_config, dtype, device, mtp=mtp)
    state_layers = getattr(net, "state_layers", list)()
    kept_in = recurrent_state_dtype(state_dtype, hf_config) if state_layers else None
    for layer in state_layers:
        layer.state_dtype = kept_in
    return hf_config, net


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               with_tokenizer: bool = True, quantization: str = "none", shard: WeightShard | None = None,
               kernels: KernelConfig | None = None, load_format: str = "auto",
               cache_dir: str | None = None, gguf_layout: str | None = None,
               state_dtype: str = "auto", mtp: bool = False) -> LoadedModel:
    """quantization: none | int8 | int4 | auto (GGUF as stored; see loader/quantization.py), applied as weights
    stream in.

    load_format: auto (the file's weights) | dummy (random weights from the config: loader/dummy.py; "auto"
    quantization is then none, and the tokenizer is loaded only where there is one).

    shard: tensor / expert parallel rank (WeightShard: distributed/sharding.ShardSpec): the model is built with
    this rank's shapes and only its slice of each weight is kept; `hf_config` stays the full model's.
    kernels: the switches that decide how layers run (int8 activations, bound layers; default: KernelConfig()).
    cache_dir: where what a load derives from the file is kept for the next: the converted tokenizer
    (loader/tokenizer_cache.py) and a GGUF's blocks in the kernels' layout (loader/repack_cache.py); None: not kept.
    gguf_layout: which device's layout a GGUF's blocks are kept in, "cpu" (repacked for the CPU kernels) or "cuda"
    (planes for a GPU's); None: the device's own (a test plans a GPU's layout on a CPU).
    state_dtype: a hybrid model's recurrent state's dtype (CacheConfig.mamba_ssm_cache_dtype), set on its layers
    before the runner sizes and binds the state.
    mtp: with the checkpoint's MTP head (speculative_config method mtp: models/mtp.py), from HF weights, a hybrid
    GGUF's nextn layers or dummy weights, on one rank.
    """
    kernels = kernels or KernelConfig()
    # the CPU kernels' level the layouts are chosen for (the runner's plan binds the modules to the same)
    level = native.level_of(kernels) if torch.device(device).type == "cpu" else None
    path = resolve_model_path(model)
    # First: rebuilding a GGUF's tokenizer peaks at a few hundred MB of temporaries, which then never stack on
    # the weights already loaded (the process's peak RSS is what a user sees).
    dummy = load_format == "dummy"
    if with_tokenizer and dummy and not has_tokenizer(path):
        logger.info("load format dummy: %s has no tokenizer; prompts must be token ids", path)
        with_tokenizer = False
    is_gguf = path.is_file()
    header = read_gguf_header(path) if is_gguf else None  # once a load: it parses the whole vocabulary
    tokenizer = load_tokenizer(path, cache_dir, header) if with_tokenizer else None
    release_freed_heap()  # the tokenizer's parsing temporaries: not resident under the weights
    hf_config = load_gguf_config(header) if is_gguf else load_hf_config(path)
    shard = shard if shard is not None and shard.world_size > 1 else None
    hf_config, net = _build_net(hf_config, dtype, device, shard, state_dtype, mtp)
    # HF's names, which a GGUF's tensors are matched to (a shard's are the same): read once, here
    parameters = tuple(net.state_dict()) if is_gguf else None
    if shard:
        shard.install(net, hf_config)
    on = torch.device(device).type
    layout = gguf_layout or on
    if quantization == "auto" and (shard is not None or dummy or not is_gguf and on != "cpu"):
        # shards split float weights, random weights have no file types: the default must refuse neither
        quantization = "none"
    types = gguf_weight_types(header, hf_config, parameters) if is_gguf and quantization == "auto" else None
    # a GPU keeps a GGUF's blocks as planes for its kernels (kernels/gpu/gguf_matmul.py); a CPU its repacked blocks
    plan = plan_quantization(net, quantization, level, types, blocks_on=layout)
    if on != "cpu" and any(scheme not in ("gguf_planes", "gguf_planes_experts") for scheme in plan.values()):
        raise ValueError(f"quantization={quantization!r} runs on CPU only (torch's int8/int4 CPU kernels), "
                         f"not on device {str(device)!r}")
    schemes, blocks = weight_schemes(net, plan), None  # the repacked-blocks cache holds only "gguf" weights
    if is_gguf and cache_dir and not dummy and "gguf" in schemes.values():
        blocks = _whole_entry(RepackCache.for_file(Path(cache_dir), path, header), header, hf_config, schemes,
                              parameters, level)
    if dummy:
        weights = dummy_weights(net, device)  # already this rank's shapes: the model was built with them
    elif is_gguf:
        weights = iter_gguf_weights(header, hf_config, quantized=schemes, blocks=blocks, parameters=parameters,
                                    dequantize_on=torch.device(device) if on != "cpu" else None, level=level)
    else:
        weights = iter_safetensors_weights(path)
    if shard and not dummy:
        weights = shard.weights(weights, hf_config)
    load_quantized(net, weights, plan, level)
    if on != "cpu" and is_gguf:
        _log_gpu_weights(net, path, plan, dtype)
    settle_activations(net, kernels, level)
    join_projections(net)  # the layers' plan is the runner's (models/bound_layers.plan_model)
    if on == "cpu":
        use_dense_kernels(net, level)  # a few bf16 rows through the native kernel (layers/dense.py)
    if blocks is not None:
        blocks.release()  # after the joins: the blocks they copied never come back into the resident set
    net.eval()
    return LoadedModel(net, hf_config, tokenizer, path, plan)


def _whole_entry(blocks: RepackCache, header, hf_config, schemes: dict[str, str], parameters: tuple[str, ...],
                 level: str | None) -> RepackCache | None:
    """The file's block cache entry, whole. A miss is written first, a weight at a time (fill_block_cache), and
    the load then maps it as every later start does: its weights are the map's pages (a MoE's unrouted experts
    never read), never heap copies, and its peak holds a layer's blocks rather than the model's. None when the
    entry could not be written, or the disk has no room for it (the load repacks into the heap, as with no
    cache)."""
    if blocks.hit:
        return blocks
    file_bytes = header.path.stat().st_size
    if not blocks.has_room(file_bytes):
        return None
    # said: on a large file this start takes minutes where every later one takes seconds
    logger.info("weight cache: repacking %s's blocks for the CPU kernels into %s, once (about %.1f GiB on disk; "
                "later starts map them)", header.path.name, blocks.entry, file_bytes / 2**30)
    started = time.perf_counter()
    fill_block_cache(header, hf_config, schemes, blocks, parameters, level)
    release_freed_heap()  # the repacking's freed temporaries: not resident under the weights mapped next
    blocks = blocks.reopened()
    if blocks.hit:
        logger.info("weight cache: written in %.1f s", time.perf_counter() - started)
    return blocks if blocks.hit else None
