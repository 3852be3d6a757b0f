"""The native Gated DeltaNet decode kernel (csrc/gated_delta_decode.cpp) against the torch reference.

Two levels: the rule kernel against gated_delta_step_ on the same slots, and the layer's
native decode (conv + rule) against its torch decode (`_decode_torch`, the oracle) on two
copies of the same layer and state, over several steps, for scattered, consecutive and
single slots, GQA ratio 1 and 2, fp32 and bf16 inputs, fp32 and bf16 recurrent states (a bf16 state is widened,
updated in fp32 and rounded back once a step: the reference does the same on an fp32 copy).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pagellm.kernels.cpu import gated_delta_decode
from pagellm.kernels.build import native
from pagellm.kernels.reference.gated_delta import gated_delta_step_, prepare_qk
from pagellm.layers.gated_delta_net import GatedDeltaNet
from pagellm.layers.kernel_user import bind_kernel_level
from tests.kernels import requires_compiler

pytestmark = requires_compiler

NUM_SLOTS = 8
SLOTS = {"scattered": [5, 1, 3], "consecutive": [2, 3, 4], "single": [6]}


def _pattern(shape, dtype=torch.float32) -> torch.Tensor:
    """Untouched rows must stay bit-identical: fill every slot with NaN, then give some a finite pattern."""
    return torch.full(shape, float("nan"), dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _rule_inputs(batch, hk, hv, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(torch.randn(batch, hk, dk, generator=gen), torch.randn(batch, hk, dk, generator=gen), hk)
    v = torch.randn(batch, hv, dv, generator=gen)
    g = -torch.rand(batch, hv, generator=gen) * 2.0
    beta = torch.rand(batch, hv, generator=gen)
    return q, k, v, g, beta


STATE_TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5),
                   # a bf16 state: a one-ulp rounding flip where the fp32 sums differ in their last bit
                   torch.bfloat16: dict(atol=1e-6, rtol=2 ** -7)}


@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
@pytest.mark.parametrize("hk,hv", [(4, 4), (2, 4)], ids=["r1", "r2"])
@pytest.mark.parametrize("dk,dv", [(32, 64), (16, 12), (128, 128)], ids=["tile", "scalar-tail", "qwen"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state-fp32", "state-bf16"])
def test_rule_kernel_matches_step_in_place(slots, hk, hv, dk, dv, state_dtype, cpu_isa):
    state = _pattern((NUM_SLOTS, hv, dk, dv), state_dtype)
    state[slots] = torch.randn(len(slots), hv, dk, dv, generator=torch.Generator().manual_seed(0)).to(state_dtype)
    reference, before, address = state.clone(), state.clone(), state.data_ptr()
    index = torch.tensor(slots)
    for step in range(4):
        if state_dtype == torch.bfloat16:  # each step from the kernel's state: a flip would grow in later steps
            reference = state.clone()
        q, k, v, g, beta = _rule_inputs(len(slots), hk, hv, dk, dv, seed=step)
        out = gated_delta_decode.rule_decode_(state, index, q, k, v, g, beta, cpu_isa)
        qr, kr = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
        for b, slot in enumerate(slots):  # the reference, one request at a time on its slot (in fp32)
            held = reference[slot].float()
            expected = gated_delta_step_(held, qr[b], kr[b], v[b], g[b], beta[b])
            reference[slot] = held.to(state_dtype)
            torch.testing.assert_close(out[b], expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state, reference, **STATE_TOLERANCE[state_dtype], equal_nan=True)
        if state_dtype == torch.bfloat16:  # rounded to nearest as torch rounds: flips are rare, not half the cells
            assert (_bits(state[slots]) != _bits(reference[slots])).float().mean() < 0.01
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(_bits(state[untouched]), _bits(before[untouched]))
    assert state.data_ptr() == address


def _layer(hk: int, hv: int, dtype: torch.dtype, level: str | None, dk: int = 16, dv: int = 16,
           state_dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
    """A layer calling the kernels at `level`, its state bound to NUM_SLOTS slots of NaN."""
    config = SimpleNamespace(hidden_size=32, linear_num_key_heads=hk, linear_num_value_heads=hv,
                             linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4,
                             hidden_act="silu", rms_norm_eps=1e-6)
    layer = GatedDeltaNet(config, fused_projections=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    layer.to(dtype)
    layer.A_log.data = layer.A_log.data.float()  # as loaded: the gate parameters stay fp32
    layer.dt_bias.data = layer.dt_bias.data.float()
    layer.state_dtype = state_dtype
    shapes = layer.state_shapes()
    conv = _pattern((NUM_SLOTS, *shapes.conv_state), shapes.conv_dtype)
    rec = _pattern((NUM_SLOTS, *shapes.recurrent_state), shapes.recurrent_dtype)
    layer.bind_state(conv, rec)
    bind_kernel_level(layer, level)
    return layer


def _fill_slots(layer: GatedDeltaNet, slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(2)
    for slot in slots:  # a continuing request: finite conv history and state
        layer.conv_state[slot] = torch.randn(layer.conv_state.shape[1:], generator=gen).to(layer.conv_state.dtype)
        layer.recurrent_state[slot] = (torch.randn(layer.recurrent_state.shape[1:], generator=gen) * 0.3).to(
            layer.recurrent_state.dtype)


def _step_inputs(layer: GatedDeltaNet, batch: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, layer.conv_dim, generator=gen).to(dtype)
    g = -torch.rand(batch, layer.num_v_heads, generator=gen)
    beta = torch.rand(batch, layer.num_v_heads, generator=gen).to(dtype)  # sigmoid(b) in the model dtype
    return x, g, beta


class _StateOps(TorchFunctionMode):
    """Names of the torch functions / tensor methods called on the given tensors (as any argument)."""

    def __init__(self, *tensors: torch.Tensor):
        super().__init__()
        self.ids = {id(t) for t in tensors}
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(id(a) in self.ids for a in (*args, *(kwargs or {}).values())):
            self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


# What the native path may do with the bound state tensors: read metadata, pass the pointer.
_METADATA_ONLY = {"__get__", "data_ptr", "is_contiguous", "size", "dim"}


@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)], ids=["r1", "r2"])
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
                         ids=["fp32", "bf16", "bf16-state-bf16", "fp32-state-bf16"])
def test_layer_native_decode_matches_torch_decode(slots, hk, hv, dtype, state_dtype, cpu_isa):
    native, reference = (_layer(hk, hv, dtype, cpu_isa, state_dtype=state_dtype) for _ in range(2))
    _fill_slots(native, slots)
    _fill_slots(reference, slots)
    conv_before, rec_before = native.conv_state.clone(), native.recurrent_state.clone()
    addresses = (native.conv_state.data_ptr(), native.recurrent_state.data_ptr())
    # bf16: the conv output is rounded to bf16 before q/k/v, and a rare one-ulp difference in
    # the fp32 sum of the 4 taps can flip that rounding; everything after is fp32.
    # A bf16 state: one-ulp flips of its rounding, where the kernel's fp32 sums and torch's differ in a last bit.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    state_tol = tol if state_dtype == torch.float32 else STATE_TOLERANCE[torch.bfloat16]
    with torch.inference_mode():
        for step in range(5):
            if state_dtype == torch.bfloat16:  # each step from the kernel's state: a flip would grow in later steps
                reference.recurrent_state.copy_(native.recurrent_state)
            x, g, beta = _step_inputs(native, len(slots), dtype, seed=10 + step)
            recorder = _StateOps(native.conv_state, native.recurrent_state)
            with recorder:
                out = native._decode_native(x, g, beta, slots, torch.tensor(slots), native.ops.gated_delta_decode)
            expected = reference._decode_torch(x, g, beta, slots)
            assert out is not None and out.dtype == dtype
            torch.testing.assert_close(out, expected, **tol)
            torch.testing.assert_close(native.conv_state, reference.conv_state, **tol, equal_nan=True)
            torch.testing.assert_close(native.recurrent_state, reference.recurrent_state, **state_tol, equal_nan=True)
            # No copy of the batch's states: the kernel is handed the whole bound tensors and the
            # slot indices, so no torch op ever reads state[slots] (which would gather) or writes it
            # back. We can only observe this from the outside: no torch op other than metadata reads
            # (no indexing, index_select, index_copy_, clone, copy_) saw the state tensors, and they
            # were neither reallocated nor rebound.
            assert recorder.names <= _METADATA_ONLY, recorder.names
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(_bits(native.conv_state[untouched]), _bits(conv_before[untouched]))
    assert torch.equal(_bits(native.recurrent_state[untouched]), _bits(rec_before[untouched]))
    assert (native.conv_state.data_ptr(), native.recurrent_state.data_ptr()) == addresses


def test_unsupported_inputs_are_refused_without_touching_state(cpu_isa):
    """A conv state in another dtype than the step's inputs, or a slot outside the states, is refused before
    either kernel moves a slot: an error, not a silent switch to the torch path (a plan binds the kernels only
    for the model's own dtype, kernels/ops.py)."""
    layer = _layer(2, 2, torch.float32, cpu_isa)
    _fill_slots(layer, [1, 3])
    before = (layer.conv_state.clone(), layer.recurrent_state.clone())
    x, g, beta = _step_inputs(layer, 2, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="gated delta decode: conv state torch.float32, x torch.bfloat16"):
        layer._decode(x, g, beta, [1, 3])
    with pytest.raises(IndexError, match="outside the"):
        layer._decode(x.float(), g, beta, [1, NUM_SLOTS])
    assert torch.equal(_bits(layer.conv_state), _bits(before[0]))
    assert torch.equal(_bits(layer.recurrent_state), _bits(before[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_kernel_matches_torch_over_extreme_inputs(dtype, cpu_isa):
    """The kernel's vectorised exp in SiLU, over pre-activations from -300 to 300 (0 / inf in e^-x), and a
    channel count that is not a multiple of the vector width."""
    channels, taps, slots = 37 * 16 + 5, 4, [2, 0]
    gen = torch.Generator().manual_seed(5)
    state = (torch.randn(3, channels, taps - 1, generator=gen) * 100).to(dtype)
    weight = torch.rand(channels, taps, generator=gen).to(dtype)
    x = (torch.randn(len(slots), channels, generator=gen) * 100).to(dtype)
    expected_state = state.clone()
    window = torch.cat([state[slots], x[:, :, None]], dim=-1)
    expected = torch.nn.functional.silu((window.float() * weight.float()).sum(-1).to(dtype))
    expected_state[slots] = window[:, :, 1:]
    out = gated_delta_decode.conv_decode_(state, torch.tensor(slots), x, weight, cpu_isa)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, expected, **tol)
    assert torch.equal(_bits(state), _bits(expected_state))  # the shift moves values, no arithmetic


# ---- one result at every level ---------------------------------------------------------------
# The avx512, avx2 and generic builds do the same operations in the same order (per column an fma chain
# over dk, one rounded product and an fma per state update, the SiLU's exp from exp512.h at 16, 8 or 1
# lanes): outputs and states must be the same bits at every level.


def _assert_levels_agree(results: dict) -> None:
    (first, want), *others = results.items()
    for level, got in others:
        for a, b in zip(got, want):
            assert torch.equal(_bits(a), _bits(b)), f"{level} differs from {first}"


@pytest.mark.across_levels
@pytest.mark.parametrize("dk,dv", [(32, 64), (16, 12), (128, 128), (24, 40), (8, 200), (64, 7)],
                         ids=["tile", "scalar-tail", "qwen", "avx2-tile+tail", "wide", "narrow"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state-fp32", "state-bf16"])
def test_rule_kernel_is_the_same_bits_at_every_level(dk, dv, state_dtype):
    hk, hv, slots = 2, 4, [5, 1, 3]
    state0 = _pattern((NUM_SLOTS, hv, dk, dv), state_dtype)
    state0[slots] = torch.randn(len(slots), hv, dk, dv, generator=torch.Generator().manual_seed(0)).to(state_dtype)

    def run(at):
        state, outs = state0.clone(), []
        for step in range(3):
            q, k, v, g, beta = _rule_inputs(len(slots), hk, hv, dk, dv, seed=step)
            outs.append(gated_delta_decode.rule_decode_(state, torch.tensor(slots), q, k, v, g, beta, at))
        return (state, *outs)

    _assert_levels_agree(native.each_level(run))


@pytest.mark.across_levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels", [5, 37 * 16 + 5, 8192 + 3])
def test_conv_kernel_is_the_same_bits_at_every_level(dtype, channels):
    taps, slots = 4, [2, 0]
    gen = torch.Generator().manual_seed(channels)
    state0 = (torch.randn(3, channels, taps - 1, generator=gen) * 100).to(dtype)
    weight = torch.rand(channels, taps, generator=gen).to(dtype)
    x = (torch.randn(len(slots), channels, generator=gen) * 40).to(dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 300.0, -300.0])
    x[0, : min(8, channels)] = special[:channels].to(dtype)

    def run(at):
        state = state0.clone()
        return state, gated_delta_decode.conv_decode_(state, torch.tensor(slots), x, weight, at)

    results = native.each_level(run)
    nan = torch.isnan(results[native.host_levels()[0]][1])
    for _, out in results.values():  # NaN payloads aside (a NaN input's sum is NaN at every level)
        assert torch.equal(torch.isnan(out), nan)
        out[nan] = 0
    _assert_levels_agree(results)
