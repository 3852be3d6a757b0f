"""The native paged attention kernel (csrc/paged_attention.cpp) against the torch reference.

Every cache here starts filled with NaN and sequences live in shuffled physical blocks with
unused blocks in between: a kernel that read past seq_len, or ignored the block table,
would produce NaN or wrong values.

The tests run once per instruction-set level the CPU executes (conftest.py); the AVX2 build
must moreover reproduce the AVX-512 build bit for bit, and the scalar build agree with it to
rounding (test_levels_agree_with_avx512).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm.kernels.cpu import attention
from pagellm.kernels.reference import attention as reference_attention
from pagellm.kernels.build import native
from pagellm.kernels.ops import native_ops
from tests.kernels import requires_compiler
from tests.kernels.attention_cases import Case, make_case


def run_both(case: Case, at: str, window=None, cap=None):
    """The kernel's output at level `at`, and the reference's in fp64 from the same (already rounded) inputs: the
    exact result, to far better than the bounds below need."""
    args = (case.meta, case.scale, window, cap)
    exact = reference_attention.paged_attention_reference(case.query.double(), case.key_cache.double(),
                                                case.value_cache.double(), *args)
    return attention.paged_attention_native(case.query, case.key_cache, case.value_cache, *args, at=at), exact


BF16_ROUNDING = 2.0**-8  # bf16's unit roundoff: the kernel accumulates in fp32 and rounds each output once


def assert_close(native_out, exact, dtype):
    """fp32: within 1e-5. bf16: within the one rounding of each element to bf16, |err| <= 2^-8 |exact|, plus
    fp32 accumulation in another order (1e-5 of the largest output): scaled to each element, so a 1% error in
    the softmax scale or the output fails (test_a_one_percent_error_fails_the_bf16_bound)."""
    assert native_out.dtype == dtype and exact.dtype == torch.float64
    assert torch.isfinite(native_out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(native_out.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        error = (native_out.double() - exact).abs()
        bound = BF16_ROUNDING * exact.abs() + 1e-5 * exact.abs().amax()
        worst = (error / bound).max().item()
        assert worst <= 1.0, f"bf16 output off by {worst:.2f}x its rounding bound"


SCENARIOS = {  # name: (query_lens, seq_lens)
    "decode": ([1, 1, 1, 1, 1], [1, 17, 40, 64, 100]),
    "prefill": ([37, 20], [37, 20]),
    "chunked": ([10, 19], [50, 83]),
    "mixed": ([1, 13, 1, 30], [70, 13, 5, 61]),
}
CONFIGS = [  # (H_q, H_kv, D, block_size, sliding_window, soft_cap): G = 1, 2, 3, 4
    (4, 1, 256, 16, None, None),
    (4, 1, 256, 16, 24, None),
    (2, 2, 64, 32, None, 30.0),
    (4, 2, 128, 16, 24, 50.0),
    (8, 2, 64, 32, 7, None),
    (6, 2, 256, 32, None, 5.0),
    (3, 3, 128, 16, 33, None),
]

# (query dtype, cache dtype): the pairs the kernel takes; fp32 queries over fp16 K/V: a GGUF's default where
# attention is not narrow
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
               (torch.float32, torch.float16)]
PAIR_IDS = ["fp32", "bf16", "fp32-bf16kv", "fp32-fp16kv"]


@requires_compiler
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hq{}-hkv{}-d{}-bs{}-w{}-cap{}".format(*c))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_reference(scenario, config, dtypes, cpu_isa):
    num_heads, num_kv_heads, head_dim, block_size, window, cap = config
    query_lens, seq_lens = SCENARIOS[scenario]
    dtype, cache_dtype = dtypes
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                     cache_dtype=cache_dtype)
    assert_close(*run_both(case, cpu_isa, window, cap), dtype)


@requires_compiler
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_one_percent_error_fails_the_bf16_bound(scenario, cpu_isa):
    """The bf16 bound is tight enough to catch a kernel 1% off: in its softmax scale, or in its output."""
    query_lens, seq_lens = SCENARIOS[scenario]
    for num_heads, num_kv_heads, head_dim, block_size, window, cap in CONFIGS:
        case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16,
                         cache_dtype=torch.bfloat16)
        native_out, exact = run_both(case, cpu_isa, window, cap)
        assert_close(native_out, exact, torch.bfloat16)
        with pytest.raises(AssertionError, match="rounding bound"):
            assert_close((native_out.double() * 1.01).to(torch.bfloat16), exact, torch.bfloat16)
        off_scale = dataclasses.replace(case, scale=case.scale * 1.01)
        with pytest.raises(AssertionError, match="rounding bound"):
            assert_close(run_both(off_scale, cpu_isa, window, cap)[0], exact, torch.bfloat16)


@requires_compiler
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 512])
def test_long_decode_with_key_splits(dtypes, threads, window, cpu_isa):
    """One long decode: with 2 threads the kernel splits the keys and merges the partials."""
    dtype, cache_dtype = dtypes
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = make_case([1], [3001], 4, 1, 256, 16, dtype, cache_dtype=cache_dtype)
        assert_close(*run_both(case, cpu_isa, window), dtype)
        case = make_case([1, 1], [2500, 40], 8, 2, 64, 32, dtype, cache_dtype=cache_dtype)  # the long one splits
        assert_close(*run_both(case, cpu_isa, window, 20.0), dtype)
    finally:
        torch.set_num_threads(saved)


@requires_compiler
def test_long_chunk_over_long_context(cpu_isa):
    """A few query rows over a long context: tiles and splits in the same call."""
    case = make_case([40, 1], [2000, 700], 4, 1, 128, 16, torch.float32)
    assert_close(*run_both(case, cpu_isa, 300), torch.float32)


@requires_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nan_beyond_context_never_read(dtype, cpu_isa):
    """Partially filled last blocks and unused blocks hold NaN; the output stays finite and exact."""
    case = make_case([1, 5, 1], [33, 21, 1], 4, 2, 64, 16, dtype)
    assert torch.isnan(case.key_cache).any() and torch.isnan(case.value_cache).any()
    native_out, reference = run_both(case, cpu_isa)
    assert_close(native_out, reference, dtype)


@requires_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_physical_placement_does_not_change_the_result(dtype, cpu_isa):
    args = ([1, 7, 1], [300, 40, 77], 4, 1, 128, 16, dtype)
    first = make_case(*args, seed=3, placement_seed=10)
    second = make_case(*args, seed=3, placement_seed=11)
    assert not torch.equal(first.meta.block_tables, second.meta.block_tables)
    for window in (None, 50):
        a, _ = run_both(first, cpu_isa, window)
        b, _ = run_both(second, cpu_isa, window)
        assert torch.equal(a, b)


@requires_compiler
def test_strided_query(cpu_isa):
    """A query that is a view into a fused projection (row stride larger than H_q * D)."""
    case = make_case([3, 1], [9, 30], 4, 2, 64, 16, torch.float32)
    fused = torch.randn(case.query.shape[0], 8, 64)
    fused[:, 2:6] = case.query
    strided = dataclasses.replace(case, query=fused[:, 2:6])
    assert not strided.query.is_contiguous()
    torch.testing.assert_close(run_both(strided, cpu_isa)[0].double(), run_both(case, cpu_isa)[1], atol=1e-5, rtol=1e-5)


def level_cases():
    """(case, window, soft_cap) covering every code path: the scenarios and configs above, key splits
    merged across threads, head sizes with a 16-element tail past the 32-element bf16 pairs, and bf16
    data with subnormal keys, products and partial sums (vdpbf16ps flushes those to zero, the AVX2 fmas
    keep them: the scores differ by less than 2^-126 * (D + |q|_1 + |k|_1), which the softmax does not
    see at these scales; see the top of paged_attention.cpp)."""
    for dtype, kv in DTYPE_PAIRS:
        for query_lens, seq_lens in SCENARIOS.values():
            for num_heads, num_kv_heads, head_dim, block_size, window, cap in CONFIGS:
                yield (make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                 cache_dtype=kv), window, cap)
        yield make_case([1, 1], [2500, 40], 8, 2, 64, 32, dtype, cache_dtype=kv), 512, 20.0
        yield make_case([1, 9], [3001, 40], 4, 1, 256, 16, dtype, cache_dtype=kv), None, None
        for head_dim in (48, 80):
            yield make_case([1, 6, 1], [300, 6, 50], 4, 2, head_dim, 16, dtype, cache_dtype=kv), 100, 30.0
    tiny = make_case([1, 5], [40, 50], 4, 2, 64, 16, torch.bfloat16)
    tiny.query[:, 2:] *= 2.0**-70  # two of the four heads: tiny x tiny products are subnormal
    tiny.key_cache.mul_(2.0**-70)
    yield tiny, None, None
    subnormal = make_case([1, 5], [40, 50], 4, 2, 64, 16, torch.bfloat16)
    subnormal.key_cache.mul_(2.0**-130)  # subnormal bf16 keys
    yield subnormal, None, None


@pytest.mark.across_levels
@requires_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_lower_levels_agree_with_the_hosts_own(threads):
    """Each lower level's build against the host's best: avx2 gives avx512's bits; the generic (scalar)
    build sums in another order and agrees to rounding (fp32: 1e-5; bf16: one bf16 rounding). All match
    the reference."""
    best, *lower = native.host_levels()
    kernels = {each: attention._native_kernel(each) for each in (best, *lower)}
    assert None not in kernels.values(), kernels  # every level built: none of them falls back to the reference
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # the same split plan for both builds
    try:
        for case, window, cap in level_cases():
            outputs = {}
            for each in kernels:
                outputs[each], reference = run_both(case, each, window, cap)
                assert_close(outputs[each], reference, case.query.dtype)
            base = outputs[best]
            for level in lower:
                out = outputs[level]
                if level == "avx2":  # (avx512 is the only level above it)
                    assert torch.equal(out, base), (level, case.query.dtype, case.query.shape, window, cap)
                elif case.query.dtype == torch.float32:
                    torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)
                else:
                    torch.testing.assert_close(out.float(), base.float(), atol=1e-6, rtol=2.0**-7)
    finally:
        torch.set_num_threads(saved)


def test_a_layer_is_bound_to_the_kernel_only_where_it_takes_it(cpu_isa):
    """The choice made once per layer (kernels/ops.LayerOps.attention_for): the kernel for fp32/bf16 queries with
    heads of a multiple of 16 over a cache it pairs with; the torch reference elsewhere and with no level."""
    native_kernel, torch_reference = attention.paged_attention_native, reference_attention.paged_attention_reference
    ops = native_ops(cpu_isa)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert ops.attention_for(64, f32, f32).func is native_kernel
    assert ops.attention_for(64, bf16, bf16).func is native_kernel
    assert ops.attention_for(64, f32, bf16).func is native_kernel  # fp32 queries over a bf16 cache
    assert ops.attention_for(64, f32, f16).func is native_kernel  # and over the fp16 one a GGUF's blocks keep
    # not covered by the kernel: float16 activations, a head size that is not a multiple of 16, other mixed dtypes
    assert native_ops(cpu_isa, f16).attention_for(64, f16, f16) is torch_reference
    assert ops.attention_for(24, f32, f32) is torch_reference
    assert ops.attention_for(64, bf16, f32) is torch_reference and ops.attention_for(64, bf16, f16) is torch_reference
    assert native_ops(None).attention_for(64, f32, f32) is torch_reference  # native kernels off
