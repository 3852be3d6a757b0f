"""GGUF tensors in every kernel format for tests: legacy formats quantized by the gguf package from floats, K
formats (which it cannot quantize) as random valid blocks (tests/loader/gguf_builders.py's)."""

import gguf
import numpy as np

from tests.loader.gguf_builders import random_k_quant_blocks

T = gguf.GGMLQuantizationType
KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


def gguf_tensor(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw block bytes of a [rows, cols] tensor of `ggml_type`."""
    rng = np.random.default_rng(seed)
    if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_k_quant_blocks(rng, rows, cols, ggml_type)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), ggml_type)
