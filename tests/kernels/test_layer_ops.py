"""The fused decoder-layer ops (kernels/cpu/layer_ops.py) against the torch ops they replace.

qkv_prepare and add_rms_norm do the arithmetic of the unfused native kernels (the same norm.h / rope.h row
code), so they must be bit-identical to those; act_mul's exp differs from torch's in the last fp32 ulp, so
it is held to a tight tolerance (at most one bf16 rounding step in bf16, or ~1e-5 absolute where gelu's
1 + tanh cancels). act_mul computes one formula at every level (16, 8 or 1 lanes, the same exp and roundings):
the avx512, avx2 and generic builds give the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels.cpu import layer_ops
from pagellm.kernels.build import native
from pagellm.kernels.ops import native_ops
from pagellm.kernels.reference.attention import write_kv
from pagellm.layers.kernel_user import bind_kernel_level
from pagellm.layers.norm import RMSNorm
from tests.kernels import requires_compiler

pytestmark = requires_compiler

DTYPES = [torch.float32, torch.bfloat16]
NATIVE_NAMES = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _norm(dim: int, unit_offset: bool, dtype: torch.dtype, seed: int, at: str | None) -> RMSNorm:
    """A norm whose module path runs at level `at`: the unfused native kernels the fused ones must equal."""
    norm = RMSNorm(dim, 1e-6, unit_offset=unit_offset)
    bind_kernel_level(norm, at)
    g = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.randn(dim, generator=g) * 0.5 + (0 if unit_offset else 1)).to(dtype)
    return norm


def _rope(tokens: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(tokens)[:, None] * (10000.0 ** (-torch.arange(dim // 2) / (dim // 2)))[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
                         ids=["fp32", "bf16", "fp32-bf16kv", "fp32-fp16kv"])
@pytest.mark.parametrize("qk_norm,unit_offset", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("tokens,dim", [(1, 64), (5, 80), (300, 64), (3, 256)])  # 80: the norm's scalar tail
def test_qkv_prepare_equals_norm_rotary_and_cache_write(dtype, cache_dtype, qk_norm, unit_offset, tokens, dim,
                                                        cpu_isa):
    """Bit-identical to the unfused ops, also where k and v are rounded once into a bf16 cache (write_kv's .to)."""
    heads, kv_heads, blocks, block_size = 4, 2, 40, 16
    torch.manual_seed(tokens)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 2).to(dtype)
    cos, sin = _rope(tokens, dim, dtype)
    slots = torch.randperm(blocks * block_size)[:tokens]  # scattered over blocks, as the block table places them
    norms = tuple(_norm(dim, unit_offset, dtype, seed, cpu_isa) for seed in (1, 2)) if qk_norm else None
    caches = [torch.zeros(blocks, block_size, kv_heads, dim, dtype=cache_dtype) for _ in range(4)]

    with torch.inference_mode():
        q = layer_ops.qkv_prepare(qkv, heads, kv_heads, norms[0].flavour_weight() if norms else None,
                                  norms[1].flavour_weight() if norms else None, 1e-6, unit_offset, cos, sin,
                                  caches[0], caches[1], slots, cpu_isa)
        rq, rk, rv = (t.reshape(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
        if norms:
            rq, rk = norms[0](rq.contiguous()), norms[1](rk.contiguous())
        rq, rk = (native_ops(cpu_isa).rotary(t.contiguous(), cos, sin) for t in (rq, rk))
        write_kv(rk, rv, caches[2], caches[3], slots)
    assert q is not None and q.shape == (tokens, heads, dim)
    assert torch.equal(q, rq)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])  # only the tokens' slots written


def test_an_fp16_cache_holds_v_rounded_exactly_as_torch_rounds_it(cpu_isa):
    """fp32 -> fp16 into the cache (vcvtps2ph eight at a time at avx2 / avx512, csrc/f16.h's scalar rounding at
    generic and in the tails): ties to even, subnormals, overflow to inf, a NaN kept a NaN with torch's bits."""
    edge = [0.0, -0.0, 1.0, 1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65519.99, 65520.0, -7e4, float("inf"), float("-inf"),
            float("nan"), 6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-10, -3.14159, 2.71828]
    dim = 36  # four vectors of eight and a tail of four per row
    v = torch.cat([torch.tensor(edge), torch.randn(dim - len(edge)) * 1e-5])
    qkv = torch.cat([torch.randn(2 * dim), v]).reshape(1, 3 * dim)  # one q head, one k head, one v head
    cos, sin = _rope(1, dim, torch.float32)
    caches = [torch.zeros(2, 16, 1, dim, dtype=torch.float16) for _ in range(2)]
    slots = torch.tensor([5])
    assert layer_ops.qkv_prepare(qkv, 1, 1, None, None, 1e-6, False, cos, sin, *caches, slots, cpu_isa) is not None
    assert torch.equal(caches[1][0, 5, 0].view(torch.int16), v.to(torch.float16).view(torch.int16))


