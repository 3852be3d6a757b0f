"""A CPU engine unmaps the CUDA libraries torch links (platform.release_cuda_library_pages): only mappings that hold
no private data, and the process computes as before. The live cases run in fresh interpreters: the drop is
process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from pagellm.platform import _CUDA_LIBRARY, unwritten_mappings

ROOT = Path(__file__).parents[1]
NV = "/venv/site-packages/nvidia/cu13/lib"


def _mapping(start: int, perms: str, path: str, rss_kb: int, anonymous_kb: int) -> list[str]:
    return [f"{start:x}-{start + 0x10000:x} {perms} 00000000 08:01 1234 {path}", "Size:   64 kB",
            f"Rss:   {rss_kb} kB", "Pss:   1 kB", f"Anonymous:   {anonymous_kb} kB", "VmFlags: rd mr mw me"]


def test_only_unwritten_cuda_mappings_with_resident_pages_are_chosen():
    smaps = (_mapping(0x1000000, "r--p", f"{NV}/libcublasLt.so.13", 40, 0)
             + _mapping(0x2000000, "r-xp", f"{NV}/libcublasLt.so.13", 64, 0)
             + _mapping(0x3000000, "r--p", f"{NV}/libcublasLt.so.13", 8, 4)  # relocated (RELRO): private pages
             + _mapping(0x4000000, "rw-p", f"{NV}/libcublasLt.so.13", 8, 0)  # writable
             + _mapping(0x5000000, "r-xp", "/venv/site-packages/torch/lib/libtorch_cpu.so", 64, 0)  # runs on a CPU
             + _mapping(0x6000000, "r-xp", f"{NV}/libnvrtc.so.13", 0, 0)  # nothing resident
             + ["7000000-7010000 rw-p 00000000 00:00 0", "Rss:   64 kB", "Anonymous:   64 kB"]  # anonymous memory
             + _mapping(0x8000000, "r-xp", "/venv/site-packages/torch/lib/libtorch_cuda.so", 12, 0))  # the last one
    assert unwritten_mappings(smaps, _CUDA_LIBRARY) == [(0x1000000, 0x1010000, 40 << 10),
                                                          (0x2000000, 0x2010000, 64 << 10),
                                                          (0x8000000, 0x8010000, 12 << 10)]


def _fresh(script: str) -> dict:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_pages_go_and_torch_still_computes():
    result = _fresh("""
        import json, torch
        from pagellm.platform import _CUDA_LIBRARY, release_cuda_library_pages, resident_bytes, unwritten_mappings
        smaps = lambda: open("/proc/self/smaps").read().splitlines()
        linked = sum(r for _, _, r in unwritten_mappings(smaps(), _CUDA_LIBRARY))
        before = resident_bytes()
        released = release_cuda_library_pages(torch.device("cpu"))
        nothing_for_cuda = release_cuda_library_pages(torch.device("cuda"))
        after = resident_bytes()
        left = sum(r for _, _, r in unwritten_mappings(smaps(), _CUDA_LIBRARY))
        x = torch.arange(16.0).reshape(4, 4)
        print(json.dumps({"linked": linked, "released": released, "cuda_device": nothing_for_cuda,
                          "drop": before - after, "left": left,
                          "sum": (x @ x).sum().item(), "cuda": torch.cuda.is_available()}))
    """)
    assert result["released"] == result["linked"] and result["left"] == 0 and result["cuda_device"] == 0
    assert result["drop"] >= result["released"] // 2  # gone from the resident set, not only counted
    x = torch.arange(16.0).reshape(4, 4)
    assert result["sum"] == (x @ x).sum().item()
    assert result["cuda"] == torch.cuda.is_available()  # the CUDA runtime still answers, from its pages mapped again
    if "+cu" in torch.__version__:  # PyPI's CUDA build links them: there is something to drop
        assert result["released"] > 50 << 20


def test_llm_leaves_no_cuda_library_pages_mapped():
    result = _fresh("""
        import json
        from pagellm import LLM, SamplingParams
        from pagellm.platform import _CUDA_LIBRARY, unwritten_mappings
        llm = LLM()
        left = sum(r for _, _, r in unwritten_mappings(open("/proc/self/smaps").read().splitlines(), _CUDA_LIBRARY))
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0),
                           use_tqdm=False)
        print(json.dumps({"left": left, "ids": len(out[0].outputs[0].token_ids)}))
    """)
    assert result["left"] < 1 << 20 and result["ids"] == 4
