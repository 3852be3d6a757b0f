"""What modules that call the kernels share: the device's op table they call, the CPU level they call its native
kernels at, and what they bind from those."""

from __future__ import annotations

from torch import nn

from pagellm.kernels.build import native
from pagellm.kernels.ops import LayerOps, native_ops


class KernelUser:
    """Mixin of a module that calls the kernels (before nn.Module in its bases).

    `ops`: the device's layer ops (kernels/ops.py), each the kernel or the torch reference as its backend chose;
    `kernel_level`: the instruction-set level of the native CPU kernels (None: torch's reference ops, or another
    device). From construction they are the process default's (native.default_level(), what the environment's
    KernelConfig says); the loader gives the quantized layers it builds the engine's level (their layout is chosen
    for it), and the runner's plan binds every module to its backend's (`bind_kernel_level`), so the modules never
    ask a process-wide switch or test a device per call. `bindings`: what the module binds from them (kernels
    holding raw pointers into its own tensors, a layer's choice of op for its shape), made on first use, dropped
    when the level or the ops change, and left behind by a copy (deepcopy, pickle), which makes its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernel_level: str | None = native.default_level()
        self.ops: LayerOps = native_ops(self.kernel_level)
        self.bindings: dict = {}

    def use_kernel_level(self, level: str | None) -> None:
        """Call the kernels at `level` from now on (a ValueError where the module's weights are in a layout no
        kernel of that level computes with); bindings made at another level are dropped."""
        if level != self.kernel_level:
            self.kernel_level, self.bindings = level, {}

    def use_ops(self, ops: LayerOps) -> None:
        """Call `ops` from now on; bindings made from others are dropped."""
        if ops is not self.ops:
            self.ops, self.bindings = ops, {}

    def bound(self, key, make):
        """bindings[key], made by make() on first use (after a change of level or ops, again); None is an answer
        too (no kernel for this layer)."""
        if key not in self.bindings:
            self.bindings[key] = make()
        return self.bindings[key]

    def bound_to_tensors(self, key, make):
        """bindings[key], made by make() for this module's buffers and bias as they are, again once one of them was
        replaced (moved to a device, swapped): checked by identity, so a forward pays a few attribute reads, not a
        rebuild."""
        tensors = (*self._buffers.values(), getattr(self, "bias", None))
        bound, held = self.bindings.get(key, (None, ()))
        if bound is None or len(held) != len(tensors) or any(a is not b for a, b in zip(held, tensors)):
            bound = make()
            self.bindings[key] = (bound, tensors)
        return bound

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["bindings"] = {}
        return state


def bind_kernel_level(model: nn.Module, level: str | None, ops: LayerOps | None = None) -> None:
    """Every KernelUser module of `model` calls the native kernels at `level` and the layer ops `ops` (None: the
    CPU's at that level) from now on."""
    ops = native_ops(level) if ops is None else ops
    for module in model.modules():
        if isinstance(module, KernelUser):
            module.use_kernel_level(level)
            module.use_ops(ops)
