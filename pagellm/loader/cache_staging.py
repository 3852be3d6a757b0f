"""Staging folders of the on-disk caches (GGUF blocks, tokenizers): an entry is written into a `.partial-*`
folder and renamed into place whole, so a reader never sees half of one. A load killed mid-write leaves its
folder behind; the next start removes it once its writer is known to be gone.

Each staging folder names its writer in an `owner` file: its process id and where that id means something (the
host name, the kernel's boot id and the process-id namespace; containers restart with the same host name and
process ids, but never in the same namespace). A folder whose writer ran in this process's namespace on this boot
and no longer runs is removed at once; any other (another host or container sharing the cache, or no owner file:
an older pagellm's) only once nothing has been written to it for ABANDONED_AFTER_S, as a writer that still runs
keeps writing."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("pagellm.loader")

PREFIX = ".partial-"
ABANDONED_AFTER_S = 3600
_OWNER = "owner"


def staging_folder(parent: Path) -> Path:
    """A new staging folder under `parent` (created), naming this process as its writer."""
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=PREFIX))
    (staging / _OWNER).write_text(f"{process_space()} {os.getpid()}")
    return staging


def remove_abandoned(parent: Path) -> None:
    """Remove the staging folders under `parent` whose writers are gone (never this process's own)."""
    try:
        folders = [p for p in parent.iterdir() if p.name.startswith(PREFIX)]
    except OSError:  # no cache yet
        return
    for folder in folders:
        if _abandoned(folder):
            logger.info("cache: removed %s, left by a load that stopped mid-write", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _abandoned(folder: Path) -> bool:
    try:
        space, pid = (folder / _OWNER).read_text().rsplit(" ", 1)
        if space == process_space():
            return int(pid) != os.getpid() and not _running(int(pid))
    except (OSError, ValueError):  # no owner file (an older pagellm's, or just created): judged by its age
        pass
    return idle_seconds(folder) > ABANDONED_AFTER_S


def process_space() -> str:
    """Where a process id names one process: host, boot and pid namespace (what /proc lacks left as "-")."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            parts.append("-")
    return "/".join(parts)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def idle_seconds(directory: Path) -> float:
    """Seconds since anything in `directory` was last written (a cache file grows for as long as a load writes)."""
    try:
        newest = max([directory.stat().st_mtime, *(f.stat().st_mtime for f in directory.iterdir())])
    except OSError:  # removed meanwhile (its writer abandoned or committed it)
        return 0.0
    return time.time() - newest
