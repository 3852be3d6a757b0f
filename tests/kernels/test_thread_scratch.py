"""The kernels' per-thread scratch (csrc/thread_scratch.h) grows to the largest call and goes back to the OS when
the engine idles (kernels.selection.release_thread_scratch), and a later call grows it again with the same
result."""

import json
import subprocess
import sys

_PROBE = r"""
import json, os, sys
import torch
from pagellm.kernels.cpu import gguf_blocks
from pagellm.loader import gguf_repack
from pagellm.kernels.selection import release_thread_scratch
from pagellm.platform import release_freed_heap
from tests.kernels.gguf_blocks_builders import T, gguf_tensor

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

at = sys.argv[1]
weight = gguf_repack.repack(gguf_tensor(T.Q8_0, 32, 4096), T.Q8_0, (32, 4096))
x = torch.randn(4096, 4096)  # int8 activations of it: 16 MiB of scratch
first = gguf_blocks.matmul(x, weight, None, at)
release_freed_heap()
grown = rss()
release_thread_scratch()
release_freed_heap()
released = rss()
again = gguf_blocks.matmul(x, weight, None, at)
print(json.dumps({"drop": grown - released, "same": torch.equal(first, again)}))
"""


def test_released_scratch_leaves_the_resident_set(cpu_isa):
    """In a fresh interpreter (freed memory of earlier tests would blur the figures)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, cpu_isa], capture_output=True, text=True, timeout=300,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"]
    assert result["drop"] >= 15 << 20  # the 16 MiB of quantized activations, at least