def test_qkv_prepare_refuses_what_it_cannot_do(cpu_isa):
    """A plan binds it only where it applies (kernels/ops.py): anything else is an error, never a silent torch path."""
    qkv, cos, sin = torch.randn(2, 4 * 32), *_rope(2, 32, torch.float32)
    cache = torch.zeros(4, 16, 1, 32)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="qkv_prepare"):
        layer_ops.qkv_prepare(qkv.bfloat16(), 2, 1, None, None, 0.0, False, cos.bfloat16(), sin.bfloat16(),
                              cache, cache, slots, cpu_isa)  # an fp32 cache under bf16: not a pair it takes
    with pytest.raises(ValueError, match="qkv_prepare"):
        layer_ops.qkv_prepare(qkv, 2, 1, None, None, 0.0, False, cos, sin, cache, cache.bfloat16(),
                              slots, cpu_isa)  # K and V differ
    with pytest.raises(ValueError, match="qkv_prepare"):
        layer_ops.qkv_prepare(qkv, 2, 1, None, None, 0.0, False, cos, sin, cache, cache, slots.int(),
                              cpu_isa)
    with pytest.raises(ValueError, match="qkv_prepare"):
        layer_ops.qkv_prepare(qkv[:, ::2], 1, 0, None, None, 0.0, False, cos, sin, cache, cache, slots,
                              cpu_isa)
    with pytest.raises(ValueError, match="qkv_prepare"):
        layer_ops.qkv_prepare(qkv, 3, 1, None, None, 0.0, False, cos, sin, cache, cache, slots, cpu_isa)
    with pytest.raises(ValueError, match="qkv_prepare"):
        layer_ops.qkv_prepare(qkv, 2, 1, None, None, 0.0, False, cos, sin, cache, cache, slots[:1],
                              cpu_isa)
    with pytest.raises(ValueError, match="qkv_prepare"):
        layer_ops.qkv_prepare(qkv, 2, 1, None, None, 0.0, False, cos[:1], sin[:1], cache, cache, slots,
                              cpu_isa)
    assert not cache.any()  # nothing written when refused


def test_qkv_prepare_refuses_slots_outside_the_cache(cpu_isa):
    qkv, cos, sin = torch.randn(2, 4 * 32), *_rope(2, 32, torch.float32)
    cache = torch.zeros(4, 16, 1, 32)
    for bad in (64, -1):
        with pytest.raises(IndexError, match="outside the KV cache"):
            layer_ops.qkv_prepare(qkv, 2, 1, None, None, 0.0, False, cos, sin, cache, cache, torch.tensor([0, bad]),
                                  cpu_isa)
    assert not cache.any()  # checked before any write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_post", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_residual_norm_equals_add_then_norm(dtype, unit_offset, with_post, rows, cpu_isa):
    dim = 640
    torch.manual_seed(rows)
    h, x = (torch.randn(rows, dim) * 4).to(dtype), torch.randn(rows, dim).to(dtype)
    norm = _norm(dim, unit_offset, dtype, 3, cpu_isa)
    post = _norm(dim, unit_offset, dtype, 4, cpu_isa) if with_post else None
    with torch.inference_mode():
        fused = layer_ops.add_rms_norm(h, x, post.flavour_weight() if post else None, norm.flavour_weight(), norm.eps,
                                       unit_offset, cpu_isa)
        summed = h + (post(x) if post else x)
        reference = (summed, norm(summed))
        via_module = norm.residual(h, x, post)
    assert fused is not None
    for got in (fused, via_module):
        assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
    assert norm.residual(h, None)[0] is h and torch.equal(norm.residual(h, None)[1], norm(h))


