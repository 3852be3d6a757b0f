"""A MoE layer's routed experts in one call (pagellm_gguf_moe through GGUFMoeExperts.forward): the bits of the
paths it replaces, the loop over the experts (each expert's gate/up, act * up, down, then out += y * w in ascending
expert id) and the grouped path, at every level, for the formats a Q4_K_M or Q8_0 file gives its experts; skipped
pairs (expert parallel), experts shared between tokens and ties between routing weights included."""

import dataclasses

import pytest
import torch

from pagellm.kernels.cpu import gguf_blocks, layer_ops
from pagellm.layers.gguf_moe import GGUFMoeExperts
from pagellm.layers.moe import MoeExperts
from pagellm.loader import gguf_repack
from tests.kernels import requires_compiler
from tests.kernels.gguf_blocks_builders import T, gguf_tensor

pytestmark = requires_compiler

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 12, 256, 256, 4


def _experts(gate_up: T, down: T, level: str, activation: str = "silu", seed: int = 0) -> GGUFMoeExperts:
    layer = GGUFMoeExperts(EXPERTS, HIDDEN, INTERMEDIATE, activation)
    for e in range(EXPERTS):
        for i, (proj, kind, rows, cols) in enumerate([("gate_proj", gate_up, INTERMEDIATE, HIDDEN),
                                                      ("up_proj", gate_up, INTERMEDIATE, HIDDEN),
                                                      ("down_proj", down, HIDDEN, INTERMEDIATE)]):
            data = gguf_tensor(kind, rows, cols, seed=seed + 3 * e + i)
            layer.put(e, proj, gguf_repack.repack(data, kind, (rows, cols)))
    layer.use_kernel_level(level)
    return layer


def _calls(layer: GGUFMoeExperts) -> list[int]:
    """The experts the layer runs one at a time from now on (none where one call runs them all)."""
    calls = []
    layer.expert = lambda x, e: calls.append(e) or GGUFMoeExperts.expert(layer, x, e)
    return calls


@pytest.mark.parametrize("gate_up,down", [(T.Q4_K, T.Q6_K), (T.Q4_K, T.Q4_K), (T.Q8_0, T.Q8_0), (T.Q5_0, T.Q8_0)],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, 4])
def test_one_call_is_the_loop_over_the_experts(gate_up, down, tokens, cpu_isa):
    layer = _experts(gate_up, down, cpu_isa)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])  # unsorted, as top-k
    weights = torch.rand(tokens, TOP_K, generator=g)
    weights[0, 1] = weights[0, 0]  # a tie: the sum still runs in expert order
    calls = _calls(layer)
    got = layer(x, weights, ids)
    assert calls == []  # one call, however many tokens
    assert torch.equal(got, MoeExperts._per_token(layer, x, weights, ids))
    assert torch.equal(got, layer._grouped(x, weights, ids))
    assert torch.equal(got[:1], layer(x[:1], weights[:1], ids[:1]))  # a token's rows alone


def test_tokens_sharing_their_experts_run_them_once(cpu_isa):
    """Where the tokens route to the same few experts, each expert runs once over all its rows, in the one call:
    the bits of the loop and of the grouped path."""
    layer = _experts(T.Q4_K, T.Q6_K, cpu_isa)
    x, weights = torch.randn(5, HIDDEN), torch.rand(5, TOP_K)
    ids = torch.tensor([[3, 1, 7, 0]] * 4 + [[7, 2, 3, 11]])  # 20 pairs of 6 experts
    calls = _calls(layer)
    got = layer(x, weights, ids)
    assert calls == []
    assert torch.equal(got, MoeExperts._per_token(layer, x, weights, ids))
    assert torch.equal(got, layer._grouped(x, weights, ids))


@pytest.mark.parametrize("gate_up,down", [(T.Q4_K, T.Q6_K), (T.Q5_0, T.Q8_0)], ids=lambda t: t.name)
def test_experts_of_many_rows_take_several_passes(gate_up, down, cpu_isa):
    """Runs of more rows than a pass over the weights holds, beside runs of one and a few, and a batch big enough
    that the threads quantize it (the panels of each expert laid out one after another)."""
    layer = _experts(gate_up, down, cpu_isa)
    g = torch.Generator().manual_seed(5)
    x, weights = torch.randn(40, HIDDEN, generator=g), torch.rand(40, TOP_K, generator=g)
    ids = torch.tensor([[0, 5, 9, 2]] * 30 + [[0, 5, 1, 3]] * 6 + [[4, 6, 7, 8]] * 3 + [[11, 10, 0, 5]])
    got = layer(x, weights, ids)
    assert torch.equal(got, layer._grouped(x, weights, ids))
    assert torch.equal(got[36:], MoeExperts._per_token(layer, x[36:], weights[36:], ids[36:]))
    big = torch.randn(300, HIDDEN, generator=g)
    big_ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(300)])
    big_weights = torch.rand(300, TOP_K, generator=g)
    assert torch.equal(layer(big, big_weights, big_ids), layer._grouped(big, big_weights, big_ids))


