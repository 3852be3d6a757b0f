"""A normal run ends quietly: no leak reports or warnings after the last output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.models.tiny_checkpoints import write_tiny_checkpoint


def test_a_run_exits_without_leak_reports(tmp_path):
    """A process that has Triton loaded (HF modeling code, torch.compile and the CUDA kernels load it) and starts an
    engine: gc.freeze() at engine start kept Triton's IR objects alive to the end, and nanobind printed hundreds
    of "leaked" lines at exit. The engine now collects them before the interpreter finalizes
    (platform.freeze_loaded_objects)."""
    pytest.importorskip("triton")  # PyTorch's CPU-only wheel brings none: nothing to leak
    write_tiny_checkpoint("llama", tmp_path)
    script = ("import triton\nfrom pagellm import LLM, SamplingParams\n"
              f"llm = LLM({str(tmp_path)!r}, skip_tokenizer_init=True, kv_cache_memory=0.01)\n"
              "llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "leaked" not in result.stderr and "nanobind" not in result.stderr, result.stderr[-2000:]


def test_the_cli_parses_without_importing_torch():
    """`pagellm --help` and every command's parsing stay light: torch (~2 s to import) comes with the command that
    needs it. Building every subcommand's parser once imported it (`bench collectives`' arguments lived in the
    module that runs the collectives)."""
    script = ("import sys\nfrom pagellm.cli import build_parser\nbuild_parser().parse_args(['serve'])\n"
              "print(sorted(m for m in ('torch', 'numpy', 'fastapi') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
