"""Callers generated from a kernel's declared signature (kernels/build/binding.py): what the checked one refuses, by
name, and that both call the same kernel."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagellm.kernels.cpu import elementwise, layer_ops
from pagellm.kernels.build.binding import FLOATS, DtypeCode, Float, Function, Int, KernelArgumentError, Tensor
from tests.kernels import requires_compiler

RMS_NORM = elementwise._RMS_NORM
pytestmark = requires_compiler


def _callers(at: str):
    """The unchecked and checked callers of the rms_norm kernel built for level `at`."""
    library = elementwise._LIBRARIES["rms_norm"]
    return library.unchecked(RMS_NORM.symbol, at), library.checked(RMS_NORM.symbol, at)


def test_checked_and_unchecked_callers_compute_the_same(cpu_isa):
    unchecked, checked = _callers(cpu_isa)
    x, w = torch.randn(3, 64), torch.rand(64)
    outs = [torch.empty_like(x), torch.empty_like(x)]
    unchecked(x, w, outs[0], 3, 64, 1e-6, 0)
    checked(x, w, outs[1], 3, 64, 1e-6, 0)
    assert torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0], x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (lambda x, w, out: (x.to(torch.float16), w, out), "'x' is torch.float16, not one of torch.float32, torch.bfloat16"),
    (lambda x, w, out: (x.t(), w, out), "'x' is not contiguous"),
    (lambda x, w, out: (x, None, out), "'weight' is None"),
    (lambda x, w, out: (x, w, [1.0]), "'out' is a list, not a tensor"),
    (lambda x, w, out: (x.requires_grad_(), w, out), "'x' requires grad"),
])
def test_the_checked_caller_names_the_argument_it_refuses(bad, message, cpu_isa):
    _, checked = _callers(cpu_isa)
    x, w = torch.randn(64, 64), torch.rand(64)
    with pytest.raises(KernelArgumentError, match=f"pagellm_rms_norm: argument {message}"):
        checked(*bad(x, w, torch.empty_like(x)), 64, 64, 1e-6, 0)
    assert not RMS_NORM.accepts(**dict(zip(("x", "weight", "out"), bad(x, w, torch.empty_like(x)))))


def test_accepts_checks_only_the_named_tensors_and_optional_ones_may_be_none():
    assert RMS_NORM.accepts(x=torch.randn(2, 8))
    assert layer_ops._ADD_RMS_NORM.accepts(post_weight=None) and not layer_ops._ADD_RMS_NORM.accepts(weight=None)
    rows = torch.randn(4, 8, 2)[..., 0]  # last-dim stride 2
    assert not layer_ops._QKV_PREPARE.accepts(key_cache=rows)


def test_the_declaration_gives_the_ctypes_signature_and_the_callers_parameters():
    f = Function("f", (Tensor("x", FLOATS), DtypeCode("x"), Int("n"), Float("eps")), returns=ctypes.c_int)
    assert f.ctypes_signature() == ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float], ctypes.c_int)
    assert f.params == ["x", "n", "eps"]  # the dtype code is derived from x
    seen = []
    unchecked, _ = f.callers(lambda *args: seen.append(args) or 0)
    x = torch.zeros(2, dtype=torch.bfloat16)
    unchecked(x, 2, 0.5)
    assert seen == [(x.data_ptr(), 1, 2, 0.5)]
