"""layers/moe.py against HF's Qwen3-MoE / Qwen3-Next sparse blocks, and the per-expert -> stacked weight stream."""

from __future__ import annotations

import dataclasses
import pytest
import torch
from torch import nn
from transformers import Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from pagellm.kernels.ops import PER_TOKEN_MAX_TOKENS, REFERENCE, cuda_moe_path
from pagellm.layers.moe import MoeExperts, SparseMoeBlock, route, stack_expert_weights
from pagellm.models.llama import load_checkpoint_weights

HIDDEN, EXPERTS, INTER = 32, 8, 16


def _config(cls, **kwargs):
    config = cls(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=3, moe_intermediate_size=INTER,
                 shared_expert_intermediate_size=24, **kwargs)
    config._experts_implementation = "eager"  # HF's per-expert loop: the reference
    return config


def _hf_block(cls, config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    block = cls(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return block


def _ours_from(hf_block: nn.Module, config, shared: bool, normalize: bool) -> SparseMoeBlock:
    ours = SparseMoeBlock(config, normalize=normalize, shared_expert=shared)
    state = {name: p.detach().clone() for name, p in hf_block.named_parameters()}
    load_checkpoint_weights(ours, state.items(), torch.device("cpu"), skip=lambda name: False)
    return ours.eval()


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_qwen3_moe_block_matches_hf(normalize, num_tokens):
    config = _config(Qwen3MoeConfig, norm_topk_prob=normalize)
    hf_block = _hf_block(Qwen3MoeSparseMoeBlock, config)
    ours = _ours_from(hf_block, config, shared=False, normalize=normalize)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), hf_block(x[None])[0], atol=1e-5, rtol=1e-5)


def test_qwen3_next_block_with_shared_expert_matches_hf():
    config = _config(Qwen3NextConfig)
    hf_block = _hf_block(Qwen3NextSparseMoeBlock, config)
    ours = _ours_from(hf_block, config, shared=True, normalize=True)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), hf_block(x[None])[0], atol=1e-5, rtol=1e-5)


def test_router_renormalises_only_when_asked():
    logits = torch.randn(6, EXPERTS, generator=torch.Generator().manual_seed(3))
    raw, ids = route(logits, 2, normalize=False)
    normed, ids2 = route(logits, 2, normalize=True)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, ids))
    torch.testing.assert_close(normed.sum(-1), torch.ones(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_paths_agree(dtype):
    experts = MoeExperts(EXPERTS, HIDDEN, INTER, "silu")
    generator = torch.Generator().manual_seed(4)
    experts.gate_up_proj.data = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator).to(dtype)
    experts.down_proj.data = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator).to(dtype)
    x = torch.randn(9, HIDDEN, generator=generator).to(dtype)
    weights, ids = route(torch.randn(9, EXPERTS, generator=generator).to(dtype), 3, normalize=True)
    loop, per_token = experts._grouped(x, weights, ids), experts._per_token(x, weights, ids)
    grouped_mm = experts._grouped(x, weights, ids, use_grouped_mm=True)
    # Same expert order per token; only the matmul shapes differ (rows batched or not).
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(loop, per_token, **tol)
    torch.testing.assert_close(grouped_mm, loop, **tol)
    assert experts.dispatch(x[:PER_TOKEN_MAX_TOKENS]) == "per_token"
    assert experts.dispatch(x).startswith("grouped")


@pytest.mark.parametrize("dtype,path", [(torch.bfloat16, "grouped_mm"), (torch.float32, "grouped_loop")])
def test_cuda_batches_of_any_size_take_the_grouped_path(dtype, path):
    """On CUDA no batch takes the per-token loop (a host sync per token): bf16 runs the grouped call (the path
    test_dispatch_paths_agree checks on the CPU), other dtypes the loop over experts. The CUDA backend's choice
    (kernels/ops.cuda_moe_path), bound into the module as a plan binds it."""
    experts = MoeExperts(EXPERTS, HIDDEN, INTER, "silu")
    experts.use_ops(dataclasses.replace(REFERENCE, moe_path=cuda_moe_path))
    for tokens in (1, 9):
        assert experts.dispatch(torch.zeros(tokens, HIDDEN, dtype=dtype)) == path


def _per_expert_checkpoint(num_experts: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    weights = {}
    for e in range(num_experts):
        weights[f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(INTER, HIDDEN, generator=generator)
        weights[f"mlp.experts.{e}.up_proj.weight"] = torch.randn(INTER, HIDDEN, generator=generator)
        weights[f"mlp.experts.{e}.down_proj.weight"] = torch.randn(HIDDEN, INTER, generator=generator)
    return weights


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = SparseMoeBlock(_config(Qwen3MoeConfig), normalize=False, shared_expert=False)


def test_per_expert_keys_are_stacked_in_any_order():
    weights = _per_expert_checkpoint(EXPERTS, torch.Generator().manual_seed(5))
    weights["mlp.gate.weight"] = torch.randn(EXPERTS, HIDDEN)
    shuffled = sorted(weights.items(), key=lambda item: hash(item[0]) % 97)
    holder = _Holder()
    stream = list(stack_expert_weights(holder, shuffled, torch.device("cpu")))
    names = sorted(name for name, _ in stream)
    assert names == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    load_checkpoint_weights(holder, stream, torch.device("cpu"), skip=lambda name: False)
    experts = holder.mlp.experts
    for e in range(EXPERTS):
        assert torch.equal(experts.gate_up_proj[e, :INTER], weights[f"mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(experts.gate_up_proj[e, INTER:], weights[f"mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(experts.down_proj[e], weights[f"mlp.experts.{e}.down_proj.weight"])


def test_stacked_keys_pass_through_and_bad_experts_are_named():
    holder = _Holder()
    fused = {"mlp.experts.gate_up_proj": torch.zeros(EXPERTS, 2 * INTER, HIDDEN)}
    assert list(stack_expert_weights(holder, fused.items(), torch.device("cpu"))) == list(fused.items())
    weights = _per_expert_checkpoint(EXPERTS + 1, torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"mlp\.experts\.8\.\w+_proj\.weight"):
        list(stack_expert_weights(holder, weights.items(), torch.device("cpu")))
    partial = {k: v for k, v in _per_expert_checkpoint(EXPERTS, torch.Generator()).items() if ".3.up_proj" not in k}
    partial["mlp.gate.weight"] = torch.zeros(EXPERTS, HIDDEN)
    with pytest.raises(ValueError, match="missing.*mlp.experts.gate_up_proj"):
        load_checkpoint_weights(holder, stack_expert_weights(holder, partial.items(), torch.device("cpu")),
                                torch.device("cpu"), skip=lambda name: False)
