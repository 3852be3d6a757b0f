"""A GGUF file's weights in the CPU kernels' block layout, kept on disk after the first load.

Why: repacking a file's blocks into the kernels' layout (loader/gguf_repack.py) is the largest part of a start
(numpy over every quantized byte: ~1.6 s of the embedded model's 3.4 s load on a 2-core Zen 4). The layout depends
only on the file and on the code that lays it out, so a later start maps the stored blocks instead (the pages are
read as the kernels first touch them), as llama.cpp and vLLM keep what they derive from a file.

    <cache_dir>/gguf-blocks/<key>/blocks.bin, manifest.json
    key       sha256 of this format's version, gguf_repack.py's and gguf_blocks.py's sources (the layout), the
              file's header bytes,
              its size and its modification time: the weights' bytes are not hashed, which would read the whole
              file at every start (Python checks its .pyc files against their source the same way)
    manifest  per tensor: ggml type, rows, cols, and the offset and shape of its three arrays; blocks.bin's
              size; the file it was made from. An entry whose manifest does not parse or whose blocks.bin has
              another size is rebuilt (logged), never used; entries are written to a temporary directory and
              renamed into place.
    pruning   each entry is a whole copy of a model's blocks, and a new key for the same file (an edited file, a
              pagellm whose layout changed) orphans the old one for good: a commit removes the file's older
              entries but the newest (two pagellm versions sharing a cache keep one each), entries that do not
              name their file (written before manifests did), and partial entries no process has written to
              for an hour or whose writer has died (a load killed mid-write: loader/cache_staging.py); those are
              also removed at every start
    layout    the tensors a layer joins (a layer's q/k/v, its gate/up) lie side by side, array by array, in the
              order the join takes them: layers/gguf_linear.merged_segments then views the joined range of the
              map instead of copying the parts into the heap, so they stay file pages like every other block
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch

from pagellm.kernels.cpu import gguf_blocks
from pagellm.loader import gguf_repack
from pagellm.loader.cache_staging import PREFIX, remove_abandoned, staging_folder
from pagellm.loader.gguf_file import GGUFHeader, drop_pages

logger = logging.getLogger("pagellm.loader")

FORMAT = 2
_ALIGN = 64  # each array starts on a cache line, as the kernels' own allocations do
# the tensors of one layer that a model joins into one matmul (models/llama.py, layers/mlp.py), in join order
_JOIN_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
_JOIN_MEMBER = re.compile(r"^(blk\.\d+\.)(" + "|".join(r for g in _JOIN_GROUPS for r in g) + r")\.weight$")


class RepackCache:
    """One file's entry: `get` from it when it is whole, else `add` each repacked weight and `commit` at the end
    of the load (`abandon` when the load stops early)."""

    def __init__(self, entry: Path, source: str | None = None):
        self.entry = entry
        self.source = source  # the GGUF file the entry is made from, recorded in its manifest
        self._blocks: np.ndarray | None = None  # blocks.bin mapped, when the entry is whole
        self._mapped: torch.Tensor | None = None  # the same map as one tensor: weights are views of its storage
        self._manifest: dict = {}
        self._pending: dict[tuple[str, int], dict[str, tuple[str, gguf_blocks.GGUFWeight]]] = {}
        self._staging: Path | None = None
        self._out = None
        self._written: dict = {}
        if entry.is_dir():
            if self._open():
                return
            logger.warning("weight cache entry %s is corrupt or stale: rebuilt", entry)
            shutil.rmtree(entry, ignore_errors=True)

    @classmethod
    def for_file(cls, cache_dir: Path, path: Path, header: GGUFHeader) -> RepackCache:
        digest = hashlib.sha256(str(FORMAT).encode())
        for source in (gguf_repack.__file__, gguf_blocks.__file__):  # the layout, as the code lays it out now
            digest.update(Path(source).read_bytes())
        stat = path.stat()
        digest.update(f"{stat.st_size} {stat.st_mtime_ns}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(header.data_start))
        remove_abandoned(cache_dir / "gguf-blocks")  # a load killed mid-write left it; a hit never commits
        return cls(cache_dir / "gguf-blocks" / digest.hexdigest(), str(path.resolve()))

    @property
    def hit(self) -> bool:
        return self._blocks is not None

    def _open(self) -> bool:
        try:
            manifest = json.loads((self.entry / "manifest.json").read_text())
            blocks = self.entry / "blocks.bin"
            if blocks.stat().st_size != manifest["size"]:
                return False
            # copy-on-write: the pages stay the file's until something writes them (nothing does)
            self._blocks = np.memmap(blocks, dtype=np.uint8, mode="c") if manifest["size"] else np.empty(0, np.uint8)
            self._mapped = torch.from_numpy(self._blocks)
            self._manifest = manifest["tensors"]
            return True
        except Exception:  # noqa: BLE001 - any damage (a missing file, bad JSON, missing keys)
            return False

    def get(self, name: str) -> gguf_blocks.GGUFWeight | None:
        """The stored weight of tensor `name`, or None (a miss, or a tensor the first load did not repack)."""
        record = self._manifest.get(name) if self.hit else None
        if record is None:
            return None
        # slices of one tensor, so parts stored side by side are neighbours in one storage (merged_segments)
        arrays = [self._mapped[at:at + int(np.prod(shape))].view(shape) for at, shape in record["arrays"]]
        return gguf_blocks.GGUFWeight(gguf.GGMLQuantizationType(record["type"]), record["rows"], record["cols"],
                                      *arrays)

    def add(self, name: str, weight: gguf_blocks.GGUFWeight) -> None:
        """Append a repacked weight to the entry being written (a miss); a write that fails drops the entry. A
        member of a join group waits for the rest of its group (the file orders tensors by name, not by join)."""
        if self.hit or self._written is None:
            return
        member = _JOIN_MEMBER.match(name)
        if member is None:
            self._write([(name, weight)])
            return
        group = next(i for i, g in enumerate(_JOIN_GROUPS) if member[2] in g)
        pending = self._pending.setdefault((member[1], group), {})
        pending[member[2]] = (name, weight)
        if len(pending) == len(_JOIN_GROUPS[group]):
            self._write_group(self._pending.pop((member[1], group)), group)

    def _write_group(self, members: dict[str, tuple[str, gguf_blocks.GGUFWeight]], group: int) -> None:
        self._write([members[role] for role in _JOIN_GROUPS[group] if role in members])

    def _write(self, weights: list[tuple[str, gguf_blocks.GGUFWeight]]) -> None:
        """The weights' first arrays side by side, then their second, then their third (one weight: its three)."""
        if self._written is None:  # a write failed before: this load stores nothing more
            return
        try:
            if self._out is None:
                self._staging = staging_folder(self.entry.parent)
                self._out = open(self._staging / "blocks.bin", "wb")
            records = {name: {"type": int(w.ggml_type), "rows": w.rows, "cols": w.cols, "arrays": []}
                       for name, w in weights}
            for array in range(3):
                self._out.write(b"\0" * (-self._out.tell() % _ALIGN))
                for name, weight in weights:
                    data = weight.tensors()[array].contiguous().numpy()
                    records[name]["arrays"].append((self._out.tell(), list(data.shape)))
                    self._out.write(data.tobytes())
            self._written.update(records)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written must not fail the load
            logger.warning("weight cache not written to %s: %s", self.entry, exc)
            self.abandon()

    def commit(self) -> None:
        """The entry renamed into place whole (another process's, written first, stands)."""
        for (_, group), members in list(self._pending.items()):  # groups the file has only part of
            self._write_group(members, group)
        self._pending.clear()
        if self._out is None:
            return
        try:
            size = self._out.tell()
            self._out.close()
            self._out = None
            manifest = {"size": size, "source": self.source, "tensors": self._written}
            (self._staging / "manifest.json").write_text(json.dumps(manifest))
            os.rename(self._staging, self.entry)
        except OSError:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
            return
        self._staging = None
        self._remove_stale()

    def _remove_stale(self) -> None:
        """The pruning of the module's docstring, after a commit. An entry another process maps stays readable
        to it (Linux frees a removed file's pages when the last map goes); one whose manifest cannot be read is
        being written, or damaged (its own load rebuilds it), and is left alone."""
        same_file = []
        remove_abandoned(self.entry.parent)
        for other in self.entry.parent.iterdir():
            if other.name.startswith(PREFIX):
                continue
            if other == self.entry or other.name.startswith("."):
                continue
            try:
                manifest = other / "manifest.json"
                source = json.loads(manifest.read_text()).get("source")
                if source is None:
                    self._remove(other)
                elif source == self.source:
                    same_file.append((manifest.stat().st_mtime_ns, other))
            except (OSError, ValueError, AttributeError):
                continue
        for _, other in sorted(same_file, reverse=True)[1:]:
            self._remove(other)

    @staticmethod
    def _remove(entry: Path) -> None:
        logger.info("weight cache: removed the stale entry %s", entry)
        shutil.rmtree(entry, ignore_errors=True)

    def release(self) -> None:
        """Once the model is built: the mapped pages read so far leave the resident set (weights joined into new
        tensors at load never fault theirs back in; the others do as the kernels read them). The map is
        copy-on-write and nothing writes it, so every page is still the file's."""
        if self.hit and self._blocks.nbytes:
            drop_pages(self._blocks.ctypes.data, self._blocks.nbytes)

    def abandon(self) -> None:
        self._pending.clear()
        if self._out is not None:
            self._out.close()
            self._out = None
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        self._written = None  # nothing more is written for this load

