"""The fused layer ops for CUDA (kernels/gpu/layer_ops.py) against the torch modules they replace.

Without CUDA they run under Triton's interpreter (tests/gpu/__init__.py), in fp32 and fp16 (no bf16 there): what
is proved is each kernel's logic (rows, heads, halves, padding slots, both norm flavours, both activations) and,
in fp16, that it rounds where the torch ops round. bf16 is checked on a GPU (`pagellm bench device-check`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels.reference import attention as reference_attention
from pagellm.layers.norm import RMSNorm
from pagellm.kernels.reference.layer_ops import rotary as apply_rotary_reference
from tests.gpu import DEVICE, ON_GPU, interpreter

pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")
with interpreter(not ON_GPU):
    from pagellm.kernels.gpu import layer_ops as ops

DTYPES = [torch.float32, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: to 1e-5. fp16: within one rounding of the largest element (a reduction summed in another order may
    move a value across a rounding boundary, never further), and nine in ten bit-equal at least: a kernel that
    skips one of the torch ops' roundings leaves 0.43-0.87 bit-equal here; a correct one 1.0, but 0.93 for
    gelu(tanh), whose tanh is computed through exp (Triton has no tanh in every version we target)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        return
    bound = 2.0**-10 * want.float().abs().nan_to_num().amax().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=bound, equal_nan=True)
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.float().mean().item() >= 0.9, f"{same.float().mean().item():.3f} bit-equal"


def _norm(dim: int, unit_offset: bool, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, unit_offset=unit_offset)
    weight = torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.5 + (0.0 if unit_offset else 1.0)
    norm.weight = torch.nn.Parameter(weight.to(DEVICE, dtype), requires_grad=False)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("kind", ["add", "post-norm", "norm-only"])
def test_add_rms_norm_is_the_modules(kind, unit_offset, dtype):
    """residual + x (or + post_norm(x)) then the norm, over rows of a width that is no power of two."""
    generator = torch.Generator().manual_seed(1)
    residual, x = (torch.randn(5, 48, generator=generator).to(DEVICE, dtype) * 3 for _ in range(2))
    norm, post = _norm(48, unit_offset, dtype, 2), _norm(48, unit_offset, dtype, 3)
    if kind == "norm-only":
        _close(ops.add_rms_norm(residual, None, None, norm.flavour_weight(), norm.eps, unit_offset)[1],
               norm.reference(residual))
        return
    post_weight = post.flavour_weight() if kind == "post-norm" else None
    got_h, got = ops.add_rms_norm(residual, x, post_weight, norm.flavour_weight(), norm.eps, unit_offset)
    want_h = residual + (post.reference(x) if kind == "post-norm" else x)
    _close(got_h, want_h)
    _close(got, norm.reference(want_h))


QKV_CONFIGS = [  # (H, K, D, norm: None / "llama" / "gemma")
    (4, 2, 32, None), (4, 2, 32, "llama"), (3, 1, 80, "gemma"), (2, 2, 64, "llama")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,norm", QKV_CONFIGS)
def test_qkv_prepare_is_norm_rotary_and_write_kv(heads, kv_heads, head_dim, norm, dtype):
    """q normed and rotated; k the same and v as it is, each at its token's slot; a padded row (slot -1) writes
    nothing, and no other slot of the caches changes."""
    generator = torch.Generator().manual_seed(4)
    tokens, blocks, block_size = 5, 4, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(DEVICE, dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6.0
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    slots = torch.tensor([3, 9, -1, 14, 0], device=DEVICE)
    caches = [torch.full((blocks, block_size, kv_heads, head_dim), float("nan"), device=DEVICE, dtype=dtype)
              for _ in range(2)]
    q_norm = k_norm = None
    if norm is not None:
        q_norm, k_norm = (_norm(head_dim, norm == "gemma", dtype, seed) for seed in (5, 6))
    got = ops.qkv_prepare(qkv, heads, kv_heads, q_norm and q_norm.flavour_weight(),
                          k_norm and k_norm.flavour_weight(), 1e-6, norm == "gemma", cos, sin, *caches, slots)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim), v.reshape(tokens, kv_heads,
                                                                                                  head_dim)
    if norm is not None:
        q, k = q_norm.reference(q), k_norm.reference(k)
    _close(got, apply_rotary_reference(q, cos, sin))
    expected = [torch.full_like(caches[0], float("nan")) for _ in range(2)]
    kept = slots >= 0
    reference_attention.write_kv(apply_rotary_reference(k, cos, sin)[kept], v[kept], *expected, slots[kept])
    _close(caches[0], expected[0])
    assert torch.equal(caches[1].nan_to_num(7.0), expected[1].nan_to_num(7.0))  # v is copied, not computed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,width", [("silu", 40), ("gelu_tanh", 40), ("silu", 1500)])
def test_act_mul_is_the_activation_times_up(activation, width, dtype):
    """F.silu / F.gelu(tanh) of the gate, rounded, times up; 1500 columns: two column tiles per row."""
    gate_up = (torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(7)) * 4).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    _close(ops.act_mul(gate_up, activation), act * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gated_rms_norm_rounds_as_the_torch_module(dtype):
    """The Gated DeltaNet's output norm, rows of a value head of 100 (a partial block), weight around 1: one launch
    against GatedRMSNorm's five torch ops; a dtype mismatch is refused, not silently cast."""
    from pagellm.layers.gated_delta_net import GatedRMSNorm

    generator = torch.Generator().manual_seed(7)
    norm = GatedRMSNorm(100, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(100, generator=generator)).to(DEVICE, dtype)
    x, gate = (torch.randn(6, 4, 100, generator=generator).to(DEVICE, dtype) for _ in range(2))
    _close(ops.gated_rms_norm(x, gate, norm.weight, norm.eps), norm.reference(x, gate))
    with pytest.raises(ValueError, match="must agree"):
        ops.gated_rms_norm(x, gate.float() if dtype != torch.float32 else gate.half(), norm.weight, norm.eps)
