"""Build-on-first-use loader for the C++ CPU kernels in `pagellm/kernels/cpu/csrc/`, one build per instruction set.

Each `csrc/<name>.cpp` is a plain C++ file exporting `extern "C"` functions; it is compiled into its own shared
library for an explicit target level and called through ctypes with tensor data pointers. Why not
torch.utils.cpp_extension: it needs ninja and the torch headers, and builds far slower than a header-free
file; ctypes releases the GIL around each call. measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md

Levels (`LEVELS`, fastest first), each a set of compiler flags; the sources pick their code paths with the
compiler's own macros (`__AVX512F__`, `__AVX2__`, ...):

    avx512   AVX-512 F/BW/VL/DQ with BF16 and VNNI (Zen 4, Sapphire Rapids and later)
    avx2     AVX2 + FMA + F16C (Haswell and later, Zen 1-3)
    generic  the compiler's baseline for the machine (plain C++ loops; ARM, old x86)

Nothing here selects a level for the process: every wrapper takes its level (`at`) from its caller, and a
model's plan binds its modules to the engine's (`level_of(KernelConfig)`), so two engines in one process may
run two levels and tests check every level in one process. `load(name, level)` builds any level this CPU can
execute. Libraries are cached under ~/.cache/pagellm/kernels (or $PAGELLM_KERNEL_CACHE), keyed by
the sources, the level's flags and the compiler. With no compiler `load` returns None: the torch reference path
takes over only where there is no C++ compiler at all (`compiler()` is None; the engine logs it once, naming every
kernel that runs in torch: kernels/selection.py). Where a compiler exists, a build that fails is a KernelBuildError
carrying the compiler's own error text: a broken kernel must stop start-up and fail the suite, never turn into
skips and a silent fallback.

OpenMP: the library links libgomp.so.1; torch's wheel already loaded its own copy under that soname, so the
dynamic linker reuses it and both share one thread pool (two pools spinning on 2 cores would halve throughput).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType

import torch  # noqa: F401  -- imported first so torch's libgomp is the one our libraries bind to

from pagellm.config import KernelConfig
from pagellm.kernels.build.errors import KernelBuildError
from pagellm.kernels.build import binding

CSRC = Path(__file__).parents[1] / "cpu" / "csrc"  # the CPU kernels' C++ sources
DTYPE_CODES = binding.DTYPE_CODES  # the kernels' dtype argument (is_bf16)
# Declared by every library whose source includes csrc/thread_scratch.h: its kept per-thread scratch given back.
RELEASE_SCRATCH = binding.Function("pagellm_release_thread_scratch", ())
# -ffp-contract=off: a*b+c stays two roundings unless the source asks for fma, so every level computes alike
CXX_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")
LEVELS = ("avx512", "avx2", "generic")
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# What each level compiles for, and the /proc/cpuinfo flags a CPU needs to execute it.
LEVEL_FLAGS = MappingProxyType({
    "avx512": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    "avx2": ("-march=x86-64-v3",),
    "generic": ("-march=x86-64",) if _X86 else (),
})
LEVEL_CPU_FLAGS = MappingProxyType({
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16",
                         "avx512_vnni", "avx2", "fma", "f16c", "bmi2"}),
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
    "generic": frozenset(),
})
# Extensions a library may ask for on top of a level where the CPU has them: cpu flag -> (level, compiler flag).
# AVX-VNNI (Alder Lake and later, Zen 5) gives AVX2 CPUs vpdpbusd on 8 lanes; Zen 1-3 lack it.
EXTENSIONS = MappingProxyType({"avx_vnni": ("avx2", "-mavxvnni")})
# torch's own dispatch held to a level (set before torch is imported: see `torch_env`)
_TORCH_ENV = MappingProxyType({
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
})


def cache_dir() -> Path:
    root = os.environ.get("PAGELLM_KERNEL_CACHE") or Path.home() / ".cache" / "pagellm" / "kernels"
    return Path(root)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def host_levels() -> tuple[str, ...]:
    """The levels this CPU can execute, fastest first (always ends with "generic")."""
    flags = cpu_flags()
    return tuple(lv for lv in LEVELS if lv == "generic" or (_X86 and LEVEL_CPU_FLAGS[lv] <= flags))


def resolve(cpu_isa: str) -> str:
    """"auto" -> the fastest host level; a level name -> itself if this CPU can execute it, else ValueError."""
    if cpu_isa == "auto":
        return host_levels()[0]
    if cpu_isa not in LEVELS:
        raise ValueError(f"cpu_isa must be auto or one of {', '.join(LEVELS)}, got {cpu_isa!r}")
    if cpu_isa not in host_levels():
        missing = sorted(LEVEL_CPU_FLAGS[cpu_isa] - cpu_flags()) if _X86 else [f"an x86-64 CPU (this is {platform.machine()})"]
        raise ValueError(f"cpu_isa {cpu_isa!r} needs {', '.join(missing)}, which this CPU lacks; "
                         f"it can run {', '.join(host_levels())}")
    return cpu_isa


def torch_env(level: str) -> dict[str, str]:
    """Environment that holds torch's own kernels (ATen, oneDNN) to `level`, for a process started with it."""
    return dict(_TORCH_ENV[level])


