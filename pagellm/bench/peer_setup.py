"""Where `pagellm bench` finds llama.cpp, its peer, and the one command that installs it.

`make peers` runs tools/build-llama-cpp.sh: llama.cpp's own tools (llama-server, llama-batched-bench, ...) built
once from the sources the pinned llama-cpp-python release vendors, cached in `peers_dir()`, and llama-cpp-python
in the checkout's .venv on that same build. A bench that needs a tool looks on PATH, then in that cache; one that
finds a peer missing prints `install_hint()`. Light on purpose: the CLI's parsers import it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# What the first `make peers` costs (the llama.cpp compile, tools/build-llama-cpp.sh); later ones reuse the cache.
COLD_BUILD_TIME = "5-15 minutes on 2 cores the first time, seconds after"
PEERS_DIR_VARIABLE = "PAGELLM_PEERS_DIR"


def peers_dir() -> Path:
    """The build script's cache folder, by the script's own rule: $PAGELLM_PEERS_DIR, else
    $XDG_CACHE_HOME/llama-cpp-peer, else ~/.cache/llama-cpp-peer."""
    if os.environ.get(PEERS_DIR_VARIABLE):
        return Path(os.environ[PEERS_DIR_VARIABLE])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "llama-cpp-peer"


def tools_dir() -> Path:
    return peers_dir() / "build" / "bin"


def checkout() -> Path | None:
    """The pagellm checkout this package runs from (an editable install), where `make peers` works; None for a
    copy installed elsewhere."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "tools" / "build-llama-cpp.sh").is_file() and (root / "Makefile").is_file() else None


def install_command() -> str:
    """`make peers` as typed from here: plain inside the checkout, with -C naming it elsewhere."""
    root = checkout()
    if root is None:
        return "make peers (in a pagellm checkout)"
    try:
        inside = Path.cwd().resolve() == root
    except OSError:  # the working folder was removed
        inside = False
    return "make peers" if inside else f"make -C {root} peers"


def install_hint(what: str) -> str:
    """The command that installs `what`, and how long it takes (COLD_BUILD_TIME)."""
    return f"`{install_command()}` installs {what} ({COLD_BUILD_TIME})"


def llama_tool(name: str) -> str | None:
    """llama.cpp's tool `name` (llama-server, ...): on PATH, else the build `make peers` left; None if neither."""
    found = shutil.which(name)
    if found:
        return found
    built = tools_dir() / name
    return str(built) if built.is_file() and os.access(built, os.X_OK) else None
