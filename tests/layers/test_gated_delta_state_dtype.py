"""The recurrent state kept in bf16 (CacheConfig.mamba_ssm_cache_dtype): read into fp32, the rule computed in fp32,
the state rounded once when written back (per decode token; per prefill chunk and snapshot).

The oracle is the same layer over an fp32 state started from the same values: every output must be the same bits,
and every bf16 row the fp32 row rounded, through the torch paths (the native and Triton kernels are checked against
these paths in tests/kernels and tests/gpu). Rows of the bound state start as NaN: anything read that was never
written shows up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagellm import LLM
from pagellm.config import CacheConfig
from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.layers.gated_delta_net import GatedDeltaNet, recurrent_state_dtype
from pagellm.layers.kernel_user import bind_kernel_level
from tests.layers.tiny_delta import tiny_gated_delta_net

NUM_ROWS = 12  # running slots 0-3, snapshot rows 4-11


def _layer(state_dtype: torch.dtype) -> GatedDeltaNet:
    layer = tiny_gated_delta_net()
    layer.state_dtype = state_dtype
    shapes = layer.state_shapes()
    assert shapes.recurrent_dtype == state_dtype
    layer.bind_state(torch.full((NUM_ROWS, *shapes.conv_state), float("nan"), dtype=shapes.conv_dtype),
                     torch.full((NUM_ROWS, *shapes.recurrent_state), float("nan"), dtype=state_dtype))
    bind_kernel_level(layer, None)  # the torch paths
    return layer


def _step(layer, xs: list[torch.Tensor], starts: list[int], slots: list[int], writes=()) -> torch.Tensor:
    """One step of requests xs[b] (tokens starts[b].. of each) at `slots`; writes: (request, position, row)."""
    meta = AttentionMetadata.build([len(x) for x in xs], [s + len(x) for s, x in zip(starts, xs)],
                                   [[0]] * len(xs), 1024, state_slots=slots, snapshot_writes=tuple(writes))
    with torch.inference_mode():
        return layer(torch.cat(xs), meta)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                       b.view(torch.int32 if b.dtype == torch.float32 else torch.int16))


def test_a_bf16_state_is_the_fp32_state_rounded_at_each_write():
    ours, oracle = _layer(torch.bfloat16), _layer(torch.float32)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 48, generator=gen)
    # Fresh prefills: 30 tokens (chunked) at slot 2, 4 tokens (recurrent) at slot 0.
    steps = [([x[:30], x[30:34]], [0, 0], [2, 0]),
             ([x[34:35], x[35:36]], [30, 4], [2, 0]),  # decodes at slots 2, 0: a gather, not a view
             ([x[36:37]], [31], [2]),  # a decode at one slot: a view of the bound state
             ([x[37:40]], [32], [2])]  # a continued chunk, from a rounded state
    for xs, starts, slots in steps:
        oracle.recurrent_state.copy_(ours.recurrent_state.float())  # both from the same (rounded) values
        oracle.conv_state.copy_(ours.conv_state)
        out, expected = _step(ours, xs, starts, slots), _step(oracle, xs, starts, slots)
        assert _same_bits(out, expected)
        assert _same_bits(ours.recurrent_state[slots], oracle.recurrent_state[slots].to(torch.bfloat16))
        assert _same_bits(ours.conv_state[slots], oracle.conv_state[slots])
    assert torch.isnan(ours.recurrent_state[[1, 3, *range(4, NUM_ROWS)]]).all()  # rows nobody wrote


@pytest.mark.parametrize("boundary", [3, 12], ids=["recurrent-pieces", "chunked-pieces"])
def test_a_request_goes_on_from_its_rounded_snapshot(boundary):
    """Past a snapshot a prefill goes on from the row as written (rounded), so a request resumed from that row
    (a prefix-cache hit) ends in the state of the request that wrote it, bit for bit (its outputs within fp32's
    rounding: torch's conv over a shorter window may sum in another order)."""
    layer = _layer(torch.bfloat16)
    x = torch.randn(30, 48, generator=torch.Generator().manual_seed(5))
    whole = _step(layer, [x], [0], [2], [(0, boundary, 4)])
    layer.copy_state([4], [3])  # the runner's restore into another request's slot
    tail = _step(layer, [x[boundary:]], [boundary], [3])
    torch.testing.assert_close(tail, whole[boundary:], atol=1e-6, rtol=1e-6)
    assert _same_bits(layer.recurrent_state[3], layer.recurrent_state[2])


def test_bf16_state_follows_fp32_over_a_long_request():
    """Rounded once per token, the state's error does not grow without bound: a decay below one shrinks what each
    rounding adds. After 200 decode tokens the outputs stay within a few bf16 ulps of the fp32 state's."""
    ours, oracle = _layer(torch.bfloat16), _layer(torch.float32)
    x = torch.randn(201, 48, generator=torch.Generator().manual_seed(4))
    _step(ours, [x[:1]], [0], [1])
    _step(oracle, [x[:1]], [0], [1])
    worst = 0.0
    for t in range(1, 201):
        out, expected = _step(ours, [x[t:t + 1]], [t], [1]), _step(oracle, [x[t:t + 1]], [t], [1])
        worst = max(worst, ((out - expected).norm() / expected.norm()).item())
    assert worst < 0.02, worst


def test_the_state_dtype_follows_the_setting_then_the_checkpoint():
    qwen35 = SimpleNamespace(text_config=SimpleNamespace(mamba_ssm_dtype="float32"))
    assert recurrent_state_dtype("auto", qwen35) == torch.float32
    assert recurrent_state_dtype("auto", SimpleNamespace(mamba_ssm_dtype="bfloat16")) == torch.bfloat16
    assert recurrent_state_dtype("auto", SimpleNamespace()) == torch.float32  # llama.cpp's and SGLang's
    assert recurrent_state_dtype("auto", SimpleNamespace(mamba_ssm_dtype="float16")) == torch.float32  # not kept
    assert recurrent_state_dtype("bfloat16", qwen35) == torch.bfloat16  # the setting wins
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        CacheConfig(mamba_ssm_cache_dtype="float16")
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        LLM(mamba_ssm_cache_dtype="fp8")
