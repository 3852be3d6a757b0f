"""The C++ kernels' entry points declared once, and the callers generated from each declaration.

A `Function` lists its arguments by kind: a `Tensor` passes its data pointer (None: NULL where `optional`), a
`DtypeCode` passes the kernels' dtype code of a named tensor (0 fp32, 1 bf16, 2 fp16: a K/V cache only),
`Int` / `Flag` / `Float` pass numbers as int64 / int / float, `Address` a raw address (a pointer with an offset
already added). From that one declaration come:

    ctypes types        argtypes / restype, set once on the loaded library (native.Library)
    unchecked caller    f(*args): pointers and codes straight into the call; for the plans and hot paths,
                        which checked their inputs when they were planned (models/bound_layers.py)
    checked caller      the same after checking each tensor (CPU, one of the declared dtypes, contiguous or
                        rows of unit stride, no autograd); a KernelArgumentError naming the function and
                        argument otherwise
    accepts(**tensors)  whether the named tensors pass those checks: the wrappers' "does the kernel take this"

Why generated source (exec) rather than a loop over the declaration: the unchecked caller runs ~20 times per
layer step, and a loop with per-argument dispatch costs microseconds a straight call does not. Shape relations
between arguments (K matching, head sizes) stay in the wrappers, which know them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch

DTYPE_CODES = MappingProxyType({torch.float32: 0, torch.bfloat16: 1})  # the kernels' dtype argument (is_bf16)
_CODES = MappingProxyType({**DTYPE_CODES, torch.float16: 2})  # what DtypeCode passes: a K/V cache may be fp16
FLOATS = (torch.float32, torch.bfloat16)
KV_CACHE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # fp16: under fp32 activations only


def kv_cache_pairs(compute: torch.dtype, cache: torch.dtype) -> bool:
    """Whether the kernels take a KV cache of dtype `cache` under `compute` activations: the same dtype, or bf16
    or fp16 under fp32 (paged_attention.cpp's and layer_ops.cpp's mixed pairs)."""
    if compute not in FLOATS:
        return False
    return cache in (compute, torch.bfloat16) or (compute == torch.float32 and cache == torch.float16)


class KernelArgumentError(ValueError):
    """A kernel was called with an argument it cannot take (named in the message)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtypes: tuple[torch.dtype, ...] | None = None  # None: any (the kernel reads raw bytes)
    optional: bool = False  # None is passed as NULL
    rows: bool = False  # only the last dim needs unit stride (the kernel is given the other strides)
    ctype = ctypes.c_void_p


@dataclass(frozen=True)
class DtypeCode:
    of: str  # the tensor argument whose dtype is coded
    ctype = ctypes.c_int


@dataclass(frozen=True)
class Scalar:
    """A number passed as is; the subclasses name its C type."""

    name: str
    ctype: ClassVar = ctypes.c_int64


class Int(Scalar):
    ctype = ctypes.c_int64


class Flag(Scalar):  # an int, bool or enum code
    ctype = ctypes.c_int


class Float(Scalar):
    ctype = ctypes.c_float


class Address(Scalar):  # a raw address (a tensor's data_ptr() with an offset added)
    ctype = ctypes.c_void_p


def _name(arg) -> str | None:
    return None if isinstance(arg, DtypeCode) else arg.name


@dataclass(frozen=True)
class Function:
    symbol: str
    args: tuple
    returns: type | None = None  # a ctypes type, None: void

    @property
    def params(self) -> list[str]:
        """The callers' parameters, in order: every argument but the dtype codes (derived)."""
        return [name for name in map(_name, self.args) if name is not None]

    @property
    def tensors(self) -> dict[str, Tensor]:
        return {a.name: a for a in self.args if isinstance(a, Tensor)}

    def ctypes_signature(self) -> tuple[list, object]:
        return [a.ctype for a in self.args], self.returns

    def callers(self, fn) -> tuple:
        """(unchecked, checked) callers of the loaded ctypes function `fn`."""
        values = []
        for a in self.args:
            if isinstance(a, Tensor):
                values.append(f"None if {a.name} is None else {a.name}.data_ptr()" if a.optional
                              else f"{a.name}.data_ptr()")
            elif isinstance(a, DtypeCode):
                values.append(f"_codes[{a.of}.dtype]")
            else:
                values.append(a.name)
        params = ", ".join(self.params)
        call = f"    return _fn({', '.join(values)})\n"
        checks = "".join(f"    _check({name!r}, {name})\n" for name in self.tensors)
        namespace = {"_fn": fn, "_codes": _CODES, "_check": self._check}
        exec(f"def unchecked({params}):\n{call}\ndef checked({params}):\n{checks}{call}", namespace)  # noqa: S102
        return namespace["unchecked"], namespace["checked"]

    def accepts(self, **tensors: torch.Tensor | None) -> bool:
        """Whether each named tensor (a subset of the tensor arguments) passes the checked caller's checks."""
        return all(self._problem(name, t) is None for name, t in tensors.items())

    def _check(self, name: str, tensor: torch.Tensor | None) -> None:
        problem = self._problem(name, tensor)
        if problem is not None:
            raise KernelArgumentError(f"{self.symbol}: argument {name!r} {problem}")

    def _problem(self, name: str, t: torch.Tensor | None) -> str | None:
        spec = self.tensors[name]
        if t is None:
            return None if spec.optional else "is None"
        if not isinstance(t, torch.Tensor):
            return f"is a {type(t).__name__}, not a tensor"
        if t.device.type != "cpu":
            return f"is on {t.device}, not the CPU"
        if spec.dtypes is not None and t.dtype not in spec.dtypes:
            return f"is {t.dtype}, not one of {', '.join(map(str, spec.dtypes))}"
        if not (t.stride(-1) == 1 or t.shape[-1] <= 1 if spec.rows and t.dim() else t.is_contiguous()):
            return f"is not {'of unit stride along its last dim' if spec.rows else 'contiguous'}"
        if t.requires_grad and torch.is_grad_enabled():
            return "requires grad (the kernels have no backward)"
        return None
