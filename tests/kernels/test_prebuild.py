"""native.prebuild: a level's libraries compiled side by side before a start loads them one by one, and `python -m
pagellm.kernels` (make install) building every level's. Builds go to a cache of the test's own."""

from __future__ import annotations

import time

import pytest

from pagellm.kernels import __main__ as build_all
from pagellm.kernels import native, selection
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


@requires_compiler
def test_a_build_that_fails_in_prebuild_is_left_to_load_to_report(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGELLM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails every build
    native.prebuild([("rotary", "generic", ()), ("rms_norm", "generic", ())])  # no exception here
    assert not list(tmp_path.glob("*.so"))
    with pytest.raises(native.KernelBuildError, match="false failed on rotary.cpp"):
        native._build("rotary", "false", native.build_flags("generic", ()))


def test_python_m_pagellm_kernels_asks_for_every_promised_library_at_every_host_level(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(native, "prebuild", lambda builds: asked.extend(builds))
    monkeypatch.setattr(native, "compiler", lambda: "c++")
    monkeypatch.setattr(native, "_compiler_version", lambda cxx: "test")
    assert build_all.main() == 0
    want = {library.build_of(level) for level in native.host_levels() for library in selection.LIBRARIES
            if library.promised(level)} | {(*native.VOCABULARY, ())}
    assert set(asked) == want and len(asked) == len(want)
    assert f"for {', '.join(native.host_levels())}" in capsys.readouterr().out


def test_python_m_pagellm_kernels_without_a_compiler_says_so(monkeypatch, capsys):
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert build_all.main() == 0
    assert "no C++ compiler" in capsys.readouterr().out
