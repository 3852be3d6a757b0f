"""What modules that call the native CPU kernels share: the level they call them at, and what they bind from it."""

from __future__ import annotations

from torch import nn

from pagellm.kernels import native


class KernelUser:
    """Mixin of a module that calls the native CPU kernels (before nn.Module in its bases).

    `kernel_level`: the instruction-set level it calls them at (None: torch's reference ops). From construction
    it is the process default (native.default_level(), what the environment's KernelConfig says); the loader
    gives the quantized layers it builds the engine's level (their layout is chosen for it), and the runner's
    plan binds every module to it (`bind_kernel_level`), so the modules never ask a process-wide switch per
    call. `bindings`: what the module binds from that level (kernels
    holding raw pointers into its own tensors), made on first use, dropped when the level changes, and left
    behind by a copy (deepcopy, pickle), which makes its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernel_level: str | None = native.default_level()
        self.bindings: dict = {}

    def use_kernel_level(self, level: str | None) -> None:
        """Call the kernels at `level` from now on (a ValueError where the module's weights are in a layout no
        kernel of that level computes with); bindings made at another level are dropped."""
        if level != self.kernel_level:
            self.kernel_level, self.bindings = level, {}

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["bindings"] = {}
        return state


def bind_kernel_level(model: nn.Module, level: str | None) -> None:
    """Every KernelUser module of `model` calls the native kernels at `level` from now on."""
    for module in model.modules():
        if isinstance(module, KernelUser):
            module.use_kernel_level(level)
