"""The codes of a GGUF tensor laid out for the kernels at load (kernels/cpu/gguf_layout.py, csrc/gguf_layout.cpp):
the same bytes as loader/gguf_repack.py's numpy at every level, for every code width, the file's nibbles unpacked
the same, and whole repacks the same through either."""

from __future__ import annotations

import numpy as np
import pytest

from pagellm.kernels.cpu import gguf_layout
from pagellm.loader import gguf_repack
from tests.kernels import requires_compiler
from tests.kernels.gguf_blocks_builders import KERNEL_TYPES, gguf_tensor

pytestmark = requires_compiler


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("rows,cols", [(16, 32), (48, 96), (160, 2048)])
def test_codes_are_laid_out_as_numpy_lays_them(cpu_isa, bits, rows, cols):
    rng = np.random.default_rng(bits * rows + cols)
    codes = (rng.integers(-128, 128, (rows, cols)).astype(np.int8) if bits == 8  # Q8_0's codes are signed
             else rng.integers(0, 1 << bits, (rows, cols)).astype(np.uint8))
    laid = gguf_layout.code_bytes(codes, bits, cpu_isa)
    assert laid.dtype == np.uint8 and np.array_equal(laid, gguf_repack._code_bytes(codes, bits))


@pytest.mark.parametrize("bits,rows,cols", [(3, 16, 32), (7, 16, 32), (4, 17, 32), (4, 16, 33)])
def test_a_width_or_shape_it_cannot_lay_out_is_refused(cpu_isa, bits, rows, cols):
    with pytest.raises(ValueError, match="bits|refused"):
        gguf_layout.code_bytes(np.zeros((rows, cols), np.uint8), bits, cpu_isa)


@pytest.mark.parametrize("run,offset", [(16, 2), (16, 8), (32, 16), (32, 48)])  # Q4_0, Q5_1, Q4_K, Q5_K's
def test_nibbles_are_unpacked_as_numpy_unpacks_them(cpu_isa, run, offset):
    """From a column range of a file's blocks (rows apart), as the decoders read it."""
    blocks = np.random.default_rng(run + offset).integers(0, 256, (37, offset + 4 * run), dtype=np.uint8)
    codes = gguf_layout.unpack_nibbles(blocks[:, offset:], run, cpu_isa)
    assert np.array_equal(codes, gguf_repack._nibbles(blocks[:, offset:], run, level=None))
    with pytest.raises(ValueError, match="refused"):
        gguf_layout.unpack_nibbles(blocks[:, offset + 1:], run, cpu_isa)


def test_a_large_unpack_split_over_threads_is_numpy_s(cpu_isa):
    """Past a MiB of nibbles the rows are split over the threads (as a whole Q4_K tensor's are)."""
    blocks = np.random.default_rng(7).integers(0, 256, (9000, 144), dtype=np.uint8)
    blocks.flags.writeable = False  # as a view of the file's read-only map
    codes = gguf_layout.unpack_nibbles(blocks[:, 16:], 32, cpu_isa)
    assert np.array_equal(codes, gguf_repack._nibbles(blocks[:, 16:], 32, level=None))


def test_codes_wider_than_a_byte_are_refused(cpu_isa):
    with pytest.raises(ValueError, match="one byte"):
        gguf_layout.code_bytes(np.zeros((16, 32), np.int16), 4, cpu_isa)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES)
def test_a_repack_through_the_kernel_is_the_numpy_repack(cpu_isa, ggml_type):
    rows, cols = 32, 512
    data = gguf_tensor(ggml_type, rows, cols, seed=int(ggml_type))
    native_weight = gguf_repack.repack(data, ggml_type, (rows, cols), level=cpu_isa)
    numpy_weight = gguf_repack.repack(data, ggml_type, (rows, cols), level=None)
    for ours, reference in zip(native_weight.tensors(), numpy_weight.tensors()):
        assert np.array_equal(ours.numpy(), reference.numpy())
