"""Tiny GGUF files written with gguf.GGUFWriter, with the HF weights they should load back to.

Each builder starts from HF-layout weights, applies llama.cpp's converter transforms (the Q/K row
permutation for `llama`, norm + 1 for `gemma3`), stores each tensor in a chosen GGML type and
returns the weights the loader must yield: the dequantized stored data in HF layout.
`convert_llama_checkpoint` converts a saved HF Llama checkpoint instead, rope_freqs.weight included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig

T = gguf.GGMLQuantizationType

# HF name templates -> GGUF names of a llama-like decoder layer ({i} = layer index)
LAYER_TENSORS = {
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
}
LLAMA_NORMS = {"model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight"}
QK_NORMS = {
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
}
GEMMA3_NORMS = {
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
}


@dataclass
class TinyDims:
    n_layers: int = 2
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 256  # rows of 256 let ffn_down hold K-quant blocks (256 values each)
    context: int = 128
    rope_base: float = 10000.0
    rms_eps: float = 1e-5


@dataclass
class TinyGGUF:
    path: Path
    dims: TinyDims
    expected: dict[str, np.ndarray]  # HF name -> float32 weights the loader must yield
    original: dict[str, np.ndarray]  # HF name -> the HF weights before conversion and storage
    types: dict[str, T] = field(default_factory=dict)  # GGUF name -> stored type


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: T) -> np.ndarray:
    """Valid Q4_K / Q5_K / Q6_K / Q3_K rows: random bytes with small positive f16 super-block scales.

    The gguf package can dequantize these types but not quantize them, so we write raw blocks.
    """
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):  # d, dmin: two f16 at the start of the block
        blocks[:, 0:4] = scales.reshape(-1, 4)
    elif qtype in (T.Q6_K, T.Q3_K):  # d: one f16 at the end of the block
        blocks[:, -2:] = scales[:, :2]
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, cols // block_size * type_size)


def store(rng: np.random.Generator, w: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """(array to write, its dequantized value). K-quants ignore w: their blocks are random."""
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K):
        raw = random_k_quant_blocks(rng, w.shape[0], w.shape[1], qtype)
    else:
        raw = gguf.quants.quantize(w.astype(np.float32), qtype)
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    dims: TinyDims | None = None,
    types: dict[str, T] | None = None,
    tie_embeddings: bool = False,
    vocab: list[str] | None = None,
    extra_metadata=None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
) -> TinyGGUF:
    """A GGUF of `arch` with random weights; `types` maps GGUF name -> GGML type (default F32)."""
    dims, types = dims or TinyDims(), dict(types or {})
    rng = np.random.default_rng(seed)
    vocab = vocab or [f"tok{i}" for i in range(64)]
    hf = _hf_weights(rng, arch, dims, len(vocab), tie_embeddings)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, dims, vocab)
    if extra_metadata:
        extra_metadata(writer)
    expected = {}
    for hf_name, gguf_name in _name_pairs(arch, dims, tie_embeddings):
        if hf_name not in hf:  # bias of a tensor this family has none of
            continue
        w = hf[hf_name]
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's norm weight as w + 1
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            n = dims.n_heads if "attn_q" in gguf_name else dims.n_kv_heads
            w = llama_cpp_permute(w, n)
        qtype = types.setdefault(gguf_name, T.F32)
        raw, stored = store(rng, w, qtype) if w.ndim == 2 else (w.astype(np.float32), w.astype(np.float32))
        writer.add_tensor(gguf_name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
        expected[hf_name] = _back_to_hf(arch, gguf_name, stored, dims)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, dims, expected, {k: hf[k] for k in expected}, types)


def convert_llama_checkpoint(hf_dir: Path, path: Path) -> np.ndarray | None:
    """Write `path` from the HF Llama checkpoint in `hf_dir` as llama.cpp's converter does (conversion/llama.py,
    LlamaModel; every tensor F32, no tokenizer). Returns the rope_freqs.weight it wrote, None if none."""
    hparams = AutoConfig.from_pretrained(hf_dir).to_dict()  # what the converter's load_hparams reads
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_checkpoint_metadata(writer, hparams)
    factors = llama_cpp_rope_factors(hparams)
    if factors is not None:  # the converter writes its generated tensors first
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hparams["num_hidden_layers"])
    with safe_open(str(hf_dir / "model.safetensors"), framework="np") as f:
        for name in f.keys():
            w = f.get_tensor(name).astype(np.float32)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = hparams["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
                w = llama_cpp_permute(w, heads)
            writer.add_tensor(name_map.get_name(name, try_suffixes=(".weight", ".bias")), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return factors


def llama_cpp_rope_factors(hparams: dict) -> np.ndarray | None:
    """rope_freqs.weight of rope_type llama3, as LlamaModel.generate_extra_tensors computes it (float32 torch,
    element by element). Like the converter, it takes original_max_position_embeddings from the top level of
    the config, 8192 when absent, not from rope_parameters."""
    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    rope = rope.get("full_attention", rope)
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = hparams.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _write_checkpoint_metadata(writer: gguf.GGUFWriter, hparams: dict) -> None:
    """TextModel + LlamaModel.set_gguf_parameters for a plain Llama; rope_type llama3 adds no scaling keys."""
    head_dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    rope = hparams.get("rope_parameters") or {}
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(hparams["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_bos_token_id(hparams["bos_token_id"])


def _back_to_hf(arch: str, gguf_name: str, stored: np.ndarray, dims: TinyDims) -> np.ndarray:
    """The HF-layout value of a stored tensor, without using the loader's own inverse.

    The permutation only reorders rows and quantization blocks never span rows, so unpermuting
    the dequantized rows is a pure index operation: row r of HF q_proj is stored at perm[r].
    """
    if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        n = dims.n_heads if "attn_q" in gguf_name else dims.n_kv_heads
        perm = llama_cpp_permute(np.arange(stored.shape[0]), n)  # stored row j holds HF row perm[j]
        hf = np.empty_like(stored)
        hf[perm] = stored
        return hf
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return stored - 1.0
    return stored


def _hf_weights(rng, arch: str, d: TinyDims, vocab_size: int, tie: bool) -> dict[str, np.ndarray]:
    q, kv = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    shapes = {
        "model.embed_tokens.weight": (vocab_size, d.hidden),
        "model.norm.weight": (d.hidden,),
    }
    if not tie:
        shapes["lm_head.weight"] = (vocab_size, d.hidden)
    layer_shapes = {
        "self_attn.q_proj.weight": (q, d.hidden),
        "self_attn.k_proj.weight": (kv, d.hidden),
        "self_attn.v_proj.weight": (kv, d.hidden),
        "self_attn.o_proj.weight": (d.hidden, q),
        "mlp.gate_proj.weight": (d.intermediate, d.hidden),
        "mlp.up_proj.weight": (d.intermediate, d.hidden),
        "mlp.down_proj.weight": (d.hidden, d.intermediate),
        "input_layernorm.weight": (d.hidden,),
        "post_attention_layernorm.weight": (d.hidden,),
        "self_attn.q_norm.weight": (d.head_dim,),
        "self_attn.k_norm.weight": (d.head_dim,),
        "pre_feedforward_layernorm.weight": (d.hidden,),
        "post_feedforward_layernorm.weight": (d.hidden,),
    }
    if arch == "qwen2":  # Qwen2 has biases on q/k/v
        layer_shapes.update({f"self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
    for i in range(d.n_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes.items()})
    return {name: rng.standard_normal(shape).astype(np.float32) * 0.5 for name, shape in shapes.items()}


def _name_pairs(arch: str, d: TinyDims, tie: bool) -> list[tuple[str, str]]:
    layer = dict(LAYER_TENSORS)
    layer.update(GEMMA3_NORMS if arch == "gemma3" else LLAMA_NORMS)
    if arch in ("qwen3", "gemma3"):
        layer.update(QK_NORMS)
    if arch == "qwen2":
        layer.update({f"model.layers.{{i}}.self_attn.{p}_proj.bias": f"blk.{{i}}.attn_{p}.bias" for p in "qkv"})
    pairs = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight")]
    if not tie:
        pairs.append(("lm_head.weight", "output.weight"))
    for i in range(d.n_layers):
        pairs += [(hf.format(i=i), g.format(i=i)) for hf, g in layer.items()]
    return pairs


def _write_metadata(writer: gguf.GGUFWriter, arch: str, d: TinyDims, vocab: list[str]) -> None:
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(d.context)
    writer.add_embedding_length(d.hidden)
    writer.add_block_count(d.n_layers)
    writer.add_feed_forward_length(d.intermediate)
    writer.add_head_count(d.n_heads)
    writer.add_head_count_kv(d.n_kv_heads)
    writer.add_key_length(d.head_dim)
    writer.add_value_length(d.head_dim)
    writer.add_layer_norm_rms_eps(d.rms_eps)
    writer.add_rope_freq_base(d.rope_base)
    if arch == "gemma3":
        writer.add_sliding_window(32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([-float(i) for i in range(len(vocab))])
    writer.add_token_types([_token_type(t) for t in vocab])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _token_type(token: str) -> int:
    if token == "<unk>":
        return gguf.TokenType.UNKNOWN
    if token.startswith("<0x") and len(token) == 6:
        return gguf.TokenType.BYTE
    if token.startswith("<") and token.endswith(">"):
        return gguf.TokenType.CONTROL
    return gguf.TokenType.NORMAL
