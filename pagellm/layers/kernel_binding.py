"""What modules that cache kernels bound to their tensors share."""

from __future__ import annotations


class KernelBinding:
    """Mixin for a module keeping kernel bindings (raw pointers into its own tensors) in `__dict__["_bound"]`:
    a copy (deepcopy, pickle) leaves them behind and binds its own on first use."""

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_bound", None)
        return state
