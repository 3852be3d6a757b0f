"""tools/pick_python.py: the interpreter `make install` builds the venv on."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parents[1] / "tools" / "pick_python.py"
_spec = importlib.util.spec_from_file_location("pick_python", TOOL)
pick_python = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_python)


def _probe(path: str, version=(3, 11), shared=False, venv=True, headers=True) -> dict:
    return {"path": path, "version": list(version), "shared_libpython": shared, "venv": venv, "headers": headers}


def test_python3_is_kept_unless_it_loads_a_shared_libpython():
    assert pick_python.choose([_probe("/a"), _probe("/b")])["path"] == "/a"
    assert pick_python.choose([_probe("/a", shared=True), _probe("/b"), _probe("/c")])["path"] == "/b"
    # with no static one, the first usable shared one
    assert pick_python.choose([_probe("/a", shared=True), _probe("/b", shared=True)])["path"] == "/a"


def test_an_interpreter_that_cannot_carry_the_venv_is_passed_over():
    """Too old, no venv/ensurepip (Debian's python3-venv missing), no headers: not a candidate, however fast."""
    for unusable in (_probe("/old", version=(3, 10)), _probe("/nopip", venv=False), _probe("/nohdr", headers=False)):
        assert pick_python.choose([_probe("/slow", shared=True), unusable])["path"] == "/slow"
    assert pick_python.choose([_probe("/old", version=(3, 9))]) is None
    assert pick_python.choose([]) is None


def test_this_interpreter_describes_itself():
    found = pick_python.probe(sys.executable)
    assert found is not None and tuple(found["version"]) == sys.version_info[:2]
    assert found["venv"] in (True, False) and found["shared_libpython"] in (True, False)


def test_the_tool_prints_one_usable_interpreter():
    run = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=120, check=True)
    chosen = run.stdout.strip()
    assert len(run.stdout.splitlines()) == 1
    version = subprocess.run([chosen, "-c", "import sys; print(sys.version_info >= (3, 11))"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
    assert version == "True"


def test_it_says_why_python3_was_passed_over(monkeypatch, capsys):
    found = {"python3": _probe("/p3", version=(3, 10)), "python3.12": _probe("/p312")}
    monkeypatch.setattr(pick_python, "probe", found.get)
    assert pick_python.main() == 0
    out = capsys.readouterr()
    assert out.out == "/p312\n" and "python3 (/p3) cannot carry the venv" in out.err
    found["python3"] = _probe("/p3", shared=True)
    pick_python.main()
    assert "python3 (/p3) loads a shared libpython" in capsys.readouterr().err
    found["python3"] = _probe("/p3")  # the usual case: python3 kept, nothing said
    pick_python.main()
    assert capsys.readouterr() == ("/p3\n", "")
