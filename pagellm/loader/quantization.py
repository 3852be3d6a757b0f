"""Weight quantization of a model: which layers become int8 / int4, applied as each weight streams in at load
(`load_quantized`) or to a loaded dense model (`quantize_model`); `weight_bytes` measures the result.

    none   every weight dense, in the model dtype
    int8   every linear layer and the token table: per-row int8 (layers/quantized.py)
    int4   every linear layer and the token table: int4, groups of 32
    auto   GGUF: every tensor as the file stores it. The kernel formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
           Q5_K, Q6_K) stay in their blocks, bit for bit (layers/gguf_linear.py); float tensors stay dense; other
           quantized types are dequantized at load, with a warning naming them. Where the block kernels cannot
           run (no compiler, native kernels off), `auto` falls back to the file's precision budget: <= 5.5 bits
           per weight -> int4, other quantized types -> int8. Sharded loads (model_loader) take `auto` as none.
           An HF checkpoint stores floats, so `auto` is `none` there.

A layer the kernels cannot take (K not a multiple of 32; for int4, N not a multiple of 16) stays dense, and so
do MoE routers (`mlp.gate`, `shared_expert_gate`): they are tiny, and their top-k choice is discrete, so a small
weight error can send a token to other experts.

Streaming: before loading, each layer to quantize is swapped for a placeholder that has its bias parameter
(loaded as usual) but no weight; when the weight arrives it is quantized and the placeholder replaced. From a
GGUF such a weight arrives as LazyRows (dequantized 1024 rows at a time as the quantizer reads it) or as int4
codes (gguf_quant.py), so its float copy never exists whole; from safetensors, one tensor at a time (peak RSS
measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md).
Weight names are matched to layers after the model's own renames (`model.checkpoint_renames`, if it has them:
e.g. Qwen3.5 weights saved under its vision-language wrapper's `model.language_model.` prefix).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping

import gguf
import torch
from torch import nn

from pagellm.config import QUANTIZATION_SCHEMES
from pagellm.kernels.cpu import gguf_blocks
from pagellm.kernels.reference import gguf_planes
from pagellm.loader import gguf_repack
from pagellm.layers.gguf_moe import GGUFMoeExperts, GGUFPlanesExperts
from pagellm.layers.moe import EXPERT_KEY, MoeExperts, SparseMoeBlock
from pagellm.layers.gguf_linear import GGUFLinear
from pagellm.layers.gguf_planes import GGUFPlanesLinear
from pagellm.layers.quantized import GroupAffine, QuantizedLinear, can_quantize, quantized_module

_FLOAT_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                          gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F64})
_INT4_MAX_BITS = 5.5  # Q5_0 / Q5_K: 5.5 bits per weight


def auto_scheme(ggml_type: gguf.GGMLQuantizationType | None) -> str | None:
    """The int4 / int8 scheme `auto` falls back to for a tensor stored as `ggml_type`: None keeps it dense."""
    if ggml_type is None or ggml_type in _FLOAT_TYPES or ggml_type not in gguf.GGML_QUANT_SIZES:
        return None
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    return "int4" if type_size * 8 / block_size <= _INT4_MAX_BITS else "int8"


def plan_quantization(model: nn.Module, scheme: str, level: str | None,
                      weight_types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
                      blocks_on: str | None = "cpu") -> dict[str, str]:
    """{module path: "int8" | "int4" | "gguf" | "gguf_planes" | their "_experts" (a MoE layer's experts)};
    `weight_types` ({HF name: ggml type}) is what `auto` follows, keeping tensors in their GGUF blocks where
    `blocks_on` says: "cpu" (the CPU block kernels, where they run at `level`), "cuda" (planes: a GPU's
    kernels), None (never)."""
    if scheme not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, got {scheme!r}")
    if scheme == "none" or (scheme == "auto" and weight_types is None):
        return {}
    blocks = scheme == "auto" and (blocks_on == "cuda" or blocks_on == "cpu" and gguf_blocks.available(level))
    kept = _BLOCK_SCHEMES[blocks_on] if blocks else None
    plan, routers, dequantized = {}, router_paths(model), {}
    for path, module in model.named_modules():
        if blocks and isinstance(module, MoeExperts):
            if _experts_in_blocks(path, module, weight_types, kept):
                plan[path] = f"{kept}_experts"
            else:  # dense experts: note the quantized types that had no kernel
                for stored in {weight_types.get(name) for name in _expert_names(path, module)} - {None, *_FLOAT_TYPES}:
                    dequantized.setdefault(stored.name, []).append(path)
        if not isinstance(module, (nn.Linear, nn.Embedding)) or path in routers:
            continue
        stored = weight_types.get(f"{path}.weight") if scheme == "auto" else None
        if blocks:
            chosen = _block_scheme(stored, *module.weight.shape, kept)
            if chosen is None and stored is not None and stored not in _FLOAT_TYPES:
                dequantized.setdefault(stored.name, []).append(path)
        else:
            chosen = scheme if scheme != "auto" else auto_scheme(stored)
        if chosen is not None and (chosen == kept or can_quantize(chosen, *module.weight.shape)):
            plan[path] = chosen
    for name, paths in dequantized.items():
        warnings.warn(f"pagellm: {len(paths)} {name} tensor(s) (e.g. {paths[0]}) have no block kernel here and are "
                      f"dequantized at load", RuntimeWarning, stacklevel=2)
    return plan


_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _expert_names(path: str, experts: MoeExperts) -> list[str]:
    return [f"{path}.{e}.{proj}.weight" for e in range(experts.num_experts) for proj in _EXPERT_PROJECTIONS]


def _experts_in_blocks(path: str, experts: MoeExperts, weight_types: Mapping[str, gguf.GGMLQuantizationType],
                       kept: str) -> bool:
    """Whether every expert of the layer is stored in a kernel format its shapes allow."""
    inter, hidden = experts.intermediate_size, experts.hidden_size
    return all(_block_scheme(weight_types.get(name), *((hidden, inter) if ".down_proj." in name else (inter, hidden)),
                             kept) for name in _expert_names(path, experts))


def weight_schemes(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """{weight name: scheme} of a plan, as the GGUF reader takes it (experts kept in blocks: each expert's)."""
    schemes = {}
    for path, scheme in plan.items():
        if scheme.endswith("_experts"):
            each = scheme.removesuffix("_experts")
            schemes.update(dict.fromkeys(_expert_names(path, model.get_submodule(path)), each))
        else:
            schemes[f"{path}.weight"] = scheme
    return schemes


_BLOCK_SCHEMES = {"cpu": "gguf", "cuda": "gguf_planes"}  # where blocks are kept -> the scheme of their layers
_SUPPORTS = {"gguf": gguf_repack.supports, "gguf_planes": gguf_planes.supports}


def _block_scheme(ggml_type: gguf.GGMLQuantizationType | None, rows: int, cols: int, kept: str) -> str | None:
    return kept if ggml_type is not None and _SUPPORTS[kept](ggml_type, rows, cols) else None


def router_paths(model: nn.Module) -> set[str]:
    """Module paths of the MoE routers: each SparseMoeBlock's `gate` and, if it has one, `shared_expert_gate`."""
    return {f"{path}.{router}" for path, module in model.named_modules() if isinstance(module, SparseMoeBlock)
            for router in ("gate", "shared_expert_gate") if hasattr(module, router)}


class _PendingWeight(nn.Module):
    """Stands in for a layer until its weight arrives: holds the bias parameter, no weight."""

    def __init__(self, module: nn.Module, scheme: str, level: str | None, device: torch.device):
        super().__init__()
        self.scheme, self.embedding, self.level = scheme, isinstance(module, nn.Embedding), level
        self.shape, self.dtype = tuple(module.weight.shape), module.weight.dtype
        self.device = device  # where the model's weights go (its modules wait on the meta device)
        self.bias = getattr(module, "bias", None)

    def build(self, weight: torch.Tensor | GroupAffine | gguf_blocks.GGUFWeight) -> nn.Module:
        return quantized_module(self.scheme, weight, self.level, bias=self.bias, embedding=self.embedding,
                                dtype=self.dtype, device=self.device)


def load_quantized(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | GroupAffine]],
                   plan: Mapping[str, str], level: str | None) -> None:
    """`model.load_weights(weights)`, quantizing the weight of each layer in `plan` as it arrives, in the layouts
    of the CPU kernels' `level`."""
    pending, experts = {}, {}
    device = getattr(model, "load_device", torch.device("cpu"))
    for path, scheme in plan.items():
        module = model.get_submodule(path)
        if scheme.endswith("_experts"):
            sizes = (module.num_experts, module.hidden_size, module.intermediate_size, module.activation)
            experts[path] = (GGUFPlanesExperts(*sizes, device=device)
                             if scheme == "gguf_planes_experts" else GGUFMoeExperts(*sizes))
            experts[path].use_kernel_level(level)
            replace_module(model, path, experts[path])
            continue
        pending[path] = _PendingWeight(module, scheme, level, device)
        replace_module(model, path, pending[path])
    renames = getattr(model, "checkpoint_renames", None)
    if renames is not None:  # match names as load_weights will see them (it renames again: a no-op then)
        weights = renames(weights)
    model.load_weights(_quantize_as_loaded(model, pending, _experts_as_loaded(experts, weights)))
    if pending or experts:
        missing = sorted(f"{path}.weight" for path in pending) + sorted(f"{path}.*" for path in experts)
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s) of {type(model).__name__}: "
                         + ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else ""))