DEFAULT_LEVEL = "process default"  # a level argument meaning default_level() (constructors' default)


def level_of(config: KernelConfig) -> str | None:
    """The level a KernelConfig runs its native kernels at (a ValueError if this CPU cannot), None with them off."""
    return resolve(config.cpu_isa) if config.native_kernels else None


@functools.cache
def default_level() -> str | None:
    """The level of the config's defaults ($PAGELLM_CPU_ISA, $PAGELLM_NATIVE): what a module runs at until its
    model's plan binds it to an engine's level (layers/kernel_user.py). Fixed for the process: the environment
    is read once, as torch reads ATEN_CPU_CAPABILITY."""
    return level_of(KernelConfig())


def each_level(fn) -> dict[str, object]:
    """{level: fn(level)} for each level this CPU executes (tests compare the builds with it)."""
    return {each: fn(each) for each in host_levels()}


def compiler() -> str | None:
    """The C++ compiler kernels are built with ($CXX, else c++, g++ or clang++ on PATH), or None."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build_flags(level: str, extensions: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The compiler flags of a build for `level` plus `extensions` (keys of EXTENSIONS)."""
    return (*CXX_FLAGS, *LEVEL_FLAGS[level], *(EXTENSIONS[e][1] for e in extensions))


@functools.cache
def _compiler_version(cxx: str) -> str:
    """`cxx --version`, asked once per process (it keys every library's cache entry; start-up loads nine)."""
    return subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True).stdout


def source_of(name: str) -> Path:
    """The C++ source a library `name` is built from: csrc/<name>.cpp, or `name` itself where it is the path of a
    .cpp file elsewhere (the loader's GGUF vocabulary code: built and cached the same way, not a kernel)."""
    return Path(name) if name.endswith(".cpp") else CSRC / f"{name}.cpp"


