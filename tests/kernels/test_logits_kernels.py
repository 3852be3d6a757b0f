"""The C++ logits kernels (pagellm/kernels/cpu/logits.py) against the torch expressions they replace."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagellm.kernels.cpu import logits as native_logits
from pagellm.kernels.build import native
from pagellm.kernels.build.binding import Flag, Function, Int, Tensor
from tests.kernels import requires_compiler

pytestmark = requires_compiler

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
def test_bf16_softcap_is_bit_identical_to_torch_on_every_bf16_value(cap, shape, cpu_isa):
    # Up to 65536 logits are capped one by one, from 2 * 65536 on through a table of every bf16
    # value: both, each with and without a partial vector at the end.
    x = every_bf16().repeat(4)[: shape[0] * shape[1]].view(shape)
    assert_same_bits(native_logits.logits_to_f32(x, cap, cpu_isa), torch_softcap(x, cap))


def test_fp32_softcap_within_a_few_ulp_of_torch(cpu_isa):
    torch.manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (2_000_000,), dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(1_000_000) * 30, torch.linspace(-600, 600, 100_001),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, -3e38])])
    x = x[~torch.isnan(x)]
    for cap in (30.0, 1.0):
        got = native_logits.logits_to_f32(x.view(1, -1), cap, cpu_isa).view(-1)
        assert int(ulp_distance(got, torch_softcap(x, cap)).max()) <= 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_infinities_soft_cap_as_torch(dtype, cpu_isa):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0]], dtype=dtype)
    want = torch_softcap(x, 30.0)
    assert_same_bits(native_logits.logits_to_f32(x, 30.0, cpu_isa), want)
    assert want[0, 1:3].tolist() == [30.0, -30.0]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", VOCAB)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shapes_with_and_without_cap(rows, vocab, dtype, cpu_isa):
    torch.manual_seed(rows * 31 + vocab)
    x = (torch.randn(rows, vocab) * 40).to(dtype)
    plain = native_logits.logits_to_f32(x, None, cpu_isa)
    assert plain.dtype == torch.float32 and torch.equal(plain, x.float())
    capped = native_logits.logits_to_f32(x, 30.0, cpu_isa)
    if dtype == torch.bfloat16:
        assert_same_bits(capped, torch_softcap(x, 30.0))
    else:
        assert int(ulp_distance(capped, torch_softcap(x, 30.0)).max()) <= 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_writes_into_a_given_buffer(dtype, cpu_isa):
    x = (torch.randn(3, 1000) * 40).to(dtype)
    buffer = torch.full((8, 1000), 7.0)
    out = buffer[:3]  # a reused [max_rows, V] buffer's leading rows
    assert native_logits.logits_to_f32(x, 30.0, cpu_isa, out=out) is out
    assert torch.allclose(out, torch_softcap(x, 30.0), rtol=1e-6, atol=0)
    assert native_logits.logits_to_f32(x, None, cpu_isa, out=out) is out and torch.equal(out, x.float())
    assert (buffer[3:] == 7.0).all()


def test_fp32_in_place_and_no_copy_without_cap(cpu_isa):
    x = torch.randn(2, 300) * 40
    assert native_logits.logits_to_f32(x, None, cpu_isa) is x  # as x.float()
    want = torch_softcap(x, 30.0)
    assert native_logits.logits_to_f32(x, 30.0, cpu_isa, out=x) is x
    assert int(ulp_distance(x, want).max()) <= 4


def test_rejects_a_wrong_buffer(cpu_isa):
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    for bad in (torch.empty(2, 17), torch.empty(2, 16, dtype=torch.bfloat16), torch.empty(16, 2).t()):
        with pytest.raises(ValueError):
            native_logits.logits_to_f32(x, 30.0, cpu_isa, out=bad)


def test_logits_to_f32_refuses_what_it_does_not_handle(cpu_isa):
    """Bound by a plan only for the model's own fp32/bf16 logits (kernels/ops.py): anything else is an error."""
    with pytest.raises(ValueError, match="logits_to_f32: takes"):  # not contiguous
        native_logits.logits_to_f32(torch.randn(4, 32)[:, ::2], 30.0, cpu_isa)
    with pytest.raises(ValueError, match="logits_to_f32: takes"):
        native_logits.logits_to_f32(torch.randn(4, 16, dtype=torch.float16), 30.0, cpu_isa)
    with pytest.raises(ValueError, match="logits_to_f32: takes"):
        native_logits.logits_to_f32(torch.randn(4, 16, dtype=torch.float64), None, cpu_isa)
    with pytest.raises(ValueError, match="logits_to_f32: takes"):
        native_logits.logits_to_f32(torch.randn(4, 0), 30.0, cpu_isa)
    with pytest.raises(ValueError, match="logits_to_f32: takes"):  # 0-d
        native_logits.logits_to_f32(torch.tensor(1.0), 30.0, cpu_isa)
    with pytest.raises(ValueError, match="logits_to_f32: takes"):
        native_logits.logits_to_f32(torch.randn(4, 16, device="meta"), 30.0, cpu_isa)


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
def test_argmax_matches_torch(rows, vocab, cpu_isa):
    x = planted(rows, vocab, seed=rows * 7 + vocab)
    assert torch.equal(native_logits.argmax_rows(x, cpu_isa), x.argmax(dim=-1))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("vocab", [64, 65, 100_003, 262144])
