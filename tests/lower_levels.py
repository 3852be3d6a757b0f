"""Runs the level-sensitive tests again at every lower instruction-set level this CPU can execute, each in a
process of its own with torch's kernels held to the same level (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) and
pagellm's selected through PAGELLM_CPU_ISA: what an AVX2-only or a non-x86 machine would run, model parity
against HF and the exactness paths included. tests/kernels is not repeated: it covers every level in process.

Then the HF-parity and engine tests once more with native kernels off (KernelConfig.native_kernels = False,
its default set through PAGELLM_NATIVE=0): the torch reference ops everywhere, which is what a machine without
a C++ compiler runs, and on CUDA every layer but attention (kernels/gpu/attention.py).

    python tests/lower_levels.py [--workers=N] [pytest args]      (make test runs it after the main pass)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from pagellm.kernels.build import native

SUITES = ["tests/models", "tests/layers", "tests/test_llm.py", "tests/runner"]
# Engine tests whose subject is host logic alone (tokenization, stop conditions, sampling fields, seeded
# sampling, prefix sharing, input errors, KV page residency, the output's fields, blocks freed on abort) compute
# the same at every level and run at the native level; repeating them below it costs suite time for nothing the
# level changes.
HOST_LOGIC = ["tests/test_llm.py::test_output_shape_is_vllms",  # fields and their agreement, whatever the ids
              "tests/test_llm.py::test_no_block_leaks_after_generate_and_abort",  # the scheduler's block count
              "tests/test_llm.py::test_shared_prefix_is_computed_once_and_output_unchanged",
              "tests/test_llm.py::test_seed_reproducible_whatever_else_runs",
              "tests/test_llm.py::test_ignore_eos_and_max_tokens",
              "tests/test_llm.py::test_token_id_prompts_equal_string_prompts",
              "tests/test_llm.py::test_stop_strings_and_stop_token_ids",
              "tests/test_llm.py::test_min_tokens_and_logit_bias_through_the_engine",
              "tests/test_llm.py::test_bad_input_is_a_clear_error",
              "tests/runner/test_kv_memory.py::test_kv_pool_pages_become_resident_only_when_written",
              "tests/runner/test_host_syncs.py",  # which torch calls a step makes: the same at every level
              # the hybrid models' padded graph steps on the CUDA table's Triton kernels, interpreted: the same at
              # every level (the eager ids they match are held at each level by the other tests)
              "tests/runner/test_decode_buckets.py::test_a_hybrid_model_s_decode_steps_pad_and_replay_where_its_"
              "kernels_skip_padded_slots",
              "tests/runner/test_verify_graphs.py::test_a_hybrid_model_s_verify_steps_replay_graphs_where_its_"
              "kernels_skip_padded_slots",
              # a stop met inside a verify step's tokens, and a grammar advanced over its drafts: the engine's
              # bookkeeping of the tokens a step accepted (their ids with and without speculation at each level rest
              # on the kernels' row counts, which the embedded model's speculation test holds at avx2)
              "tests/runner/test_speculative_engine.py::test_stop_strings_max_tokens_and_context_end_requests_where_"
              "they_do_without",
              "tests/runner/test_speculative_engine.py::test_structured_output_with_speculation_gives_the_same_json",
              # HF's own generate (level-independent, ~16 s a run); below the native level the ids it recorded
              # are compared with instead (test_greedy_matches_recorded_hf_ids)
              "tests/test_llm.py::test_greedy_matches_live_hf_transformers_on_the_same_gguf"]
# Below the native level the engine settings that must not change greedy ids run as one engine with all three
# changed ("all-three"): the same paths, one engine and one generation instead of three (~1 minute at generic).
ONE_ENGINE_BELOW_NATIVE = [f"tests/test_llm.py::test_greedy_ids_identical_across_engine_settings[{name}]"
                           for name in ("prefix-cache-off", "block-32", "chunked-prefill-64")]
# Left out at generic too: the embedded model's accuracy per quantization path runs torch's int8 kernel, which at
# torch's "default" capability (no SIMD) takes minutes; its int4 paths are bit-identical to the avx2 level's
# (tests/kernels compares the builds), which runs it. And the embedded model's batch and preemption invariance
# (about a minute of generic decode steps), and its greedy ids with and without speculation: a request's ids
# depend on the batch and on a verify step's length only through the kernels' row counts, which tests/kernels
# checks at every level, and the avx2 level runs all three (the tiny models' speculation runs at generic too).
DESELECT = {"generic": ["tests/layers/test_quantized.py::test_default_model_accuracy_against_the_dense_gguf_model",
                        "tests/test_llm.py::test_batch_equals_one_at_a_time",
                        "tests/test_llm.py::test_preemption_recomputes_and_keeps_greedy_ids",
                        "tests/runner/test_speculative_engine.py::test_greedy_ids_identical_on_the_embedded_model_"
                        "with_the_default_adaptive_length"]}


# With native kernels off (tests/models/test_run_mode.py checks it is so): parity with HF of every family (dense, MoE, hybrid; the model alone and through the
# engine) and the engine's own tests on the embedded model, as at a lower level.
NATIVE_OFF = ["tests/models/test_hf_parity.py", "tests/models/test_hybrid_parity.py",
              "tests/models/test_hybrid_engine.py::test_engine_matches_hf_greedy", "tests/models/test_step_reuse.py",
              "tests/test_llm.py", "tests/models/test_run_mode.py"]


# Start-up that each pass would repeat for nothing: hypothesis's pytest plugin (~1 s to import) serves only
# tests/server/test_fuzz.py, which no pass runs; and the passes share one tokenizer cache (tests/conftest.py
# takes PAGELLM_TEST_CACHE_DIR), so the embedded model's tokenizer is converted once, not in every pass (~1 s).
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]


# The level passes on --workers pytest-xdist workers (two by default), as make test's main pass (the Makefile
# says why; OpenMP's threads sleep at their barriers, or two workers' pools spinning on two cores double the CPU
# time). The native-off pass stays in one process, its threads spinning as in production: most of its time is one
# file (tests/test_llm.py), so a second worker only starts up.
PASSIVE_OPENMP = {"OMP_WAIT_POLICY": "passive"}


def workers(count: int) -> list[str]:
    return ["-n", str(count), "--dist", "loadfile"]


def run(name: str, environment: dict[str, str], suites: list[str], deselected: list[str], extra: list[str]) -> int:
    print(f"== tests {name}", flush=True)
    deselect = [f"--deselect={test}" for test in deselected]
    code = subprocess.call([*PYTEST, *suites, *deselect, *extra], env={**os.environ, **environment})
    if code != 0:
        print(f"== {name}: pytest exited {code}", flush=True)
    return code


def run_passes(extra: list[str], shared: dict[str, str], count: int) -> int:
    for level in native.host_levels()[1:]:
        code = run(f"at cpu_isa={level} (torch: {native.torch_env(level)})",
                   {**shared, **PASSIVE_OPENMP, **native.torch_env(level), "PAGELLM_CPU_ISA": level,
                    "PAGELLM_TEST_KERNELS": level},
                   SUITES, HOST_LOGIC + ONE_ENGINE_BELOW_NATIVE + DESELECT.get(level, []), [*workers(count), *extra])
        if code != 0:
            return code
    return run("with native kernels off (PAGELLM_NATIVE=0)",
               {**shared, "PAGELLM_NATIVE": "0", "PAGELLM_TEST_KERNELS": "off"},
               NATIVE_OFF, HOST_LOGIC + ONE_ENGINE_BELOW_NATIVE, extra)


def main(args: list[str]) -> int:
    """args: pytest's, after an optional --workers=N (the level passes' xdist workers; 0: one process)."""
    count = 2
    if args and args[0].startswith("--workers="):
        count, args = int(args[0].partition("=")[2]), args[1:]
    with tempfile.TemporaryDirectory(prefix="pagellm-test-cache-") as cache:
        return run_passes(args, {"PAGELLM_TEST_CACHE_DIR": cache}, count)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
