"""python -m pagellm.kernels [SOURCE.cpp ...]: builds every native kernel library for each instruction-set level
this CPU runs, and each SOURCE given (C++ of another layer built the same way: `make install` passes the loader's
GGUF vocabulary code) at the generic level, side by side (native.prebuild), so that no start waits for a
compiler. Without a C++ compiler it says so and builds nothing. A library that fails to build is named here, and
reported with the compiler's words by the first start that needs it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pagellm.kernels.build import native
from pagellm.kernels.selection import LIBRARIES


def main(sources: list[str] = ()) -> int:
    cxx = native.compiler()
    if cxx is None:
        print("pagellm kernels: no C++ compiler (set CXX or install g++): torch's reference ops will run")
        return 0
    levels = native.host_levels()
    builds = [library.build_of(level) for level in levels for library in LIBRARIES if library.promised(level)]
    builds = list(dict.fromkeys([*builds, *((str(Path(source).absolute()), "generic", ()) for source in sources)]))
    start = time.perf_counter()
    native.prebuild(builds)
    try:
        failed = [f"{native.source_of(name).stem} at {level}" for name, level, extensions in builds
                  if not native.library_path(name, native.build_flags(level, extensions), cxx).is_file()]
    except OSError as e:  # CXX names no program: install goes on; a start says the same, as a KernelBuildError
        print(f"pagellm kernels: cannot run the C++ compiler {cxx!r} ({e}): nothing built")
        return 0
    print(f"pagellm kernels: {len(builds) - len(failed)} of {len(builds)} libraries ready for "
          f"{', '.join(levels)} in {time.perf_counter() - start:.0f} s in {native.cache_dir()}"
          + (f"; failed to build: {', '.join(failed)}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
