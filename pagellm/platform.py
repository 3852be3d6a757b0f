"""The host the engine runs on: dtype names, memory and core counts, torch threads and glibc's heap settings.

Shared by the engine and the tensor-parallel workers, which set the process up the same way.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
from types import MappingProxyType

import torch

from pagellm.collector import freeze_alive

DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
GIB = 1 << 30


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def available_memory_bytes() -> int:
    """RAM available now (free pages; 8 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * GIB


def physical_cores() -> int:
    """Cores (not SMT siblings) among the CPUs this process may run on."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        try:
            topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
            with open(topology + "physical_package_id") as pkg, open(topology + "core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def limit_threads_to_cores() -> None:
    """Intra-op threads = physical cores: SMT siblings share the FMA units and only add barrier waits.

    Left alone when the user chose (OMP_NUM_THREADS, or torch.set_num_threads below the core count).
    """
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > physical_cores():
        torch.set_num_threads(physical_cores())


# glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh mmaps and unmaps them on
# free, so every step's large temporaries page-fault anew: the [64, 262144] logits of a B=64 Gemma 3 step
# fault in again on every pass. measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt parameters, from glibc's malloc.h
_STEP_HEAP_BYTES = 1 << 30


def freeze_loaded_objects() -> None:
    """Move what is alive now (a loaded engine: many long-lived objects) out of the GC's reach: without it a full
    pass rescans them every few steps and stalls one (measured: docs/benchmarks/2026-11-24-quantized-layer-
    crossovers.md; vLLM does the same). Collected first: the load's own garbage is not kept."""
    gc.collect()
    freeze_alive()


def release_freed_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim; nothing elsewhere): a load's temporaries
    freed in the heap would otherwise stay resident under what is loaded next, and the peaks add up."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def keep_step_buffers_in_heap(enabled: bool = True) -> bool:
    """Serve allocations below 1 GiB from the heap and keep up to 1 GiB of freed heap: a step's big
    buffers are then reused instead of faulted in again. Called once weights are loaded (their large
    temporaries stay mmapped and go back to the OS). One arena: a thread's own arena grows in 64 MiB
    heaps, so the server's engine thread would still mmap anything larger. Process-wide (it is the
    process's allocator): enabled=False (KernelConfig.heap_tuning) leaves glibc's defaults. Returns whether
    every setting took (False where this is not glibc, or an older glibc refuses a threshold above 32 MiB)."""
    if not enabled:
        return False
    try:
        release_freed_heap()  # first the load's freed temporaries (repacking, dequantizing)
        libc = ctypes.CDLL("libc.so.6")
        settings = ((_M_MMAP_THRESHOLD, _STEP_HEAP_BYTES), (_M_TRIM_THRESHOLD, _STEP_HEAP_BYTES), (_M_ARENA_MAX, 1))
        return all([bool(libc.mallopt(param, value)) for param, value in settings])  # each applied on its own
    except (OSError, AttributeError):
        return False


_MADV_DONTNEED = 4
# the CUDA runtime and libraries PyPI's torch links: the nvidia-* wheels' libraries, libtorch_cuda, c10's CUDA part
_CUDA_LIBRARY = re.compile(r"/nvidia/.*\.so[.0-9]*$|/lib(?:torch_cuda|c10_cuda|torch_nvshmem)\.so$")


def release_cuda_library_pages(device: torch.device) -> int:
    """Drop this process's page mappings of the CUDA libraries torch links, for an engine on the CPU (nothing for
    another `device`): torch's CUDA build loads them (and their constructors touch hundreds of MB of their code and
    tables), but nothing runs them here. Only mappings that hold no private data are dropped (not writable, no
    copied-on-write pages): MADV_DONTNEED then only removes page-table entries, the files stay in the page cache,
    and a later access maps its page again. Returns the resident bytes dropped (0 where there is nothing to drop, or
    no /proc)."""
    if device.type != "cpu":
        return 0
    try:
        with open("/proc/self/smaps") as f:
            smaps = f.read().splitlines()
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for start, end, resident in unwritten_mappings(smaps, _CUDA_LIBRARY):
        if madvise(start, end - start, _MADV_DONTNEED) == 0:
            released += resident
    return released


def unwritten_mappings(smaps: list[str], path: re.Pattern) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each mapping in /proc/self/smaps' lines whose file matches `path`, that is
    not writable and has no anonymous (copied-on-write) pages: what MADV_DONTNEED can drop without losing data."""
    found, current = [], None
    for line in smaps + ["end-of-smaps 0"]:  # the sentinel closes the last mapping
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # "start-end perms offset dev inode [path]"
            if current is not None and current["keep"] and current["anonymous"] == 0 and current["rss"] > 0:
                found.append((current["start"], current["end"], current["rss"]))
            bounds = fields[0].split("-")
            keep = len(fields) >= 6 and "w" not in fields[1] and bool(path.search(fields[-1]))
            current = {"start": int(bounds[0], 16), "end": int(bounds[1], 16), "keep": keep, "rss": 0,
                       "anonymous": -1} if keep else {"keep": False}
        elif current is not None and current["keep"] and fields and fields[0] in ("Rss:", "Anonymous:"):
            current["rss" if fields[0] == "Rss:" else "anonymous"] = int(fields[1]) * 1024
    return found
