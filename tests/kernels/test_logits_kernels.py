"""The C++ logits kernels (pagellm/kernels/logits.py) against the torch expressions they replace."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import logits as native_logits

pytestmark = pytest.mark.skipif(native_logits._kernel("argmax_rows") is None,
                                reason="native logits kernels could not be built here")

ROWS = [1, 3, 64]
VOCAB = [1, 17, 262144]


def every_bf16() -> torch.Tensor:
    """All 65536 bf16 bit patterns (NaNs, infinities, denormals, both zeros included)."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def torch_softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return (torch.tanh(logits / cap) * cap).float()  # as LlamaForCausalLM.compute_logits


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~nan  # NaN payloads aside
    assert not differ.any(), f"{int(differ.sum())} values differ, e.g. {got[differ][:4]} vs {want[differ][:4]}"


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def ordered(t):  # fp32 bits as integers ordered like the floats
        i = t.view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)

    return (ordered(a) - ordered(b)).abs()


# ---- logits_to_f32 --------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [30.0, 50.0, 1.0, 0.1, 7.3])
@pytest.mark.parametrize("shape", [(1, 65536), (3855, 17), (3, 65536), (7717, 17)])
def test_bf16_softcap_is_bit_identical_to_torch_on_every_bf16_value(cap, shape):
    # Up to 65536 logits are capped one by one, from 2 * 65536 on through a table of every bf16
    # value: both, each with and without a partial vector at the end.
    x = every_bf16().repeat(4)[: shape[0] * shape[1]].view(shape)
    assert_same_bits(native_logits.logits_to_f32(x, cap), torch_softcap(x, cap))


def test_fp32_softcap_within_a_few_ulp_of_torch():
    torch.manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (2_000_000,), dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(1_000_000) * 30, torch.linspace(-600, 600, 100_001),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, -3e38])])
    x = x[~torch.isnan(x)]
    for cap in (30.0, 1.0):
        got = native_logits.logits_to_f32(x.view(1, -1), cap).view(-1)
        assert int(ulp_distance(got, torch_softcap(x, cap)).max()) <= 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_infinities_soft_cap_as_torch(dtype):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0]], dtype=dtype)
    want = torch_softcap(x, 30.0)
    assert_same_bits(native_logits.logits_to_f32(x, 30.0), want)
    assert want[0, 1:3].tolist() == [30.0, -30.0]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", VOCAB)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shapes_with_and_without_cap(rows, vocab, dtype):
    torch.manual_seed(rows * 31 + vocab)
    x = (torch.randn(rows, vocab) * 40).to(dtype)
    plain = native_logits.logits_to_f32(x, None)
    assert plain.dtype == torch.float32 and torch.equal(plain, x.float())
    capped = native_logits.logits_to_f32(x, 30.0)
    if dtype == torch.bfloat16:
        assert_same_bits(capped, torch_softcap(x, 30.0))
    else:
        assert int(ulp_distance(capped, torch_softcap(x, 30.0)).max()) <= 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_writes_into_a_given_buffer(dtype):
    x = (torch.randn(3, 1000) * 40).to(dtype)
    buffer = torch.full((8, 1000), 7.0)
    out = buffer[:3]  # a reused [max_rows, V] buffer's leading rows
    assert native_logits.logits_to_f32(x, 30.0, out=out) is out
    assert torch.allclose(out, torch_softcap(x, 30.0), rtol=1e-6, atol=0)
    assert native_logits.logits_to_f32(x, None, out=out) is out and torch.equal(out, x.float())
    assert (buffer[3:] == 7.0).all()


def test_fp32_in_place_and_no_copy_without_cap():
    x = torch.randn(2, 300) * 40
    assert native_logits.logits_to_f32(x, None) is x  # as x.float()
    want = torch_softcap(x, 30.0)
    assert native_logits.logits_to_f32(x, 30.0, out=x) is x
    assert int(ulp_distance(x, want).max()) <= 4


def test_rejects_a_wrong_buffer():
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    for bad in (torch.empty(2, 17), torch.empty(2, 16, dtype=torch.bfloat16), torch.empty(16, 2).t()):
        with pytest.raises(ValueError):
            native_logits.logits_to_f32(x, 30.0, out=bad)


def test_logits_to_f32_declines_what_it_does_not_handle():
    assert native_logits.logits_to_f32(torch.randn(4, 32)[:, ::2], 30.0) is None  # not contiguous
    assert native_logits.logits_to_f32(torch.randn(4, 16, dtype=torch.float16), 30.0) is None
    assert native_logits.logits_to_f32(torch.randn(4, 16, dtype=torch.float64), None) is None
    assert native_logits.logits_to_f32(torch.randn(4, 0), 30.0) is None
    assert native_logits.logits_to_f32(torch.tensor(1.0), 30.0) is None  # 0-d
    assert native_logits.logits_to_f32(torch.randn(4, 16, device="meta"), 30.0) is None


# ---- argmax_rows ---------------------------------------------------------------------------


def planted(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random rows, some with ties for the maximum, NaNs, infinities or all -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    x[:, torch.randint(vocab, (1,), generator=g)] = 0.0  # exact values that ties can repeat
    for r in range(rows):
        kind = r % 6
        picks = torch.randint(vocab, (3,), generator=g)
        if kind == 1:  # the maximum two or three times
            x[r, picks] = x[r].max() + 1
        elif kind == 2:  # NaNs: the first one is the answer
            x[r, picks] = float("nan")
        elif kind == 3:  # +inf ties
            x[r, picks] = float("inf")
        elif kind == 4:
            x[r] = -float("inf")
        elif kind == 5:  # one NaN among +infs
            x[r, picks[:2]] = float("inf")
            x[r, picks[2]] = float("nan")
    return x


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", VOCAB)
def test_argmax_matches_torch(rows, vocab):
    x = planted(rows, vocab, seed=rows * 7 + vocab)
    assert torch.equal(native_logits.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("vocab", [64, 65, 100_003, 262144])
def test_argmax_ties_across_split_parts_and_threads(threads, vocab):
    # Rows are split between threads when they are fewer than the threads: the earliest part wins ties.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3):
            x = torch.zeros(rows, vocab)
            x[:, vocab - 1] = 5.0
            x[:, vocab // 2 + 1] = 5.0
            if rows > 1:
                x[1, vocab - 2] = float("nan")
                x[2, 0] = 5.0
            assert torch.equal(native_logits.argmax_rows(x), x.argmax(dim=-1))
            assert torch.equal(native_logits.argmax_rows(planted(rows, vocab, seed=vocab)),
                               planted(rows, vocab, seed=vocab).argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def test_argmax_keeps_leading_dims():
    x = torch.randn(2, 3, 50)
    assert torch.equal(native_logits.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(native_logits.argmax_rows(torch.randn(0, 50)), torch.empty(0, dtype=torch.int64))
    one_d = torch.randn(50)
    assert native_logits.argmax_rows(one_d).shape == () and int(native_logits.argmax_rows(one_d)) == int(one_d.argmax())


def test_argmax_declines_what_it_does_not_handle():
    assert native_logits.argmax_rows(torch.randn(4, 32)[:, ::2]) is None  # not contiguous
    assert native_logits.argmax_rows(torch.randn(4, 16, dtype=torch.bfloat16)) is None  # fp32 only
    assert native_logits.argmax_rows(torch.randn(4, 0)) is None  # torch raises on an empty reduction
    assert native_logits.argmax_rows(torch.randn(4, 16, device="meta")) is None