def test_argmax_ties_across_split_parts_and_threads(threads, vocab, cpu_isa):
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
            assert torch.equal(native_logits.argmax_rows(x, cpu_isa), x.argmax(dim=-1))
            assert torch.equal(native_logits.argmax_rows(planted(rows, vocab, seed=vocab), cpu_isa),
                               planted(rows, vocab, seed=vocab).argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def test_argmax_keeps_leading_dims(cpu_isa):
    x = torch.randn(2, 3, 50)
    assert torch.equal(native_logits.argmax_rows(x, cpu_isa), x.argmax(dim=-1))
    assert torch.equal(native_logits.argmax_rows(torch.randn(0, 50), cpu_isa), torch.empty(0, dtype=torch.int64))
    one_d = torch.randn(50)
    ids = native_logits.argmax_rows(one_d, cpu_isa)
    assert ids.shape == () and int(ids) == int(one_d.argmax())


def test_argmax_refuses_what_it_does_not_handle(cpu_isa):
    """The sampler binds it once for its level's fp32 logits (runner/sampler.greedy_argmax): a view is copied,
    anything else is an error."""
    view = torch.randn(4, 32)[:, ::2]
    assert torch.equal(native_logits.argmax_rows(view, cpu_isa), view.argmax(dim=-1))
    with pytest.raises(ValueError, match="argmax_rows: takes"):  # fp32 only
        native_logits.argmax_rows(torch.randn(4, 16, dtype=torch.bfloat16), cpu_isa)
    with pytest.raises(ValueError, match="argmax_rows: takes"):  # torch raises on an empty reduction
        native_logits.argmax_rows(torch.randn(4, 0), cpu_isa)
    with pytest.raises(ValueError, match="argmax_rows: takes"):
        native_logits.argmax_rows(torch.randn(4, 16, device="meta"), cpu_isa)


# ---- one result at every level ---------------------------------------------------------------
# The avx512, avx2 and generic builds compute one formula with the same roundings (exp512.h's exp at
# 16, 8 and 1 lanes; tanh built alike; fma where the vector code fuses): their outputs must be the
# same bits, which the per-level tests above cannot see (they only hold each level to torch).

_EXP = Function("pagellm_exp_f32", (Tensor("x", (torch.float32,)), Int("n"), Flag("which"),
                                    Tensor("out", (torch.float32,))), returns=ctypes.c_int)
_FMA = Function("pagellm_fma_f32", (*(Tensor(n, (torch.float32,)) for n in "abc"), Int("n"),
                                    Tensor("out", (torch.float32,))))


EXP_FORMS = {16: "exp512", 8: "exp256", 1: "exp_scalar", 0: "exp_lanes<8>"}


def vector_exp(x: torch.Tensor, level: str, form: int) -> torch.Tensor | None:
    """exp512.h's exp of x (fp32) by the `level` build in one of its forms (EXP_FORMS); None: not built in."""
    exp = _EXP.callers(getattr(native.bind("logits", [_EXP], level), _EXP.symbol))[1]
    out = torch.empty_like(x)
    return None if exp(x, x.numel(), form, out) else out


def exp_inputs() -> torch.Tensor:
    """Random fp32 bit patterns, a dense sweep of the finite range, ties of n = round(x log2 e), the clamps,
    the inputs whose e^x is denormal, and the special values."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int64).to(torch.int32)
    ln2 = 0.6931471805599453
    ties = torch.arange(-151, 130, dtype=torch.float64) + 0.5
    special = [0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754944e-38, 3.4028235e38, -3.4028235e38,
               float("inf"), -float("inf"), float("nan"), -104.0, 89.0, -103.97, -103.972, 88.72, 88.7228, 88.73,
               -87.33, -87.34, 1.0, -1.0, 0.5, -0.5]
    return torch.cat([bits.view(torch.float32), torch.rand(1_000_000, generator=g) * 250 - 130,
                      torch.linspace(-104.5, -87.0, 200_001), torch.linspace(88.0, 89.5, 20_001),
                      (ties * ln2).float(), torch.nextafter((ties * ln2).float(), torch.tensor(0.0)),
                      torch.tensor(special), -torch.tensor(special)])


@pytest.mark.across_levels
def test_vector_exp_is_the_same_bits_at_every_level_and_in_every_form():
    x = exp_inputs()
    results = {(level, EXP_FORMS[form]): out for level in native.host_levels() for form in EXP_FORMS
               if (out := vector_exp(x, level, form)) is not None}
    assert {("generic", "exp_scalar"), ("generic", "exp_lanes<8>")} <= results.keys()
    if "avx512" in native.host_levels():
        assert {("avx512", form) for form in EXP_FORMS.values()} <= results.keys()
    if "avx2" in native.host_levels():
        assert ("avx2", "exp256") in results and ("avx2", "exp512") not in results
    (first, want), *others = results.items()
    for key, got in others:  # NaN in: 0 out (the clamp takes -104 for a NaN), so no NaN to set apart
        differ = got.view(torch.int32) != want.view(torch.int32)
        assert not differ.any(), f"{key} vs {first}: {int(differ.sum())} differ, e.g. at {x[differ][:4]}"
    nan = torch.isnan(x)
    assert not torch.isnan(want).any() and (want[nan] == 0).all()
    ok = ~nan  # within one ulp of e^x correctly rounded (via fp64), denormal results included; 0 / inf past
    assert int(ulp_distance(want[ok], torch.exp(x[ok].double()).float()).max()) <= 1
    assert (want[x <= -104] == 0).all() and (want[x >= 89] == float("inf")).all()
    assert vector_exp(torch.tensor([0.0, -0.0, 88.73, -104.0]), "generic", 1).tolist() == [1.0, 1.0, float("inf"), 0.0]


def fma_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, c) fp32 where a * b + c rounded twice (via fp64) often differs from rounding once: a * b exact
    in fp32 or not, c half an fp32 ulp of it (+- a little), or nearly -a * b, or far smaller; also denormal
    results, random bit patterns and the special values."""
    g = torch.Generator().manual_seed(5)
    n = 400_000
    a = torch.ldexp(torch.randint(4096, 8192, (n,), generator=g).double(), torch.randint(-40, -5, (n,), generator=g))
    b = torch.ldexp(torch.randint(4096, 8192, (n,), generator=g).double(), torch.randint(-40, -5, (n,), generator=g))
    wide = torch.rand(n, generator=g) < 0.3  # full 24-bit significands: a * b not an fp32
    a = torch.where(wide, a * (1 + torch.rand(n, generator=g, dtype=torch.float64)), a).float().double()
    a = a * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    p = a * b  # exact
    half = torch.ldexp(torch.ones(n, dtype=torch.float64), torch.frexp(p).exponent - 25)
    k = torch.randint(-3, 4, (n,), generator=g).double()
    kind = torch.randint(3, (n,), generator=g)
    c = torch.where(kind == 0, half * (1 + k * torch.ldexp(torch.ones(n, dtype=torch.float64),
                                                             -torch.randint(1, 23, (n,), generator=g))),
                    torch.where(kind == 1, -p + half * k, p * torch.rand(n, generator=g, dtype=torch.float64)
                                * torch.ldexp(torch.ones(n, dtype=torch.float64), -torch.randint(0, 60, (n,), generator=g))))
    tiny = torch.rand(n, generator=g) < 0.1  # results below 2^-126
    a, b, c = a.float(), b.float(), c.float()
    a, c = (torch.where(tiny, torch.ldexp(t, torch.tensor(-100)), t) for t in (a, c))
    # Denormal results just off a midpoint of the denormals: c = k 2^-149 near 2^-127, a * b = 2^-150 (1 - i^2
    # 2^-40), which the fp64 sum rounds onto the midpoint c + 2^-150.
    m = 50_000
    i = torch.randint(1, 32, (m,), generator=g).double()
    sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
    da = ((1 + i * 2.0**-20) * 2.0**-75 * sign).float()
    db = ((1 - i * 2.0**-20) * 2.0**-75).float()
    k = torch.randint(2**21, 2**23, (m,), generator=g).double() * torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
    dc = (k * 2.0**-149).float()
    a, b, c = torch.cat([a, da]), torch.cat([b, db]), torch.cat([c, dc])
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 200_000), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.1754944e-38, 3.4028235e38, -3.4028235e38, 1.0, -1.0,
                            float("inf"), -float("inf"), float("nan")])
    sa, sb, sc = torch.cartesian_prod(special, special, special).unbind(-1)
    return torch.cat([a, bits[0], sa]), torch.cat([b, bits[1], sb]), torch.cat([c, bits[2], sc])