def library_path(name: str, flags: tuple[str, ...], cxx: str) -> Path:
    """Where `cxx`'s build of `name`'s source with `flags` is cached: keyed by the sources, the flags and the
    compiler's version, so an edit, another level or another compiler is a new file."""
    source = source_of(name)
    version = _compiler_version(cxx)
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]  # shared includes (bf16.h)
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(flags), version]).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def _build(name: str, cxx: str, flags: tuple[str, ...]) -> Path:
    target = library_path(name, flags, cxx)
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target, then rename: concurrent processes never load a half-written file.
        tmp = Path(tempfile.mkdtemp(dir=target.parent))
    except OSError as e:  # not the compiler's fault: say where the cache is and how to move it
        raise KernelBuildError(f"cannot write the kernel cache {target.parent} ({e.strerror}); set "
                               "PAGELLM_KERNEL_CACHE to a writable directory") from None
    try:
        out = tmp / target.name
        result = subprocess.run([*shlex.split(cxx), *flags, str(source_of(name)), "-o", str(out)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"{cxx} failed on {source_of(name).name} (exit {result.returncode}, flags "
                                   f"{' '.join(flags)}):\n{(result.stderr or result.stdout)[-4000:]}")
        os.replace(out, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def prebuild(builds: Iterable[tuple[str, str, tuple[str, ...]]]) -> None:
    """Compiles those of the (name, level, extensions) builds not yet cached side by side, one compiler per core:
    on a fresh machine (or after an edit) the first start builds its level's libraries in the time of the
    slowest, not of all in turn. A build that fails here is left to `load`, which builds it again and says why
    (the one place build errors are reported)."""
    cxx = compiler()
    if cxx is None:
        return
    jobs = [(name, build_flags(level, extensions)) for name, level, extensions in dict.fromkeys(builds)]
    try:
        jobs = [(name, flags) for name, flags in jobs if not library_path(name, flags, cxx).is_file()]
    except OSError:  # e.g. CXX names no program (library_path asks it its version): said by load()
        return
    if len(jobs) < 2:
        return

    def build(job: tuple[str, tuple[str, ...]]) -> None:
        try:
            _build(job[0], cxx, job[1])
        except (KernelBuildError, OSError):
            pass  # said by load()

    # threads suffice: each waits on its compiler process. The cores this process may use, not the host's (a
    # container's limit), bound how many run at once.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(len(jobs), cores)) as pool:
        list(pool.map(build, jobs))


@functools.cache
def _load(name: str, level: str, extensions: tuple[str, ...] = ()) -> ctypes.CDLL | KernelBuildError | None:
    """The library, None without a compiler, or the build's error: kept, so a broken kernel is compiled once per
    process and every caller after the first gets the same message at once."""
    cxx = compiler()
    if cxx is None:
        return None
    at = level + "".join(f" + {ext}" for ext in extensions)
    try:
        path = _build(name, cxx, build_flags(level, extensions))
    except KernelBuildError as e:
        return KernelBuildError(f"native kernel {name!r} failed to build at level {at}: {e}")
    except OSError as e:  # e.g. CXX names no program
        return KernelBuildError(f"native kernel {name!r} failed to build at level {at}: cannot run {cxx!r}: {e}")
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        return KernelBuildError(f"native kernel {name!r} built at level {at} but does not load: {e}")


def load(name: str, at: str | None, extensions: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `csrc/<name>.cpp` for level `at` plus `extensions` (keys of EXTENSIONS); None when `at` is
    None (native kernels off) or there is no C++ compiler. A failed build is a KernelBuildError with the
    compiler's message; a level or extension this CPU cannot execute, a ValueError."""
    at = None if at is None else resolve(at)
    missing = [e for e in extensions if e not in cpu_flags() or EXTENSIONS[e][0] != at]
    if missing:
        raise ValueError(f"extension(s) {missing} do not apply to {at} builds on this CPU")
    if at is None:
        return None
    lib = _load(name, at, tuple(extensions))
    if isinstance(lib, KernelBuildError):
        raise KernelBuildError(str(lib))  # a fresh one: re-raising the kept object would grow its traceback
    return lib


def bind(name: str, functions, at: str | None, extensions: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`load(name, at, extensions)` with each of `functions` (binding.Function) typed for ctypes (tests use it
    for one-off probes; kernel wrappers go through Library)."""
    lib = load(name, at, extensions)
    if lib is not None:
        for function in functions:
            fn = getattr(lib, function.symbol)
            fn.argtypes, fn.restype = function.ctypes_signature()
    return lib


def host_extensions(at: str, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `wanted` (keys of EXTENSIONS) that extend level `at` and this CPU has."""
    return tuple(e for e in wanted if EXTENSIONS[e][0] == at and e in cpu_flags())


class Library:
    """csrc/<name>.cpp's entry points declared once (binding.Function), loaded per level on first use, with
    their checked and unchecked callers generated from the declarations: the one loader every kernel wrapper
    goes through. `title`: the kernel as start-up and stats name it. `levels`: the levels it is promised at (a
    build that fails there is a KernelBuildError; elsewhere it is not built and the torch path runs).
    `exports_if`: a symbol of the library answering whether this build exports the declared functions; a build
    at a promised level that says 0 is an error too (its ISA guards and the level's flags disagree).
    `extensions`: keys of EXTENSIONS the source uses where the CPU has them (built in by default;
    `at(level, extensions=())` gives the build without)."""

    def __init__(self, name: str, functions, title: str, levels: tuple[str, ...] = LEVELS,
                 exports_if: str | None = None, extensions: tuple[str, ...] = ()):
        unknown = set(levels) - set(LEVELS)
        if unknown:
            raise ValueError(f"levels must be among {LEVELS}, got {sorted(unknown)}")
        self.name, self.title, self.levels = name, title, tuple(levels)
        self.exports_if, self.extensions = exports_if, extensions
        self.functions = MappingProxyType({f.symbol: f for f in functions})
        self._builds: dict[tuple, dict | None] = {}

    def promised(self, at: str | None) -> bool:
        """Whether the kernel exists at level `at` (None: native kernels off)."""
        return at in self.levels

    def build_of(self, at: str) -> tuple[str, str, tuple[str, ...]]:
        """What `at(at)` builds: (source name, level, the host's extensions of it), for `prebuild`."""
        return self.name, at, host_extensions(at, self.extensions)

    def at(self, at: str | None, extensions: tuple[str, ...] | None = None) -> dict | None:
        """{symbol: (unchecked, checked)} of the library built for level `at` (and the host's extensions of it,
        unless given); None where it is not promised, with no compiler, or when `at` is None. A failed build is
        a KernelBuildError."""
        if at is None or at not in self.levels:
            return None
        key = (at, extensions)  # extensions None: the host's, resolved on the first call only (hot path)
        if key not in self._builds:
            try:
                self._builds[key] = self._callers(at, host_extensions(at, self.extensions) if extensions is None
                                                  else tuple(extensions))
            except KernelBuildError as e:  # said as the user knows the kernel, then the compiler's own words
                raise KernelBuildError(f"{self.title}: {e}") from None
        return self._builds[key]

    def _callers(self, at: str, extensions: tuple[str, ...]) -> dict | None:
        lib = load(self.name, at, extensions)
        if lib is None:
            return None
        if self.exports_if is not None:
            probe = getattr(lib, self.exports_if)
            probe.argtypes, probe.restype = [], ctypes.c_int
            if not probe():
                raise KernelBuildError(f"native kernel {self.name!r} built at level {at} exports none of its "
                                       f"functions ({self.exports_if}() is 0): its ISA guards and the level's "
                                       f"flags {LEVEL_FLAGS[at]} disagree")
        bind(self.name, self.functions.values(), at, extensions)
        return {symbol: f.callers(getattr(lib, symbol)) for symbol, f in self.functions.items()}

    def available(self, at: str | None) -> bool:
        """Whether the library runs at level `at`."""
        return self.at(at) is not None

    def unchecked(self, symbol: str, at: str | None):
        """The unchecked caller of one function at level `at`, or None."""
        callers = self.at(at)
        return None if callers is None else callers[symbol][0]

    def checked(self, symbol: str, at: str | None):
        """The checked caller (binding.KernelArgumentError on a tensor it cannot take), or None."""
        callers = self.at(at)
        return None if callers is None else callers[symbol][1]

    def accepts(self, symbol: str, **tensors) -> bool:
        """Whether the named tensors pass `symbol`'s checks (whatever the level)."""
        return self.functions[symbol].accepts(**tensors)

    def release_scratch(self) -> None:
        """Every build loaded so far empties its threads' kept scratch (csrc/thread_scratch.h), if it declares
        RELEASE_SCRATCH; builds nothing."""
        if RELEASE_SCRATCH.symbol in self.functions:
            for callers in self._builds.values():
                if callers is not None:
                    callers[RELEASE_SCRATCH.symbol][0]()
