"""The Triton Gated DeltaNet decode (kernels/gpu/gated_delta.py) against the torch reference, under Triton's
interpreter on a CPU: the conv update and the delta rule in place at each request's slot, any slot order, head
sizes of no power of two, a key head shared by value heads, and a padded row (slot -1) that reads and writes
nothing."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels.reference.gated_delta import gated_delta_step_
from tests.gpu import DEVICE, under_interpreter

pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")


def _kernels():
    return under_interpreter(lambda: importlib.import_module("pagellm.kernels.gpu.gated_delta"))


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_conv_update_shifts_each_slot_and_skips_padding(dtype):
    kernels = _kernels()
    slots, channels, taps = [4, 0, -1, 2], 200, 4  # 200 channels: a partial block
    state = _rand(6, channels, taps - 1, seed=1).to(dtype)
    x, weight = _rand(4, channels, seed=2).to(dtype), _rand(channels, taps, seed=3).to(dtype)
    expected_state = state.clone()
    live = [b for b, s in enumerate(slots) if s >= 0]
    window = torch.cat([state[[slots[b] for b in live]], x[live, :, None]], dim=-1)  # [3, C, K]
    expected = torch.zeros_like(x)
    expected[live] = F.silu((window.float() * weight.float()).sum(-1).to(dtype))
    expected_state[[slots[b] for b in live]] = window[:, :, 1:]
    out = kernels.conv_decode_(state, torch.tensor(slots, device=DEVICE), x, weight)
    torch.testing.assert_close(out, expected, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-5)
    assert torch.equal(state, expected_state)


def test_the_rule_updates_each_slot_in_place_and_skips_padding():
    kernels = _kernels()
    slots, v_heads, k_heads, dk, dv = [3, -1, 0], 4, 2, 24, 40  # dk, dv: no power of two; 2 value heads a key
    state = _rand(5, v_heads, dk, dv, seed=4)
    q, k = F.normalize(_rand(3, k_heads, dk, seed=5), dim=-1) * dk**-0.5, F.normalize(_rand(3, k_heads, dk, seed=6),
                                                                                      dim=-1)
    v, g, beta = _rand(3, v_heads, dv, seed=7), -torch.rand(3, v_heads).to(DEVICE), torch.rand(3, v_heads).to(DEVICE)
    expected_state = state.clone()
    live = [0, 2]
    heads = torch.arange(v_heads) // (v_heads // k_heads)
    flat = expected_state[[slots[b] for b in live]].flatten(0, 1).clone()  # [2 * Hv, dk, dv]
    expected_out = gated_delta_step_(flat, q[live][:, heads].flatten(0, 1), k[live][:, heads].flatten(0, 1),
                                     v[live].flatten(0, 1), g[live].flatten(), beta[live].flatten())
    expected_state[[slots[b] for b in live]] = flat.view(2, v_heads, dk, dv)
    out = kernels.rule_decode_(state, torch.tensor(slots, device=DEVICE), q, k, v, g, beta)
    torch.testing.assert_close(out[live], expected_out.view(2, v_heads, dv), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros(v_heads, dv, device=DEVICE))
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(state[[1, 2, 4]], expected_state[[1, 2, 4]])  # untouched slots: bit for bit


def test_a_bf16_state_is_read_widened_and_written_rounded():
    """The rule over a bf16 state and over its values in fp32: the same outputs, bit for bit, and each slot
    written the fp32 one rounded; a padded row touches nothing."""
    kernels = _kernels()
    slots, v_heads, k_heads, dk, dv = [3, -1, 0], 4, 2, 24, 40
    state = torch.full((5, v_heads, dk, dv), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    state[[3, 0]] = _rand(2, v_heads, dk, dv, seed=4).to(torch.bfloat16)
    wide = state.float()
    q, k = F.normalize(_rand(3, k_heads, dk, seed=5), dim=-1) * dk**-0.5, F.normalize(_rand(3, k_heads, dk, seed=6),
                                                                                      dim=-1)
    v, g, beta = _rand(3, v_heads, dv, seed=7), -torch.rand(3, v_heads).to(DEVICE), torch.rand(3, v_heads).to(DEVICE)
    index = torch.tensor(slots, device=DEVICE)
    out = kernels.rule_decode_(state, index, q, k, v, g, beta)
    assert torch.equal(out, kernels.rule_decode_(wide, index, q, k, v, g, beta))
    assert torch.equal(state.view(torch.int16)[[3, 0]], wide[[3, 0]].to(torch.bfloat16).view(torch.int16))
    assert state[[1, 2, 4]].isnan().all()


_stored_state = None  # the kernel module's stored_state, set by the test below for its jit kernel to call


def test_the_bf16_rounding_is_torchs_and_keeps_nans():
    """stored_state's rounding by bits against torch's cast: finite values, ties, the largest floats, infinities,
    and NaNs of every payload (a GPU's canonical 0x7fffffff would carry into the sign without the guard)."""
    globals()["_stored_state"] = _kernels().stored_state  # a jit function reads its module's globals, not closures

    def build():
        import triton
        import triton.language as tl

        @triton.jit
        def round_all(x_ptr, out_ptr, N: tl.constexpr):
            cells = tl.arange(0, N)
            tl.store(out_ptr + cells, _stored_state(tl.load(x_ptr + cells), out_ptr))
        return round_all

    round_all = under_interpreter(build)

    special = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000,
               0x3F818000, 0x00000001, 0x80000000]
    bits = torch.tensor(special + torch.randint(0, 2**32, (53,), generator=torch.Generator().manual_seed(0)).tolist(),
                        dtype=torch.int64).to(torch.uint32).view(torch.float32)  # 64 values
    out = torch.empty(64, dtype=torch.bfloat16)
    under_interpreter(lambda: round_all[(1,)](bits, out, N=64))
    want = bits.to(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan) and nan[:4].all()
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_a_step_the_kernels_would_not_take_is_refused_before_any_state_moves():
    kernels = _kernels()
    conv, state = torch.zeros(2, 8, 3), torch.zeros(2, 1, 4, 4)
    with pytest.raises(IndexError, match="outside the 2 slots"):
        kernels.check_decode(conv, state, torch.zeros(1, 8), torch.zeros(8, 4), [2])
    with pytest.raises(ValueError, match="state torch.float16"):
        kernels.check_decode(conv, state.half(), torch.zeros(1, 8), torch.zeros(8, 4), [0])
    with pytest.raises(ValueError, match="slots: a \\[2\\] int64 tensor"):
        kernels.conv_decode_(conv, torch.tensor([0], device=conv.device), torch.zeros(2, 8), torch.zeros(8, 4))


def test_state_rows_are_copied_where_both_rows_are_real():
    """A captured verify step's rollback copies: rows src[b] -> dst[b] in both tensors, a -1 on either side
    nothing (a padded token, a draft-less request)."""
    kernels = _kernels()
    conv, state = _rand(6, 40, 3, seed=8), _rand(6, 2, 24, 40, seed=9)  # 2 * 24 * 40 = 1920: two copy blocks
    want_conv, want_state = conv.clone(), state.clone()
    src, dst = [0, 2, -1, 3], [4, -1, 5, 1]
    for s, d in zip(src, dst):
        if s >= 0 and d >= 0:
            want_conv[d], want_state[d] = conv[s], state[s]
    kernels.copy_state_rows_(conv, state, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    assert torch.equal(conv, want_conv) and torch.equal(state, want_state)
