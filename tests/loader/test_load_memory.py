"""What loading a GGUF leaves in the process: no heavy imports, and no file pages held twice."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagellm.loader import gguf_repack
from pagellm.loader.gguf import read_gguf_header
from tests.kernels.gguf_blocks_builders import gguf_tensor
from tests.loader.gguf_builders import write_tiny_gguf
from tests.models.tiny_checkpoints import write_char_tokenizer, write_tiny_checkpoint


SOURCES = ["gemma3 gguf", "qwen3 gguf", "llama gguf", "llama hf"]


@pytest.fixture(scope="module")
def loads_in_fresh_interpreters(tmp_path_factory):
    """{source: its running process}: each source loaded by an interpreter of its own (this one has the heavy
    modules already), all started at once: each is mostly its own start-up, so side by side they take about half
    the time one after another did. Each test waits for its own."""
    procs = {}
    for source in SOURCES:
        arch, kind = source.split()
        directory = tmp_path_factory.mktemp(source.replace(" ", "-"))
        if kind == "gguf":
            path = write_tiny_gguf(directory / "tiny.gguf", arch, tie_embeddings=True).path
        else:
            path = directory / "tiny-hf"
            write_tiny_checkpoint(arch, path)
            write_char_tokenizer(path)
        code = ("import sys, torch; from pagellm.loader.model_loader import load_model; "
                f"load_model({str(path)!r}, torch.float32, torch.device('cpu'), quantization='auto'); "
                "print(sorted(m for m in sys.modules if m in ('torch._dynamo', 'triton', "
                "'transformers.modeling_utils')))")
        procs[source] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("source", SOURCES)
def test_loading_a_model_imports_neither_torch_dynamo_nor_hf_modeling_code(loads_in_fresh_interpreters, source):
    """Both stay in resident memory for good (docs/benchmarks/2026-11-24-where-the-memory-goes.md), and the engine
    runs neither. A fresh interpreter, since this one has them already. (Llama: transformers' config class
    would import torch._dynamo; loader/hf_configs.py declares its own.)"""
    run = loads_in_fresh_interpreters[source]
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-2000:]
    assert stdout.strip().splitlines()[-1] == "[]"


def test_repack_reports_every_row_consumed_once_in_order_and_builds_the_same_weight():
    """The loader drops the file's pages of each chunk as repack reports it consumed; the chunks must cover the
    tensor exactly, and reporting must not change the weight."""
    rows, cols = 2 * 1024 + 48, 256  # two whole chunks and a partial one
    data = gguf_tensor(T.Q4_K, rows, cols)
    seen = []
    reported = gguf_repack.repack(data, T.Q4_K, (rows, cols), consumed=lambda a, b: seen.append((a, b)))
    plain = gguf_repack.repack(data, T.Q4_K, (rows, cols))
    assert seen[0][0] == 0 and seen[-1][1] == rows
    assert all(prev[1] == nxt[0] for prev, nxt in zip(seen, seen[1:]))
    for got, want in zip((reported.qs, reported.gp, reported.sp), (plain.qs, plain.gp, plain.sp)):
        assert torch.equal(got, want)


def _mapping_rss_kb(address: int) -> int:
    """Resident KB of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and first == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_rows_released_part_by_part_leave_the_resident_set_and_read_back_the_same(tmp_path):
    """GGUFTensor.release of a row range (what repack's chunks call) drops those rows' file pages from the
    process's resident set, not the others'; dropped, they fault back in from the file unchanged."""
    big = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", extra_tensors={"big": big})
    tensor = read_gguf_header(tiny.path).tensor("big")
    before = np.array(tensor.data, copy=True)  # every page read: resident
    address = tensor.data.ctypes.data
    resident = _mapping_rss_kb(address)
    tensor.release(0, 256)
    dropped = resident - _mapping_rss_kb(address)
    assert 900 <= dropped <= 1100, dropped  # the first half's 1 MiB, not the rest
    for first in range(256, 512, 5):
        tensor.release(first, min(first + 5, 512))
    assert resident - _mapping_rss_kb(address) >= 1900
    assert np.array_equal(np.asarray(tensor.data), before)
