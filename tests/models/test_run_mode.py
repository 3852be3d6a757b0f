"""The kernels this pytest run was started for are the ones it runs: tests/lower_levels.py starts each pass with
PAGELLM_TEST_KERNELS naming the level (or "off") it meant, so a broken path from its environment to the engine's
config would fail here rather than quietly rerun the native level."""

from __future__ import annotations

import os

from pagellm.config import KernelConfig
from pagellm.kernels.build import native


def test_the_run_selects_the_kernels_it_was_started_for():
    meant = os.environ.get("PAGELLM_TEST_KERNELS", "auto")  # the main pass: the CPU's own level
    expected = None if meant == "off" else native.resolve(meant)
    config = KernelConfig()  # what an engine in this process is configured with
    assert (native.resolve(config.cpu_isa) if config.native_kernels else None) == expected
    assert native.default_level() == expected  # what modules run at until a plan binds an engine's level