@pytest.mark.across_levels
def test_fma_is_rounded_once_at_every_level():
    # Builds without an FMA instruction (generic x86-64) emulate it (fma_f32.h): the same bits as the
    # instruction, which the avx2 / avx512 builds use.
    a, b, c = fma_inputs()

    def fma(at):
        out = torch.empty_like(a)
        _FMA.callers(getattr(native.bind("logits", [_FMA], at), _FMA.symbol))[1](a, b, c, a.numel(), out)
        return out

    results = native.each_level(fma)
    want = results[native.host_levels()[0]]
    twice = (a.double() * b.double() + c.double()).float()
    differ = twice.view(torch.int32) != want.view(torch.int32)
    assert differ.sum() > 10_000 and (differ & (want.abs() < 2.0**-126)).sum() > 10_000  # they test the rounding
    for got in results.values():
        assert_same_bits(got, want)


@pytest.mark.across_levels
@pytest.mark.parametrize("cap", [30.0, 1.0])
def test_fp32_softcap_is_the_same_bits_at_every_level(cap):
    # fp32 soft-capping is ~1.5 ulp from torch, but the same bits at every level; 1000003 values: a
    # partial vector at the end of the last block, and values past the tanh polynomial's switch at 0.55 cap.
    g = torch.Generator().manual_seed(4)
    bits = torch.randint(-(2**31), 2**31 - 1, (500_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(500_000, generator=g) * 40,
                   torch.tensor([0.55 * cap, -0.55 * cap, 0.0, -0.0, float("nan"), float("inf"), -float("inf")])])
    results = native.each_level(lambda at: native_logits.logits_to_f32(x.view(1, -1), cap, at).view(-1))
    want = results[native.host_levels()[0]]
    for got in results.values():
        assert_same_bits(got, want)


