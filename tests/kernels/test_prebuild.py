"""native.prebuild: a level's libraries compiled side by side before a start loads them one by one, and `python -m
pagellm.kernels` (make install) building every level's. Builds go to a cache of the test's own."""

from __future__ import annotations

import functools
import time

import pytest

from pagellm.kernels import __main__ as build_all
from pagellm.kernels.build import native
from pagellm.kernels import selection
from pagellm.loader.gguf_file import VOCABULARY
from tests.kernels import requires_compiler

pytestmark = pytest.mark.across_levels  # about building, not a level's arithmetic: once


@requires_compiler
def test_prebuild_compiles_the_missing_builds_that_load_then_finds(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGELLM_KERNEL_CACHE", str(tmp_path))
    cxx, level = native.compiler(), native.host_levels()[-1]
    builds = [("rotary", level, ()), ("rms_norm", level, ()), ("rotary", level, ())]  # a repeat is built once
    native.prebuild(builds)
    paths = [native.library_path(name, native.build_flags(level, ()), cxx) for name in ("rotary", "rms_norm")]
    assert all(path.is_file() for path in paths) and len(list(tmp_path.glob("*.so"))) == 2
    built = [path.stat().st_mtime_ns for path in paths]
    time.sleep(0.01)
    native.prebuild(builds)  # all cached: nothing compiled again
    assert native._build("rotary", cxx, native.build_flags(level, ())) == paths[0]
    assert [path.stat().st_mtime_ns for path in paths] == built


@pytest.mark.parametrize("cxx", ["false", "/nonexistent/c++"])  # one that fails every build; one not there
def test_a_compiler_that_fails_leaves_prebuild_quiet_and_load_reports_it(monkeypatch, tmp_path, cxx):
    monkeypatch.setenv("PAGELLM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: cxx)
    monkeypatch.setattr(native, "_load", functools.cache(native._load.__wrapped__))  # nothing kept from before
    native.prebuild([("rotary", "generic", ()), ("rms_norm", "generic", ())])  # no exception here
    assert not list(tmp_path.glob("*.so"))
    with pytest.raises(native.KernelBuildError, match="native kernel 'rotary' failed to build at level generic"):
        native.load("rotary", "generic")


def test_python_m_pagellm_kernels_asks_for_every_promised_library_at_every_host_level(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(native, "prebuild", lambda builds: asked.extend(builds))
    monkeypatch.setattr(native, "compiler", lambda: "c++")
    monkeypatch.setattr(native, "_compiler_version", lambda cxx: "test")
    assert build_all.main([VOCABULARY[0]]) == 0  # as make install runs it: with the loader's vocabulary code
    want = {library.build_of(level) for level in native.host_levels() for library in selection.LIBRARIES
            if library.promised(level)} | {(*VOCABULARY, ())}
    assert set(asked) == want and len(asked) == len(want)
    assert f"for {', '.join(native.host_levels())}" in capsys.readouterr().out


def test_python_m_pagellm_kernels_without_a_compiler_says_so(monkeypatch, capsys):
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert build_all.main() == 0
    assert "no C++ compiler" in capsys.readouterr().out


def test_python_m_pagellm_kernels_with_a_compiler_it_cannot_run_builds_nothing_and_succeeds(monkeypatch, capsys,
                                                                                         tmp_path):
    """make install goes on; the first start reports the compiler (a KernelBuildError naming it)."""
    monkeypatch.setenv("PAGELLM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: "/nonexistent/c++")
    assert build_all.main() == 0
    assert "cannot run the C++ compiler '/nonexistent/c++'" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.so"))
