"""A kernel that fails to build is a failure, never skips and a silent torch fallback.

A compiler wrapper refuses one kind of build and passes every other to the real compiler: the top level's
flag (every kernel at that level), or one source (logits.cpp, at every level). Under it the kernel tests of
that kernel fail, with the kernel, the level and the compiler's own words in the output, and LLM() at that
level raises the same. Each run gets a cache holding this host's other builds, so only the refused ones are
compiled (and fail at once).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagellm.kernels.build import native
from pagellm.kernels import selection
from tests.kernels import requires_compiler

pytestmark = requires_compiler
ROOT = Path(__file__).parents[1]
# Refuses a build when one of its arguments matches the glob $REFUSE; every other call goes to $REAL_CXX as is
# (`--version` too, so the cache keys of the builds it passes are those of the real compiler's).
REFUSING_CXX = """#!/bin/sh
for arg in "$@"; do
  case "$arg" in $REFUSE) echo "injected failure: this compiler refuses $arg" >&2; exit 1;; esac
done
exec "$REAL_CXX" "$@"
"""
TOP = native.host_levels()[0]
SCENARIOS = {  # name: (glob refused, {kernel source: levels refused}, kernel tests run, kernel title, LLM level)
    "top-level-flag": (LEVEL_FLAGS[0] if (LEVEL_FLAGS := native.LEVEL_FLAGS[TOP]) else None,
                       {library.name: (TOP,) for library in selection.LIBRARIES},
                       ["tests/kernels/test_native_attention.py", "-k", "decode-hq4-hkv1-d256-bs16-wNone-capNone"],
                       "paged attention", TOP),
    "logits-everywhere": ("*/logits.cpp", {"logits": native.host_levels()},
                          ["tests/kernels/test_logits_kernels.py", "-k", "leading_dims or no_copy_without_cap"],
                          "logits epilogue", native.host_levels()[-1]),
}


def refusing_environment(tmp_path: Path, refuse: str, refused: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The environment of a process whose compiler refuses `refuse`, over a kernel cache holding this host's
    builds except the `refused` {source: levels} (linked from the real cache, each built there first)."""
    cxx = native.compiler()
    for level in native.host_levels():
        selection.kernel_levels(level)  # builds any not yet in the real cache (a no-op once the suite ran)
    dropped = {native.library_path(library.name, native.build_flags(level, extensions), cxx).name
               for library in selection.LIBRARIES for level in refused.get(library.name, ())
               for extensions in {(), native.host_extensions(level, library.extensions)}}
    cache = tmp_path / "kernels"
    cache.mkdir()
    for built in native.cache_dir().glob("*.so"):
        if built.name not in dropped:
            (cache / built.name).symlink_to(built)
    wrapper = tmp_path / "refusing-c++"
    wrapper.write_text(REFUSING_CXX)
    wrapper.chmod(0o755)
    # the level and native kernels on come from the test, whatever this run's own settings
    environment = {key: value for key, value in os.environ.items() if key not in ("PAGELLM_CPU_ISA", "PAGELLM_NATIVE")}
    return {**environment, "CXX": str(wrapper), "REAL_CXX": cxx, "REFUSE": refuse,
            "PAGELLM_KERNEL_CACHE": str(cache)}


def assert_names_the_failure(output: str, title: str, level: str) -> None:
    assert f"KernelBuildError: {title}: native kernel" in output, output[-3000:]
    assert f"failed to build at level {level}" in output and "injected failure: this compiler refuses" in output


def start_under_refusing_compiler(tmp_path: Path, scenario: str) -> list[subprocess.Popen]:
    """The scenario's two runs, started: its kernel tests under pytest, and LLM() at its level."""
    refuse, refused, kernel_tests, _, level = SCENARIOS[scenario]
    environment = refusing_environment(tmp_path, refuse, refused)
    commands = [[sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--tb=short", *kernel_tests],
                [sys.executable, "-c", "from pagellm import LLM\n"
                 f"LLM(cpu_isa={level!r}, kv_cache_memory=0.05, max_model_len=64, skip_tokenizer_init=True)"]]
    return [subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for command in commands]


@pytest.fixture(scope="module")
def runs_under_refusing_compilers(tmp_path_factory):
    """{scenario: its two runs}, every process of every scenario started at once: each is mostly its own start-up
    (Python, torch, collection), so side by side they take about half the time one after another did, and the
    refused builds fail alike in each (kernels/build/native.py builds beside its target, then renames). Each test waits
    for its own."""
    runs = {scenario: start_under_refusing_compiler(tmp_path_factory.mktemp(scenario), scenario)
            for scenario, (refuse, *_) in SCENARIOS.items() if refuse is not None}
    yield runs
    for proc in (proc for procs in runs.values() for proc in procs):
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finished(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    """Wait for each (900 s: a hang guard; one still writing to its pipe while another is read only waits)."""
    outputs = [proc.communicate(timeout=900) for proc in procs]
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for proc, (out, err) in zip(procs, outputs)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_kernel_that_does_not_build_fails_its_tests_and_llm(scenario, runs_under_refusing_compilers):
    refuse, refused, _, title, level = SCENARIOS[scenario]
    if refuse is None:
        pytest.skip(f"the {TOP} level has no compiler flag of its own to refuse")
    tests, engine = finished(runs_under_refusing_compilers[scenario])
    assert tests.returncode == 1, tests.stdout[-3000:]
    levels_refused = refused[next(iter(refused))]
    # -rA: one "PASSED|FAILED|SKIPPED|ERROR <test id>" line per test; every test at a refused level fails, every
    # other one passes (its level's builds are untouched), and none is skipped
    outcomes = [line.split(" ", 2)[:2] for line in tests.stdout.splitlines()
                if line.split(" ", 1)[0] in ("PASSED", "FAILED", "SKIPPED", "ERROR")]
    at_refused = [outcome for outcome, test in outcomes
                  if any(re.search(rf"\[{each}[-\]]", test) for each in levels_refused)]
    assert at_refused and set(at_refused) == {"FAILED"}, outcomes
    assert {outcome for outcome, _ in outcomes} <= {"FAILED", "PASSED"}, outcomes
    assert len(outcomes) - len(at_refused) == sum(outcome == "PASSED" for outcome, _ in outcomes), outcomes
    for each in levels_refused:
        assert_names_the_failure(tests.stdout, title, each)
    assert engine.returncode == 1
    first_refused = next(library.title for library in selection.LIBRARIES if level in refused.get(library.name, ()))
    assert_names_the_failure(engine.stderr, first_refused, level)
