"""Print the Python interpreter `make install` builds the virtual environment on: `python3`, unless that one loads
its runtime from a shared libpython and another interpreter on this machine does not.

Why: most of a `pagellm serve` start is Python running imports (torch's above all). An interpreter whose runtime
lives in libpython.so and was built without -fno-semantic-interposition (pyenv's `--enable-shared` builds, which
also leave out PGO unless asked) routes every call inside the runtime through the dynamic linker's tables and
cannot inline across them; Debian's and Ubuntu's python3 is linked statically. Same packages in the venv: the
start runs faster on the static one, and the engine's steps, which run in the native kernels, do not change.
measured: docs/PERFORMANCE.md, "The interpreter".

Run by whatever `python3` is (3.7 or later); prints one path or name. `make install PYTHON=...` skips it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

CANDIDATES = ("python3", "python3.13", "python3.12", "python3.11", "/usr/bin/python3", "/usr/local/bin/python3")
MIN_VERSION = (3, 11)  # pyproject.toml's requires-python

# What each candidate says of itself: its real path, version, whether a libpython is mapped into it, and whether
# it can make a venv with pip (Debian ships ensurepip in python3.X-venv; its version() finds the bundled pip) and
# build against its headers (Triton compiles a helper on a GPU).
PROBE = """
import json, os, sys, sysconfig
try:
    import ensurepip, venv
    can_venv = bool(ensurepip.version())
except Exception:
    can_venv = False
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
print(json.dumps({
    "path": os.path.realpath(sys.executable),
    "version": list(sys.version_info[:2]),
    "shared_libpython": "libpython" in maps,
    "venv": can_venv,
    "headers": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
}))
"""


def probe(command: str) -> dict | None:
    """What the interpreter `command` says of itself; None where it is not there or does not answer."""
    found = shutil.which(command)
    if found is None:
        return None
    try:
        run = subprocess.run([found, "-c", PROBE], capture_output=True, text=True, timeout=30)
        return json.loads(run.stdout) if run.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def choose(probes: list[dict]) -> dict | None:
    """The first usable interpreter (version, venv, headers) without a shared libpython, else the first usable one;
    `probes` in preference order (python3 first)."""
    usable = [p for p in probes if tuple(p["version"]) >= MIN_VERSION and p["venv"] and p["headers"]]
    static = [p for p in usable if not p["shared_libpython"]]
    return (static or usable or [None])[0]


def main() -> int:
    probes, seen = [], set()
    for command in CANDIDATES:
        found = probe(command)
        if found is not None and found["path"] not in seen:
            seen.add(found["path"])
            probes.append(found)
    chosen = choose(probes)
    if chosen is None:  # nothing usable: python3 as before, whose venv step then says what is missing
        print("python3")
        return 0
    if chosen is not probes[0]:  # say why python3 was passed over
        why = ("loads a shared libpython, whose imports run slower" if choose([probes[0]]) is not None
               else "cannot carry the venv ({}.{}+ with venv, pip and headers)".format(*MIN_VERSION))
        print(f"make: the venv uses {chosen['path']}: python3 ({probes[0]['path']}) {why} (PYTHON=... overrides)",
              file=sys.stderr)
    print(chosen["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
