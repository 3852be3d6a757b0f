"""GGUF tensors in every kernel format for tests: legacy formats quantized by the gguf package from floats, K
formats (which it cannot quantize) as random blocks with sensible scales: every bit pattern of their codes and
6-bit scales is a valid block, so random ones cover all of them."""

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def gguf_tensor(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw block bytes of a [rows, cols] tensor of `ggml_type`, values of order 0.01-1."""
    rng = np.random.default_rng(seed)
    if ggml_type not in (T.Q4_K, T.Q5_K, T.Q6_K):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    d = _f16_bytes(rng.uniform(0.5, 1.5, len(blocks)) * (0.002 if ggml_type == T.Q6_K else 0.02))
    if ggml_type == T.Q6_K:
        blocks[:, 208:210] = d
    else:
        blocks[:, 0:2], blocks[:, 2:4] = d, _f16_bytes(rng.uniform(0.5, 1.5, len(blocks)) * 0.02)
    return blocks.reshape(rows, -1)