def test_residual_norm_runs_two_norms_for_mismatched_ones(cpu_isa):
    h, x = torch.randn(2, 32), torch.randn(2, 32)
    norm, post = RMSNorm(32, 1e-6), RMSNorm(32, 1e-5)
    bind_kernel_level(norm, cpu_isa)
    bind_kernel_level(post, cpu_isa)
    post.weight.data = torch.rand(32) + 0.5
    got = norm.residual(h, x, post)  # different eps: two calls of the torch path
    summed = h + post(x)
    assert torch.equal(got[0], summed) and torch.equal(got[1], norm(summed))
    with pytest.raises(ValueError, match=r"add_rms_norm: .*\(the plan binds this kernel only where it applies\)"):
        layer_ops.add_rms_norm(h, x.double(), None, norm.weight, 1e-6, False, cpu_isa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("shape", [(1, 2 * 2048), (7, 2 * 24), (64, 2 * 1000)])
def test_gated_act_matches_torch(dtype, activation, shape, cpu_isa):
    torch.manual_seed(shape[0])
    gate_up = (torch.randn(shape) * 3).to(dtype)
    gate_up[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0])  # exp overflow / underflow and signed zeros
    act = F.silu if activation == "silu" else (lambda v: F.gelu(v, approximate="tanh"))
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        got, reference = native_ops(cpu_isa).gated_act(activation)(gate_up), act(gate) * up
        native_out = layer_ops.act_mul(gate_up, NATIVE_NAMES[activation], cpu_isa)
    assert native_out is not None and torch.equal(got, native_out)  # the kernel, at every level
    assert got.dtype == dtype and got.shape == reference.shape and torch.isfinite(got).all()
    # Apart from last-ulp exp differences, values differ only where gelu's 1 + tanh(y) cancels (tanh near -1),
    # in torch's formula as in ours: tiny results, a few 1e-6 apart at inputs of scale 3.
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    else:  # act rounded to bf16 before the product, as torch does: at most one bf16 step apart
        torch.testing.assert_close(got.float(), reference.float(), atol=1e-4, rtol=2 ** -7)
        assert (got != reference).float().mean() < 0.05


def test_gated_act_keeps_torch_for_erf_gelu(cpu_isa):
    gate_up = torch.randn(3, 16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(native_ops(cpu_isa).gated_act("gelu")(gate_up), F.gelu(gate) * up)
    with pytest.raises(ValueError, match="act_mul: 'gelu'"):
        layer_ops.act_mul(gate_up, "gelu", cpu_isa)


def _act_inputs(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """gate_up [rows, 2 n]: gates over exp's whole range (its clamps at -104 / 89, denormal results, gelu's
    cancellation near tanh = -1), fp32 ones also random bit patterns; ups random, some special."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(rows, n, generator=g) * torch.tensor([1.0, 3.0, 30.0, 120.0])[torch.randint(4, (rows, n), generator=g)]
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31 - 1, (rows, n), generator=g, dtype=torch.int64).to(torch.int32)
        gate = torch.where(torch.rand(rows, n, generator=g) < 0.25, bits.view(torch.float32), gate)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 104.0, -104.0, 89.0, -89.0, 87.4, -87.4, 52.0, -52.0, 1e30,
                            -1e30, float("inf"), -float("inf"), float("nan"), -9.0, -10.5, 3.4e38])
    flat = gate.view(-1)
    flat[: min(flat.numel(), special.numel())] = special[: flat.numel()]
    up = torch.randn(rows, n, generator=g) * 2
    up.view(-1)[:3] = torch.tensor([0.0, float("inf"), -1e-40])[: up.numel()]
    return torch.cat([gate, up], dim=-1).to(dtype)


@pytest.mark.across_levels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,n", [(1, 1), (2, 7), (3, 8), (1, 15), (2, 16), (3, 17), (2, 33), (5, 2048 + 13),
                                    (40, 1000)])  # vector bodies of 16 and 8 lanes, scalar tails, threads
def test_act_mul_is_the_same_bits_at_every_level(dtype, activation, rows, n):
    gate_up = _act_inputs(rows, n, dtype, seed=rows * 1000 + n)
    results = {}
    for level in native.host_levels():
        with torch.inference_mode():
            results[level] = layer_ops.act_mul(gate_up, activation, level)
    assert all(out is not None for out in results.values()), "act_mul declined at some level"
    want = results[native.host_levels()[0]]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for level, got in results.items():
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), level
        differ = (got.view(bits) != want.view(bits)) & ~nan  # NaN payloads aside
        assert not differ.any(), f"{level}: {int(differ.sum())} differ, e.g. gate {gate_up[..., :n][differ][:4]}"
    assert torch.isnan(want[torch.isnan(gate_up[..., :n])]).all()  # a NaN gate stays NaN, in bf16 too
