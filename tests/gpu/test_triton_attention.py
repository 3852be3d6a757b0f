"""The Triton paged-attention kernel (kernels/gpu/attention.py) against the torch reference.

On a machine without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, read by `triton.jit`
when the module is imported): numpy, one program at a time, so shapes stay tiny and dtypes fp32 / fp16 (the
interpreter has no bf16; bf16 is for a GPU run). What it proves is the kernel's logic: request lookup over the
upper-bound grid, block-table reads, masks, GQA packing, online softmax.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagellm.kernels.reference import attention as reference_attention
from tests.gpu import DEVICE, ON_GPU, interpreter
from tests.kernels.attention_cases import make_case

ROOT = Path(__file__).parents[2]
pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")
with interpreter(not ON_GPU):  # tests/conftest.py imported triton itself under it
    from pagellm.kernels.gpu import attention as triton_attention


SCENARIOS = {  # name: (query_lens, seq_lens)
    "decode": ([1, 1, 1], [1, 17, 40]),
    "prefill": ([19, 5], [19, 5]),
    "chunked": ([10, 3], [50, 35]),
    "mixed": ([1, 13, 1, 6], [70, 13, 5, 33]),
    "long-decode": ([1, 1], [300, 129]),  # many key tiles, a block table ten blocks wide
}
CONFIGS = [  # (H_q, H_kv, D, block_size, sliding_window, soft_cap): G = 1, 2, 3, 4
    (2, 2, 64, 16, None, None),
    (4, 2, 32, 16, 7, 30.0),
    (3, 1, 80, 32, None, 5.0),  # a head size that is not a power of two
    (8, 2, 64, 16, 24, None),
]


def run_both(case, window, cap):
    args = (case.meta, case.scale, window, cap)
    moved = [t.to(DEVICE) for t in (case.query, case.key_cache, case.value_cache)]
    meta = case.meta if DEVICE == "cpu" else _meta_on(case.meta, DEVICE)
    got = triton_attention.paged_attention_triton(*moved, meta, *args[1:])
    exact = reference_attention.paged_attention_reference(case.query.double(), case.key_cache.double(),
                                                case.value_cache.double(), *args)
    return got.cpu(), exact


def _meta_on(meta, device):
    import dataclasses

    return dataclasses.replace(meta, **{name: getattr(meta, name).to(device) for name in
                                        ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hq{}-hkv{}-d{}-bs{}-w{}-cap{}".format(*c))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_the_reference_in_fp32(scenario, config):
    num_heads, num_kv_heads, head_dim, block_size, window, cap = config
    query_lens, seq_lens = SCENARIOS[scenario]
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    got, exact = run_both(case, window, cap)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()  # NaN rows past each context never read
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)


def test_fp32_queries_over_an_fp16_cache_and_fp16_queries():
    """K/V in another dtype than the queries are converted as they are loaded; fp16 output within its rounding."""
    for dtype, cache_dtype in ((torch.float32, torch.float16), (torch.float16, torch.float16)):
        case = make_case([1, 7], [30, 7], 4, 2, 64, 16, dtype, cache_dtype=cache_dtype)
        got, exact = run_both(case, None, None)
        assert got.dtype == dtype
        bound = (2.0**-11 if dtype == torch.float16 else 1e-5) * exact.abs() + 1e-4 * exact.abs().amax()
        assert ((got.double() - exact).abs() <= bound).all()


def test_a_wrong_scale_or_a_dropped_mask_fails_the_comparison():
    """The fp32 check is tight enough to see a 1% scale error and a window the kernel did not apply."""
    case = make_case([10, 3], [50, 35], 4, 2, 32, 16, torch.float32)
    got, exact = run_both(case, 7, None)
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    off = triton_attention.paged_attention_triton(case.query.to(DEVICE), case.key_cache.to(DEVICE),
                                                  case.value_cache.to(DEVICE), _meta_on(case.meta, DEVICE),
                                                  case.scale * 1.01, 7, None).cpu()
    assert not torch.allclose(off.double(), exact, atol=1e-5, rtol=1e-5)
    unwindowed, _ = run_both(case, None, None)
    assert not torch.allclose(unwindowed.double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("config", CONFIGS[1:3], ids=lambda c: "hq{}-hkv{}-d{}-bs{}-w{}-cap{}".format(*c))
def test_split_kv_decode_matches_the_reference(config, splits):
    """Each decode's keys in `splits` runs joined by the reduce kernel: the same result as one run, with a
    window and a cap, over contexts of 1 to 300 keys (16 runs of a 1-key context: 15 empty ones)."""
    num_heads, num_kv_heads, head_dim, block_size, window, cap = config
    case = make_case([1, 1, 1, 1], [1, 40, 300, 129], num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    args = (case.scale, window, cap)
    got = triton_attention.paged_attention_triton(case.query.to(DEVICE), case.key_cache.to(DEVICE),
                                                  case.value_cache.to(DEVICE), _meta_on(case.meta, DEVICE), *args,
                                                  num_splits=splits).cpu()
    exact = reference_attention.paged_attention_reference(case.query.double(), case.key_cache.double(),
                                                case.value_cache.double(), case.meta, *args)
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)


def test_eager_decodes_split_only_long_contexts_and_graph_captures_always(monkeypatch):
    """On a GPU of 132 multiprocessors: an eager decode whose longest context is under SPLIT_MIN_CONTEXT runs one
    pass, a longer one is split and joined by the reduce kernel; a decode captured for a graph is split whatever
    its contexts (its replays see every length); all equal the reference."""
    launches = []
    reduce = triton_attention._reduce_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce[grid]

    monkeypatch.setattr(triton_attention, "_reduce_splits_kernel", Spy())
    monkeypatch.setattr(triton_attention, "_multiprocessors", lambda device: 132)
    cases = ((triton_attention.SPLIT_MIN_CONTEXT - 1, False, 0), (triton_attention.SPLIT_MIN_CONTEXT, False, 1),
             (40, True, 2))
    for longest, for_graph, splits in cases:
        case = make_case([1, 1], [longest, 5], 2, 1, 16, 64, torch.float32)
        meta = dataclasses.replace(_meta_on(case.meta, DEVICE), for_graph=for_graph)
        got = triton_attention.paged_attention_triton(case.query.to(DEVICE), case.key_cache.to(DEVICE),
                                                      case.value_cache.to(DEVICE), meta, case.scale).cpu()
        exact = reference_attention.paged_attention_reference(case.query.double(), case.key_cache.double(),
                                                    case.value_cache.double(), case.meta, case.scale)
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
        assert len(launches) == splits


def test_decode_splits_fill_the_gpu_from_shapes_alone():
    """Enough programs for twice the multiprocessors, a power of two up to MAX_SPLITS; none once the (request,
    kv head) pairs fill the GPU, and none off CUDA."""
    assert triton_attention.decode_splits(1, 8, 132) == 16  # 8 programs: 16 x 8 = 128, the cap
    assert triton_attention.decode_splits(4, 8, 132) == 16 and triton_attention.decode_splits(8, 8, 132) == 8
    assert triton_attention.decode_splits(16, 8, 132) == 4 and triton_attention.decode_splits(17, 8, 132) == 1
    assert triton_attention.decode_splits(2, 1, 0) == 1


def test_empty_steps_and_bad_layouts():
    case = make_case([], [], 2, 1, 64, 16, torch.float32)
    assert triton_attention.paged_attention_triton(case.query, case.key_cache, case.value_cache, case.meta,
                                                   case.scale).shape == (0, 2, 64)
    case = make_case([1], [9], 3, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="query heads 3 over 2 kv heads"):
        triton_attention.paged_attention_triton(case.query, case.key_cache, case.value_cache, case.meta, case.scale)


def test_the_launch_is_a_torch_custom_op():
    """torch.ops.pagellm.paged_attention runs the same launch behind torch's dispatcher (what torch.compile and
    graph capture see): its schema says it writes `out` alone, its fake implementation passes torch's checks, and
    it writes what the eager call returns, bit for bit (a mixed step with a window and a soft-cap)."""
    case = make_case([1, 6, 1], [20, 6, 9], 4, 2, 32, 16, torch.float32)
    query, key_cache, value_cache = (t.to(DEVICE) for t in (case.query, case.key_cache, case.value_cache))
    meta = case.meta if DEVICE == "cpu" else _meta_on(case.meta, DEVICE)
    eager = triton_attention.paged_attention_triton(query, key_cache, value_cache, meta, case.scale, 7, 30.0)
    op = torch.ops.pagellm.paged_attention.default
    assert "Tensor(a0!) out" in str(op._schema) and "!" not in str(op._schema).split("out", 1)[1]
    out = torch.full_like(query, float("nan"))
    args = (out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_seqs,
            meta.block_size, 64, case.scale, 7, 30.0, 1)
    op(*args)
    assert torch.equal(out, eager)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="block_m must be a multiple of the GQA group's 2 rows and at least 16"):
        op(*args[:9], 8, *args[10:])  # the op's callers skip the eager wrapper: it checks what it is given
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        op(*args[:13], 3)


def test_the_kernels_compile_for_hopper_and_ampere_gpus():
    """Triton's real code generator and ptxas (shipped in its wheel) need no GPU: every variant of the attention,
    the layer ops, the GGUF matmuls, the Gated DeltaNet's decode and prefill and the grouped MoE the model families
    use compile to a cubin for sm_90 (H100, H200) and sm_80 (A100). In a process of its own: this one imported
    triton under the interpreter (tests/conftest.py)."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.gpu.compile_for_gpus", "90", "80"], cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=600)  # hang guard
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    # two architectures x (the five attention variants, the split reduce, seven layer ops, the GGUF matmuls: eight
    # formats' gemv, three formats' split gemv, tile kernel and dequantization, four formats' int8-activation gemv
    # and its split one, the split reduce, the activations' quantization; the Gated DeltaNet's state-row copy,
    # conv update, delta rule and chunked prefill, both rules over a bf16 state too; the grouped MoE launch over
    # Q4_K and Q6_K and at the tile sweep's largest candidate, the router), each a real cubin
    assert len(lines) == 2 * (5 + 1 + 7 + 8 + 9 + 5 + 1 + 1 + 6 + 4) and all(int(line[-1]) > 4_000 for line in lines), \
        result.stdout
