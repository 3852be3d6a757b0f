"""GGUF files a device check writes where it runs (files of that size cannot travel to a GPU machine):

    write_llama_gguf   a Llama of a given shape in Q4_K_M's mix of types, valid blocks of random codes with
                       realistic scales (weights of about 0.02 in magnitude, as trained layers have)
    write_sample       a few tensors of a real GGUF, of the types a check wants, into a small file to carry

Q4_K_M's mix is llama.cpp's (llama_tensor_get_type): Q6_K for the output, and for attn_v and ffn_down in the
first and last eighth of the layers and every third layer between; Q4_K for every other matrix.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# each type's f16 scale fields: (byte offset in the block, low, high) of a uniform draw
_SCALES = {T.Q4_K: [(0, 5e-5, 1.5e-4), (2, 5e-5, 1.5e-4)], T.Q6_K: [(208, 1e-5, 3e-5)],
           T.Q8_0: [(0, 1e-4, 2e-4)], T.Q5_0: [(0, 1e-3, 2e-3)], T.Q4_0: [(0, 2e-3, 4e-3)]}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_types(layers: int) -> dict[str, T]:
    """{GGUF tensor name: type} of a Q4_K_M Llama's matrices."""
    types = {"token_embd.weight": T.Q4_K, "output.weight": T.Q6_K}
    for i in range(layers):
        wide = T.Q6_K if more_bits(i, layers) else T.Q4_K
        types |= {f"blk.{i}.attn_q.weight": T.Q4_K, f"blk.{i}.attn_k.weight": T.Q4_K,
                  f"blk.{i}.attn_v.weight": wide, f"blk.{i}.attn_output.weight": T.Q4_K,
                  f"blk.{i}.ffn_gate.weight": T.Q4_K, f"blk.{i}.ffn_up.weight": T.Q4_K,
                  f"blk.{i}.ffn_down.weight": wide}
    return types


def random_blocks(rng: np.random.Generator, ggml_type: T, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes per row] of valid blocks: random codes, each scale field a realistic f16."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = np.frombuffer(rng.bytes(rows * cols // block_size * type_size), np.uint8).reshape(-1, type_size).copy()
    for at, low, high in _SCALES[ggml_type]:
        scale = rng.uniform(low, high, blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _shapes(config: dict) -> Iterable[tuple[str, tuple[int, ...]]]:
    """(GGUF name, [rows, cols] or [n]) of every tensor of a Llama of `config` (HF field names)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    yield "token_embd.weight", (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        for name, shape in (("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
                            ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            yield f"blk.{i}.{name}.weight", shape
    yield "output_norm.weight", (hidden,)
    yield "output.weight", (vocab, hidden)


def write_llama_gguf(config: dict, path: Path, seed: int = 0) -> dict[str, T]:
    """A Q4_K_M Llama of `config` at `path`, a placeholder vocabulary of its size; returns the types written."""
    rng = np.random.default_rng(seed)
    types = q4_k_m_types(config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), "llama")
    heads = config["num_attention_heads"]
    writer.add_name("pagellm-device-check")
    for add, value in ((writer.add_context_length, 4096), (writer.add_embedding_length, config["hidden_size"]),
                       (writer.add_block_count, config["num_hidden_layers"]),
                       (writer.add_feed_forward_length, config["intermediate_size"]), (writer.add_head_count, heads),
                       (writer.add_head_count_kv, config["num_key_value_heads"]),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 500000.0)):
        add(value)
    add_placeholder_vocabulary(writer, config["vocab_size"])
    for name, shape in _shapes(config):
        if len(shape) == 1:
            writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            writer.add_tensor(name, random_blocks(rng, types[name], *shape), raw_dtype=types[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def add_placeholder_vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """A vocabulary of `size` tokens "t0", "t1", ...: the checks feed token ids, but a GGUF names its tokens."""
    vocab = [f"t{i}" for i in range(size)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_sample(source: Path, path: Path, wanted: Iterable[T], per_type: int = 2,
                 max_bytes: int = 8 << 20) -> list[str]:
    """Up to `per_type` 2-D tensors of each wanted type from the GGUF `source`, each at most `max_bytes`, into a
    GGUF at `path` (raw blocks, as stored); returns their names."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), "pagellm-sample")
    taken, counts = [], dict.fromkeys(wanted, 0)
    for tensor in reader.tensors:
        kind = T(tensor.tensor_type)
        if kind in counts and counts[kind] < per_type and len(tensor.shape) == 2 and tensor.n_bytes <= max_bytes:
            rows = int(tensor.shape[1])  # GGUF lists the shape innermost first
            writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(rows, -1), raw_dtype=kind)
            counts[kind] += 1
            taken.append(tensor.name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return taken
