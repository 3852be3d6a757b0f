"""A MoE layer's experts kept in their GGUF file's block formats: repacked for the CPU's kernels
(kernels/cpu/gguf_blocks.py), or in planes for a GPU's (kernels/reference/gguf_planes.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagellm.kernels.cpu import gguf_blocks
from pagellm.kernels.cpu.gguf_blocks import GGUFWeight
from pagellm.kernels.cpu.layer_ops import ACTIVATIONS
from pagellm.kernels.ops import FUSED_ACTIVATIONS, PER_TOKEN_MAX_TOKENS
from pagellm.kernels.reference import gguf_planes
from pagellm.kernels.reference.gguf_planes import PLANES, GGUFPlanes
from pagellm.layers.gguf_linear import merged_segments, stacked
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.moe import MoeExperts


def joins_gate_up(formats: Iterable) -> bool:
    """Whether a layer's experts, of these gate and up formats, hold each expert's gate and up as one weight (one
    format throughout); the block cache lays the experts out by the same rule (loader/repack_cache.py)."""
    return len(set(formats)) == 1


class GGUFMoeExperts(MoeExperts):
    """MoeExperts with every expert in its GGUF blocks (a MoE GGUF then needs about its file size in memory):
    per projection one stacked buffer [X, ...] of the experts' repacked blocks (within a layer every expert
    shares its tensor's format). The routing, grouping and summation are MoeExperts'; each active expert runs
    the block kernels over its rows, gate and up as one call when they share a format."""

    PARTS = ("qs", "gp", "sp")  # a weight's tensors, as GGUFWeight.tensors() gives them

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str):
        KernelUser.__init__(self)  # no dense parameters: experts arrive as blocks (put), then `finish`
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation = activation
        self._arriving: dict[str, dict[int, GGUFWeight]] = {"gate_proj": {}, "up_proj": {}, "down_proj": {}}
        self.formats: dict[str, object] = {}

    def put(self, expert: int, proj: str, weight: GGUFWeight) -> bool:
        """One expert's projection; returns whether every expert's every projection has arrived (then stacked)."""
        expected = (self.hidden_size, self.intermediate_size) if proj == "down_proj" else (
            self.intermediate_size, self.hidden_size)
        if weight.shape != expected or not 0 <= expert < self.num_experts or expert in self._arriving[proj]:
            raise ValueError(f"expert {expert} {proj}: shape {weight.shape} (model {expected}), out of range or "
                             "repeated")
        self._arriving[proj][expert] = weight
        if any(len(got) < self.num_experts for got in self._arriving.values()):
            return False
        self._stack()
        return True

    def _stack(self) -> None:
        arriving, self._arriving = self._arriving, {}
        gate, up = arriving["gate_proj"], arriving["up_proj"]
        joined = joins_gate_up(w.ggml_type for w in (*gate.values(), *up.values()))
        groups = {"gate_up": [self._joined([gate[e], up[e]]) for e in range(self.num_experts)]} if joined else {
            "gate": [gate[e] for e in range(self.num_experts)], "up": [up[e] for e in range(self.num_experts)]}
        groups["down"] = [arriving["down_proj"][e] for e in range(self.num_experts)]
        for name, weights in groups.items():
            if len({w.ggml_type for w in weights}) != 1:
                kinds = sorted({w.ggml_type.name for w in weights})
                raise ValueError(f"experts of one layer stored in several formats: {kinds}")
            self.formats[name] = weights[0].ggml_type
            for part, tensors in zip(self.PARTS, zip(*(w.tensors() for w in weights))):
                self.register_buffer(f"{name}_{part}", stacked(list(tensors)))  # [X, ...]

    @staticmethod
    def _joined(parts: list[GGUFWeight]) -> GGUFWeight:
        return merged_segments(parts)[0]

    def use_kernel_level(self, level: str | None) -> None:
        if not gguf_blocks.available(level):  # known when planning: the blocks have no other path
            raise ValueError(f"experts kept in their GGUF blocks need the native kernels, which do not run at "
                             f"level {level!r}: load the model with the level it runs at")
        super().use_kernel_level(level)

    def _weight(self, name: str, e: int) -> GGUFWeight:
        qs = self._buffers[f"{name}_qs"][e]
        cols = self.hidden_size if name != "down" else self.intermediate_size
        return GGUFWeight(self.formats[name], qs.shape[0] * gguf_blocks.BLOCK_ROWS, cols, qs,
                          self._buffers[f"{name}_gp"][e], self._buffers[f"{name}_sp"][e])

    def _kernels(self, e: int) -> tuple:
        """Expert e's (gate_up, down) kernels, bound once (views into the stacked buffers)."""
        bound = self.bindings
        if e not in bound:
            first = [self._weight("gate_up", e)] if "gate_up" in self.formats else [self._weight("gate", e),
                                                                                    self._weight("up", e)]
            bound[e] = (self._matmul(first), self._matmul([self._weight("down", e)]))
        return bound[e]

    def _matmul(self, weights: list[GGUFWeight]):
        return gguf_blocks.BoundMatmul(weights, None, self.kernel_level)

    def _rows(self, weight: GGUFWeight) -> torch.Tensor:
        return gguf_blocks.rows(weight, torch.arange(weight.rows), self.kernel_level)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:  # [n, E] -> [n, E] through expert e
        gate_up, down = self._kernels(e)
        return down(self.act_mul()(gate_up(x)).contiguous())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                first_expert: int | None = None) -> torch.Tensor:
        """Every routed expert of every token in one kernel call (each expert's weights read once over its tokens'
        rows, and no call per expert), where gate and up are joined, x is fp32 and the loop's act_mul is the
        native one; else MoeExperts' paths. The same bits either way (tests/kernels/test_gguf_moe.py)."""
        one_call = self.bound_to_tensors("one_call", self._one_call)
        if one_call is None or x.dtype != torch.float32 or weights.dtype != torch.float32:
            return super().forward(x, weights, ids, first_expert)
        return one_call(x, ids if first_expert is None else ids - first_expert, weights)

    def _one_call(self) -> gguf_blocks.BoundMoe | None:
        code = ACTIVATIONS.get(FUSED_ACTIVATIONS.get(self.activation))
        if "gate_up" not in self.formats or code is None or self.ops.act_mul is None:  # torch's act_mul: its bits
            return None
        gate_up, down = ((gguf_blocks.FORMAT_IDS[self.formats[name]],
                          *(self._buffers[f"{name}_{part}"] for part in self.PARTS)) for name in ("gate_up", "down"))
        return gguf_blocks.BoundMoe(gate_up, down, code, self.kernel_level)

    def dispatch(self, x: torch.Tensor) -> str:
        return "per_token" if x.shape[0] <= PER_TOKEN_MAX_TOKENS else "grouped_loop"  # no grouped_mm on blocks

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [X, 2I, E], down [X, E, I]) float32, as MoeExperts holds them (tests and references only)."""
        names = ["gate_up"] if "gate_up" in self.formats else ["gate", "up"]
        gate_up = torch.stack([torch.cat([self._rows(self._weight(n, e)) for n in names])
                               for e in range(self.num_experts)])
        return gate_up, torch.stack([self._rows(self._weight("down", e)) for e in range(self.num_experts)])


class GGUFPlanesExperts(GGUFMoeExperts):
    """GGUFMoeExperts in planes: each projection's planes stacked over the experts [X, N, ...]; an active
    expert's matmuls run on views of them through the device's kernels."""

    PARTS = PLANES

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 device: torch.device | str = "cpu"):
        super().__init__(num_experts, hidden_size, intermediate_size, activation)
        self.device = torch.device(device)

    def _stack(self) -> None:
        super()._stack()  # on the host, as the planes arrive: then each stacked plane moves once
        for name, tensor in self._buffers.items():
            self._buffers[name] = tensor.to(self.device)

    @staticmethod
    def _joined(parts: list[GGUFPlanes]) -> GGUFPlanes:
        return gguf_planes.joined(parts)

    def use_kernel_level(self, level: str | None) -> None:
        KernelUser.use_kernel_level(self, level)  # planes need no CPU kernel

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                first_expert: int | None = None) -> torch.Tensor:
        """The device's grouped kernel over every expert at once where it has one (CUDA: kernels/gpu/moe.py),
        else MoeExperts' dispatch, an expert at a time (expert parallel, and gate and up of two formats, too)."""
        grouped = self.ops.gguf_planes_moe
        if grouped is None or first_expert is not None or "gate_up" not in self.formats:
            return super().forward(x, weights, ids, first_expert)
        return grouped(x, weights, ids, self._stacked("gate_up"), self._stacked("down"), self.act_mul())

    def _one_call(self) -> None:
        return None  # planes: no CPU block kernel

    def _stacked(self, name: str) -> tuple:
        """(planes [X, rows, ...] x6, format, rows, cols) of one projection, as kernels/gpu/moe.py takes them."""
        planes = tuple(self._buffers[f"{name}_{part}"] for part in PLANES)
        return (planes, self.formats[name], planes[0].shape[1],
                self.intermediate_size if name == "down" else self.hidden_size)

    def _weight(self, name: str, e: int) -> GGUFPlanes:
        planes = [self._buffers[f"{name}_{part}"][e] for part in PLANES]
        return GGUFPlanes(self.formats[name], planes[0].shape[0],
                          self.intermediate_size if name == "down" else self.hidden_size, *planes)

    def _matmul(self, weights: list[GGUFPlanes]):
        return self.ops.gguf_planes_matmul(weights, None)

    def _rows(self, weight: GGUFPlanes) -> torch.Tensor:
        return gguf_planes.dequantize(weight)