def _quantize_as_loaded(model: nn.Module, pending: dict[str, _PendingWeight],
                        weights: Iterable[tuple[str, torch.Tensor | GroupAffine]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass every weight through, except those of pending layers: quantize those and swap the layer in."""
    for name, tensor in weights:
        path, _, attr = name.rpartition(".")
        placeholder = pending.pop(path, None) if attr == "weight" else None
        if placeholder is None:
            yield name, tensor
            continue
        if tuple(tensor.shape) != placeholder.shape:
            raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model {placeholder.shape}")
        replace_module(model, path, placeholder.build(tensor))


def _experts_as_loaded(experts: dict[str, GGUFMoeExperts], weights: Iterable) -> Iterator:
    """Pass every weight through, except the per-expert blocks of layers kept in blocks: those go to the layer
    (removed from `experts` once it has them all)."""
    for name, tensor in weights:
        match = EXPERT_KEY.match(name)
        layer = experts.get(match["prefix"]) if match else None
        if layer is None:
            yield name, tensor
        elif layer.put(int(match["expert"]), match["proj"], tensor):
            del experts[match["prefix"]]


def replace_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def quantize_model(model: nn.Module, plan: str | Mapping[str, str], level: str | None) -> dict[str, str]:
    """Quantize a loaded dense model in place, in the layouts of the CPU kernels' `level`: `plan` is a scheme
    for every layer that takes it, or {module path: scheme}. Returns the plan applied."""
    if isinstance(plan, str):
        plan = plan_quantization(model, plan, level)
    for path, scheme in plan.items():
        module = model.get_submodule(path)
        replace_module(model, path, quantized_module(
            scheme, module.weight.detach(), level, bias=getattr(module, "bias", None),
            embedding=isinstance(module, nn.Embedding), dtype=module.weight.dtype))
    return dict(plan)


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of parameters and quantized-weight buffers, each storage counted once (tied tables)."""
    tensors = list(model.parameters())
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, GGUFLinear, GGUFPlanesLinear, GGUFMoeExperts)):
            tensors += list(module.buffers(recurse=False))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}
    return sum(storages.values())