def test_no_pair_routed_here_gives_zeros(cpu_isa):
    layer = _experts(T.Q8_0, T.Q8_0, cpu_isa)
    got = layer(torch.randn(2, HIDDEN), torch.rand(2, 2), torch.tensor([[-1, EXPERTS], [EXPERTS + 5, -3]]))
    assert torch.equal(got, torch.zeros(2, HIDDEN))


def test_experts_held_elsewhere_are_skipped(cpu_isa):
    """Expert parallel: local ids outside [0, X) are another rank's, which adds them."""
    layer = _experts(T.Q4_K, T.Q6_K, cpu_isa, activation="gelu_pytorch_tanh")
    x, weights = torch.randn(2, HIDDEN), torch.rand(2, 3)
    ids = torch.tensor([[5, -2, 1], [EXPERTS + 3, 0, -1]])
    got = layer(x, weights, ids + 100, first_expert=100)  # the layer holds experts 100 .. 100 + X - 1
    assert torch.equal(got, MoeExperts._per_token(layer, x, weights, ids))
    assert torch.equal(got, MoeExperts.forward(layer, x, weights, ids + 100, first_expert=100))  # grouped
    assert torch.equal(got[1], layer(x[1:], weights[1:, 1:2], ids[1:, 1:2])[0])  # only expert 0's


def test_what_it_does_not_take_goes_the_loop_s_way(cpu_isa):
    """bf16 activations, and gate and up of two formats (not joined), run the loop over the experts."""
    layer = _experts(T.Q4_K, T.Q6_K, cpu_isa)
    x, weights, ids = torch.randn(1, HIDDEN).bfloat16(), torch.rand(1, 2).bfloat16(), torch.tensor([[4, 2]])
    calls = _calls(layer)
    assert torch.equal(layer(x, weights, ids), MoeExperts._per_token(layer, x, weights, ids))
    assert calls == [2, 4, 2, 4]
    split = GGUFMoeExperts(2, HIDDEN, INTERMEDIATE, "silu")
    for e in range(2):
        for proj, kind, shape in [("gate_proj", T.Q4_K, (INTERMEDIATE, HIDDEN)),
                                  ("up_proj", T.Q5_K, (INTERMEDIATE, HIDDEN)),
                                  ("down_proj", T.Q6_K, (HIDDEN, INTERMEDIATE))]:
            split.put(e, proj, gguf_repack.repack(gguf_tensor(kind, *shape, seed=e), kind, shape))
    split.use_kernel_level(cpu_isa)
    assert "gate_up" not in split.formats
    x, weights, ids = torch.randn(1, HIDDEN), torch.rand(1, 2), torch.tensor([[1, 0]])
    assert torch.equal(split(x, weights, ids), MoeExperts._per_token(split, x, weights, ids))


def test_an_unknown_activation_is_refused(cpu_isa):
    layer = _experts(T.Q8_0, T.Q8_0, cpu_isa)
    gate_up, down = ((gguf_blocks.FORMAT_IDS[layer.formats[name]], *(layer.get_buffer(f"{name}_{p}") for p in
                                                                      layer.PARTS)) for name in ("gate_up", "down"))
    unknown = max(layer_ops.ACTIVATIONS.values()) + 1
    with pytest.raises(RuntimeError, match="pagellm_gguf_moe refused"):
        gguf_blocks.BoundMoe(gate_up, down, unknown, cpu_isa)(torch.randn(1, HIDDEN), torch.tensor([[0]]),
                                                              torch.rand(1, 1))


def test_torch_s_act_mul_keeps_the_loop(cpu_isa):
    """Where the layer's act_mul is torch's (no native layer ops), the one call, whose epilogue is the native
    act_mul, would not have the loop's bits: the loop runs."""
    layer = _experts(T.Q4_K, T.Q6_K, cpu_isa)
    layer.use_ops(dataclasses.replace(layer.ops, act_mul=None))
    calls = _calls(layer)
    x, weights, ids = torch.randn(1, HIDDEN), torch.rand(1, 2), torch.tensor([[3, 1]])
    assert torch.equal(layer(x, weights, ids), MoeExperts._per_token(layer, x, weights, ids))
    assert calls == [1, 3, 1, 3]  # both runs went through the experts one at a time
