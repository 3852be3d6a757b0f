"""What loading a GGUF leaves in the process: no heavy imports, and no file pages held twice."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagellm.kernels import gguf_blocks
from pagellm.loader.gguf import read_gguf_header
from tests.kernels.gguf_blocks_builders import gguf_tensor
from tests.loader.gguf_builders import write_tiny_gguf


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_loading_a_gguf_imports_neither_torch_dynamo_nor_hf_modeling_code(tmp_path, arch):
    """Both stay in resident memory for good (docs/benchmarks/2026-11-24-where-the-memory-goes.md), and the engine
    runs neither. A fresh interpreter, since this one has them already. (Llama's HF config class still imports
    torch._dynamo: not asserted for it.)"""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, tie_embeddings=True).path
    code = ("import sys, torch; from pagellm.loader.model_loader import load_model; "
            f"load_model({str(path)!r}, torch.float32, torch.device('cpu'), quantization='auto'); "
            "print(sorted(m for m in sys.modules if m in ('torch._dynamo', 'triton', 'transformers.modeling_utils')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_repack_reports_every_row_consumed_once_in_order_and_builds_the_same_weight():
    """The loader drops the file's pages of each chunk as repack reports it consumed; the chunks must cover the
    tensor exactly, and reporting must not change the weight."""
    rows, cols = 2 * 1024 + 48, 256  # two whole chunks and a partial one
    data = gguf_tensor(T.Q4_K, rows, cols)
    seen = []
    reported = gguf_blocks.repack(data, T.Q4_K, (rows, cols), consumed=lambda a, b: seen.append((a, b)))
    plain = gguf_blocks.repack(data, T.Q4_K, (rows, cols))
    assert seen[0][0] == 0 and seen[-1][1] == rows
    assert all(prev[1] == nxt[0] for prev, nxt in zip(seen, seen[1:]))
    for got, want in zip((reported.qs, reported.gp, reported.sp), (plain.qs, plain.gp, plain.sp)):
        assert torch.equal(got, want)


def test_rows_released_part_by_part_read_back_the_same(tmp_path):
    """GGUFTensor.release of a row range (what repack's chunks call): the pages, dropped, fault back in from the
    file, the rows around the range included."""
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", types={"blk.0.ffn_down.weight": T.Q8_0})
    tensor = read_gguf_header(tiny.path).tensor("blk.0.ffn_down.weight")
    before = np.array(tensor.data, copy=True)
    rows = tensor.shape[0]
    for first in range(0, rows, 5):
        tensor.release(first, min(first + 5, rows))
    assert np.array_equal(np.asarray(tensor.data), before)
