"""The roofline's weight counts and GEMM peak for a GGUF run as stored (its layers are block matmuls)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from pagellm.bench.roofline import WeightCounts, runs_int8_activations
from pagellm.layers.gguf_linear import GGUFLinear
from pagellm.loader.model_loader import load_model
from tests.loader.gguf_builders import TinyDims, write_tiny_gguf

_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_a_gguf_run_as_stored_counts_its_block_layers_at_the_int8_peak(tmp_path):
    dims = TinyDims()
    types = {f"blk.{i}.{p}.weight": T.Q8_0 for i in range(dims.n_layers) for p in _PROJECTIONS}
    tiny = write_tiny_gguf(tmp_path / "llama.gguf", "llama", dims, types=types)
    model = load_model(str(tiny.path), torch.float32, torch.device("cpu"), with_tokenizer=False,
                       quantization="auto").model
    assert any(isinstance(m, GGUFLinear) for m in model.modules())  # the projections stayed in their blocks
    q, kv = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim
    per_layer = dims.hidden * (q + 2 * kv) + q * dims.hidden + 3 * dims.hidden * dims.intermediate
    counts = WeightCounts.of(model)
    assert counts.matmul_params == dims.n_layers * per_layer  # the block layers counted, the head apart
    assert runs_int8_activations(model)  # so the GEMM bound is the int8 peak, not the fp32 one