@pytest.mark.across_levels
@pytest.mark.parametrize("n", [13, 65536 + 13, 3 * 65536 + 13])  # direct, direct with tail, by table
def test_bf16_softcap_is_the_same_bits_at_every_level(n):
    x = every_bf16().repeat(4)[:n].view(1, n)
    results = native.each_level(lambda at: native_logits.logits_to_f32(x, 30.0, at))
    for got in results.values():
        assert_same_bits(got, torch_softcap(x, 30.0))


@pytest.mark.parametrize("vocab", [31, 32, 33, 95, 96, 97, 4099])
def test_argmax_between_vector_body_and_tail(vocab, cpu_isa):
    # The vector scans take whole groups (64 elements at avx512, 32 at avx2) and leave a tail: the answer
    # may be in either, tie across the boundary, or be a NaN in the tail only.
    g = torch.Generator().manual_seed(vocab)
    cases = []
    for where in {0, vocab // 2, vocab - 33, vocab - 32, vocab - 31, vocab - 1} - {v for v in range(-33, 0)}:
        x = torch.randn(vocab, generator=g)
        x[where] = 9.0
        cases.append(x)
        y = x.clone()
        y[vocab - 1] = 9.0  # a tie with the tail's last element: the earlier wins
        cases.append(y)
        z = x.clone()
        z[vocab - 1] = float("nan")  # NaN in the tail only
        cases.append(z)
        w = torch.full((vocab,), -float("inf"))
        w[where] = -1.0
        cases.append(w)
    cases.append(torch.full((vocab,), -float("inf")))
    x = torch.stack(cases)
    assert torch.equal(native_logits.argmax_rows(x, cpu_isa), x.argmax(dim=-1))


# ---- grammar masks ------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 262144])
def test_mask_rows_matches_the_torch_unpacking(vocab, cpu_isa):
    """Rows listed get -inf where their packed bit is 0 (words of all ones, all zeros and mixed); others untouched."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    bitmask[0, ::3] = -1
    bitmask[1, ::2] = 0
    bitmask[2, 0] = -2**31  # only the top bit: token 31
    rows = [4, 0, 2]
    got, want = logits.clone(), logits.clone()
    native_logits.mask_rows(got, bitmask, rows, cpu_isa)
    native_logits.mask_rows_torch(want, bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab].bool()
    assert torch.equal(torch.isinf(want[rows]), ~bits)  # the oracle itself: -inf exactly where the bit is 0
