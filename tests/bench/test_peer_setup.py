"""The llama.cpp peers one command away: what a bench prints when one is missing, where it finds llama.cpp's tools,
and tools/build-llama-cpp.sh's cache (its cold path only shown by --dry-run: nothing is compiled or fetched)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagellm.bench import peer_setup, report, serve_compare
from pagellm.bench.llama_cpp_peer import llama_cpp_available

CHECKOUT = Path(__file__).resolve().parents[2]
SCRIPT = CHECKOUT / "tools" / "build-llama-cpp.sh"
TOOLS = ("llama-server", "llama-batched-bench", "llama-bench", "llama-perplexity")


def _host_flags() -> str:
    """The compiler flags the script builds llama.cpp with on this CPU: AMX off where the CPU has it."""
    with open("/proc/cpuinfo") as cpuinfo:
        amx = re.search(r"\bamx_int8\b", cpuinfo.read()) is not None
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if amx else ""


def _fake_tools(prefix: Path, flags: str | None = None) -> Path:
    """A peers cache whose tools are all built (empty executables), with `flags` (default: this CPU's)."""
    bin_dir = prefix / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in TOOLS:
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(0o755)
    (prefix / "build" / "pagellm-extra-flags").write_text((_host_flags() if flags is None else flags) + "\n")
    return bin_dir


def _script(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_a_missing_llama_cpp_python_names_the_peers_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    monkeypatch.chdir(CHECKOUT)
    why = llama_cpp_available()
    assert "llama-cpp-python not importable" in why and "`make peers` installs it" in why
    assert peer_setup.COLD_BUILD_TIME in why and "pagellm[bench]" not in why


def test_the_peers_command_names_the_checkout_from_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(CHECKOUT)
    assert peer_setup.install_command() == "make peers"
    monkeypatch.chdir(tmp_path)
    assert peer_setup.install_command() == f"make -C {CHECKOUT} peers"


def test_a_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ValueError, match=re.escape(f"{sys.executable} -m pip install matplotlib")):
        report.pyplot()


def _serve_compare_args(llama_server=None):
    return SimpleNamespace(llama_server=llama_server, slots=2, ctx=64, threads=1, llama_args="")


def test_serve_compare_finds_llama_server_where_make_peers_built_it(tmp_path, monkeypatch):
    bin_dir = _fake_tools(tmp_path / "peers")
    monkeypatch.setenv("PAGELLM_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # not on PATH
    assert serve_compare._llama_server(_serve_compare_args(), "m.gguf").cmd[0] == str(bin_dir / "llama-server")
    given = tmp_path / "my-llama-server"
    given.write_text("")
    assert serve_compare._llama_server(_serve_compare_args(str(given)), "m.gguf").cmd[0] == str(given)


def test_serve_compare_without_llama_server_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_PEERS_DIR", str(tmp_path / "nothing-built"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(CHECKOUT)
    with pytest.raises(ValueError, match=r"neither on PATH nor in .*nothing-built/build/bin: `make peers` installs"):
        serve_compare._llama_server(_serve_compare_args(), "m.gguf")
    with pytest.raises(ValueError, match="--llama-server /no/such: no such file"):
        serve_compare._llama_server(_serve_compare_args("/no/such"), "m.gguf")


def test_the_script_and_the_benches_share_one_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGELLM_PEERS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peer_setup.tools_dir() == tmp_path / "llama-cpp-peer" / "build" / "bin"
    run = _script("--dry-run", env={"XDG_CACHE_HOME": str(tmp_path), "PAGELLM_PEERS_DIR": ""})
    assert run.returncode == 0 and run.stdout.strip() == str(peer_setup.tools_dir())


def test_a_built_cache_is_used_at_once(tmp_path):
    """Every tool already built: the script runs nothing (not even with --dry-run off) and names the folder."""
    bin_dir = _fake_tools(tmp_path)
    run = _script(str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(bin_dir) and "cached: " + " ".join(TOOLS) in run.stderr
    assert "would run" not in run.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["build"]


def test_a_build_made_with_other_flags_is_built_again(tmp_path):
    """A cache built before AMX was switched off (or on another CPU) is rebuilt with this CPU's flags."""
    version = re.search(r"^VERSION=(\S+)", SCRIPT.read_text(), re.M).group(1)
    _fake_tools(tmp_path, flags="-mstale")
    (tmp_path / f"llama_cpp_python-{version}.tar.gz").write_bytes(b"")  # sources cached: only the build is shown
    (tmp_path / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp").mkdir(parents=True)
    run = _script("--dry-run", str(tmp_path))
    assert run.returncode == 0, run.stderr
    configure = [line for line in run.stderr.splitlines() if "would run: cmake -S" in line]
    assert len(configure) == 1 and f'-DCMAKE_CXX_FLAGS={_host_flags()}' in configure[0]


def test_a_cold_cache_fetches_the_pinned_sdist_and_builds_once(tmp_path):
    version = re.search(r"^VERSION=(\S+)", SCRIPT.read_text(), re.M).group(1)
    # a Python without llama_cpp (this suite's may have it: `make peers`), as on a fresh clone
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    run = _script("--dry-run", "--python", str(tmp_path / "venv" / "bin" / "python"), str(tmp_path / "cold"))
    assert run.returncode == 0, run.stderr
    steps = [line.split("would run: ", 1)[1] for line in run.stderr.splitlines() if "would run: " in line]
    assert any("pip download" in s and f"llama-cpp-python=={version}" in s for s in steps)
    assert any(s.startswith("cmake -S") and "vendor/llama.cpp" in s and "-DGGML_CUDA=OFF" in s for s in steps)
    builds = [s for s in steps if s.startswith("cmake --build")]
    assert len(builds) == 1 and all(tool in builds[0] for tool in TOOLS)  # llama.cpp compiles once
    # the Python package on that build: its wheel builds no llama.cpp of its own
    assert sum("pip download" in s for s in steps) == 1
    assert any("CMAKE_ARGS=-DLLAMA_BUILD=OFF" in s and "pip wheel" in s for s in steps)
    assert "would link: <llama_cpp package>/lib -> " + str(tmp_path / "cold" / "build" / "bin") in run.stderr
    assert not (tmp_path / "cold").exists()  # a dry run writes nothing


def test_an_installed_python_package_of_the_pinned_version_is_kept(tmp_path):
    version = re.search(r"^VERSION=(\S+)", SCRIPT.read_text(), re.M).group(1)
    _fake_tools(tmp_path / "peers")
    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    run = _script("--python", sys.executable, str(tmp_path / "peers"), env={"PYTHONPATH": str(tmp_path / "site")})
    assert run.returncode == 0, run.stderr
    assert f"cached: llama-cpp-python {version}" in run.stderr and "would run" not in run.stderr
    (package / "__init__.py").write_text("__version__ = '0.0.1'\n")  # another release: replaced, here only shown
    run = _script("--dry-run", "--python", sys.executable, str(tmp_path / "peers"),
                  env={"PYTHONPATH": str(tmp_path / "site")})
    assert "pip install" in run.stderr and "would link" in run.stderr
