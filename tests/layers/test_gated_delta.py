"""The gated delta rule (kernels/reference/gated_delta.py) and the Gated DeltaNet layer with slot-bound state.

The math is checked against HF's torch reference functions; the layer against HF's
Qwen3-Next / Qwen3.5 modules; the slot handling (fresh / continuation, chunked
prefill, batched decode through a view or a gather) against running one request
at a time.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextGatedDeltaNet, torch_chunk_gated_delta_rule,
                                                                torch_recurrent_gated_delta_rule)

from pagellm.kernels.reference.gated_delta import chunked_gated_delta, prepare_qk, recurrent_gated_delta_
from pagellm.layers.gated_delta_net import GatedDeltaNet
from pagellm.models.llama import load_checkpoint_weights
from pagellm.kernels.attention_metadata import AttentionMetadata

HK, HV, DK, DV = 2, 4, 16, 12


def _inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, HK, DK, generator=gen), torch.randn(length, HK, DK, generator=gen)
    v = torch.randn(length, HV, DV, generator=gen)
    g = -torch.rand(length, HV, generator=gen) * torch.tensor([0.02, 0.2, 1.0, 4.0])  # slow to fast decay
    beta = torch.rand(length, HV, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("length", [1, 5, 64, 65, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_and_recurrent_agree_and_match_hf(length, with_state):
    q, k, v, g, beta = _inputs(length, seed=length)
    state = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(7))
    if not with_state:
        state.zero_()
    qn, kn = prepare_qk(q, k, HV)
    chunked_out, chunked_state = chunked_gated_delta(qn, kn, v, g, beta, state)
    recurrent_state = state.clone()
    recurrent_out = recurrent_gated_delta_(qn, kn, v, g, beta, recurrent_state)
    torch.testing.assert_close(chunked_out, recurrent_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_state, recurrent_state, atol=1e-5, rtol=1e-5)
    hf_args = (q[None], k[None], v[None], g[None], beta[None])
    hf_kwargs = dict(initial_state=state[None] if with_state else None, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
    hf_chunk_out, hf_chunk_state = torch_chunk_gated_delta_rule(*hf_args, **hf_kwargs)
    hf_rec_out, hf_rec_state = torch_recurrent_gated_delta_rule(*hf_args, **hf_kwargs)
    torch.testing.assert_close(chunked_out, hf_chunk_out[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked_state, hf_chunk_state[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(recurrent_out, hf_rec_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(recurrent_state, hf_rec_state[0], atol=1e-5, rtol=1e-5)


def test_chunked_state_carries_across_calls():
    """Splitting a sequence anywhere (inside or across 64-token chunks) and carrying the state changes nothing."""
    q, k, v, g, beta = _inputs(140, seed=11)
    qn, kn = prepare_qk(q, k, HV)
    whole, whole_state = chunked_gated_delta(qn, kn, v, g, beta, torch.zeros(HV, DK, DV))
    state, outs = torch.zeros(HV, DK, DV), []
    for lo, hi in [(0, 7), (7, 77), (77, 140)]:
        out, state = chunked_gated_delta(qn[lo:hi], kn[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)


def _config(cls):
    return cls(hidden_size=48, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
               linear_value_head_dim=DV, linear_conv_kernel_dim=4, num_hidden_layers=1,
               layer_types=["linear_attention"])


def _layer_pair(hf_cls, config_cls, fused: bool):
    config = _config(config_cls)
    torch.manual_seed(0)
    hf_layer = hf_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in hf_layer.named_parameters():
            if name not in ("A_log", "dt_bias"):
                param.add_(torch.randn_like(param) * 0.2)
    ours = GatedDeltaNet(config, fused_projections=fused)
    load_checkpoint_weights(ours, [(n, p.detach().clone()) for n, p in hf_layer.named_parameters()],
                            torch.device("cpu"), skip=lambda name: False)
    return hf_layer, ours.eval()


def _bind(layer: GatedDeltaNet, num_slots: int = 8) -> None:
    shapes = layer.state_shapes()
    layer.bind_state(torch.full((num_slots, *shapes.conv_state), float("nan"), dtype=shapes.conv_dtype),
                     torch.full((num_slots, *shapes.recurrent_state), float("nan")))


def _meta(query_lens, seq_lens, slots) -> AttentionMetadata:
    return AttentionMetadata.build(list(query_lens), list(seq_lens), [[0]] * len(slots), 1024, state_slots=list(slots))


@pytest.mark.parametrize("hf_cls,config_cls,fused", [(Qwen3NextGatedDeltaNet, Qwen3NextConfig, True),
                                                     (Qwen3_5GatedDeltaNet, Qwen3_5TextConfig, False)])
def test_layer_matches_hf_prefill_and_chunked_continuation(hf_cls, config_cls, fused):
    hf_layer, ours = _layer_pair(hf_cls, config_cls, fused)
    # The output RMSNorm divides each head by its rms, and a head whose q·k is near 0 has a
    # tiny rms, which magnifies rounding: compare the rule's output (the norm's input) tightly
    # and the layer output more loosely.
    cores: dict[str, list[torch.Tensor]] = {"hf": [], "ours": []}
    hf_layer.norm.register_forward_hook(lambda m, args, out: cores["hf"].append(args[0].reshape(-1, HV, DV)))
    ours.norm.register_forward_hook(lambda m, args, out: cores["ours"].append(args[0]))
    x = torch.randn(90, 48, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = hf_layer(x[None])[0]  # no cache: HF's chunked rule from zero state
        _bind(ours)
        torch.testing.assert_close(ours(x, _meta([90], [90], [5])), expected, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(cores["ours"].pop(), cores["hf"][0], atol=1e-5, rtol=1e-5)
        _bind(ours)
        outs, done = [], 0
        for size in (2, 1, 7, 70, 10):  # continuations shorter than the conv window, and one > 64
            done += size
            outs.append(ours(x[done - size : done], _meta([size], [done], [3])))
        torch.testing.assert_close(torch.cat(outs), expected, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(torch.cat(cores["ours"]), cores["hf"][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[2, 3, 4], [6, 0, 3]], ids=["consecutive-view", "gathered"])
def test_batched_decode_updates_only_its_slots(slots):
    _, ours = _layer_pair(Qwen3NextGatedDeltaNet, Qwen3NextConfig, True)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randn(n, 48, generator=gen) for n in (5, 9, 3)]
    steps = torch.randn(3, 48, generator=gen)
    with torch.inference_mode():
        alone = []
        for prompt, step in zip(prompts, steps):  # each request alone, slot 1
            _bind(ours)
            ours(prompt, _meta([len(prompt)], [len(prompt)], [1]))
            alone.append(ours(step[None], _meta([1], [len(prompt) + 1], [1]))[0])
            final = (ours.conv_state[1].clone(), ours.recurrent_state[1].clone())
        _bind(ours)
        lens = [len(p) for p in prompts]
        ours(torch.cat(prompts), _meta(lens, lens, slots))
        batched = ours(steps, _meta([1, 1, 1], [n + 1 for n in lens], slots))
    torch.testing.assert_close(batched, torch.stack(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.conv_state[slots[2]], final[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.recurrent_state[slots[2]], final[1], atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(8) if s not in slots]
    assert ours.recurrent_state[untouched].isnan().all() and ours.conv_state[untouched].isnan().all()
