"""Runs the level-sensitive tests again at every lower instruction-set level this CPU can execute, each in a
process of its own with torch's kernels held to the same level (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) and
pagellm's selected through PAGELLM_CPU_ISA: what an AVX2-only or a non-x86 machine would run, model parity
against HF and the exactness paths included. tests/kernels is not repeated: it covers every level in process.

    python tests/lower_levels.py [pytest args]      (make test runs it after the main pass)
"""

from __future__ import annotations

import os
import subprocess
import sys

from pagellm.kernels import native

SUITES = ["tests/models", "tests/layers", "tests/test_llm.py", "tests/runner"]
# Left out where they would cost minutes for nothing new: the embedded model's accuracy per quantization path
# runs torch's int8 kernel, which at torch's "default" capability (no SIMD) takes ~3 minutes; its int4 paths
# are bit-identical to the avx2 level's (tests/kernels compares the builds), which runs it.
# The embedded model at the generic level runs ~20 s per generate call, so the engine tests whose subject is
# host logic alone (prefix sharing, seeded sampling, stop conditions), run at the native level, are left out
# there too: ~80 s saved for nothing the level changes.
DESELECT = {"generic": ["tests/layers/test_quantized.py::test_default_model_accuracy_against_the_dense_gguf_model",
                        "tests/test_llm.py::test_shared_prefix_is_computed_once_and_output_unchanged",
                        "tests/test_llm.py::test_seed_reproducible_whatever_else_runs",
                        "tests/test_llm.py::test_ignore_eos_and_max_tokens"]}


def main(extra: list[str]) -> int:
    for level in native.host_levels()[1:]:
        env = {**os.environ, **native.torch_env(level), "PAGELLM_CPU_ISA": level}
        print(f"== tests at cpu_isa={level} (torch: {native.torch_env(level)})", flush=True)
        deselect = [f"--deselect={test}" for test in DESELECT.get(level, [])]
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES, *deselect,
                                *extra], env=env)
        if code != 0:
            print(f"== cpu_isa={level}: pytest exited {code}", flush=True)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
