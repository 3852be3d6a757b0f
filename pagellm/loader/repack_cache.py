"""A GGUF file's weights in the CPU kernels' block layout, kept on disk after the first load.

Why: repacking a file's blocks into the kernels' layout (loader/gguf_repack.py) is the largest part of a start
(numpy over every quantized byte: ~1.6 s of the embedded model's 3.4 s load on a 2-core Zen 4). The layout depends
only on the file and on the code that lays it out, so a later start maps the stored blocks instead (the pages are
read as the kernels first touch them), as llama.cpp and vLLM keep what they derive from a file.

    <cache_dir>/gguf-blocks/<key>/blocks.bin, manifest.json
    key       sha256 of this format's version, gguf_repack.py's, gguf_blocks.py's and csrc/gguf_layout.cpp's sources
              (the layout; for the MoE and hybrid families gguf_hybrid.py's too, which picks each weight's rows),
              the file's header bytes, its size and its modification time: the weights' bytes are not hashed,
              which would read the whole file at every start (Python checks its .pyc files against their source
              the same way)
    manifest  per tensor: ggml type, rows, cols, and the offset and shape of its three arrays; blocks.bin's
              size; the file it was made from. An entry whose manifest does not parse or whose blocks.bin has
              another size is rebuilt (logged), never used; entries are written to a temporary directory and
              renamed into place.
    pruning   each entry is a whole copy of a model's blocks, and a new key for the same file (an edited file, a
              pagellm whose layout changed) orphans the old one for good: a commit removes the file's older
              entries but the newest (two pagellm versions sharing a cache keep one each), entries that do not
              name their file (written before manifests did) or whose file is gone (deleted or moved: a copy of a
              whole model would otherwise stay for good), and partial entries no process has written to
              for an hour or whose writer has died (a load killed mid-write: loader/cache_staging.py); those are
              also removed at every start
    layout    the tensors a layer joins (a layer's q/k/v, its gate/up) lie side by side, array by array, in the
              order the join takes them: layers/gguf_linear.merged_segments then views the joined range of the
              map instead of copying the parts into the heap, so they stay file pages like every other block.
              A MoE layer's experts lie so too, in the order layers/gguf_moe.py stacks them (each expert's gate
              and up joined where they share a format): the stacked experts are views of the map, their pages
              read only as the experts are routed to, as llama.cpp maps a file
    names     a file's GGUF names; the MoE and hybrid families' files (loader/gguf_hybrid.py: their tensors are
              split, reordered and stacked on the way) their HF names, and that module's source is in the key
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

from pagellm.kernels.build import native
from pagellm.kernels.cpu import gguf_blocks, gguf_layout
from pagellm.layers.gguf_moe import joins_gate_up
from pagellm.layers.moe import EXPERT_KEY
from pagellm.loader import gguf_hybrid, gguf_repack
from pagellm.loader.cache_staging import PREFIX, remove_abandoned, staging_folder
from pagellm.loader.gguf_file import GGUFHeader, drop_pages

logger = logging.getLogger("pagellm.loader")

FORMAT = 2
_ROOM = 1.05  # an entry's size over its file's at most: the kept blocks grow by up to 3% (gguf_repack.py), plus
# alignment, and the file's float tensors (norms) are not in it
_ALIGN = 64  # each array starts on a cache line, as the kernels' own allocations do
# the tensors of one layer that a model joins into one matmul (models/llama.py, layers/mlp.py), in join order:
# (a member's name, the group's roles), under GGUF names and under the HF names of the hybrid families' files
_JOINS = ((re.compile(r"^(blk\.\d+\.)(attn_q|attn_k|attn_v)\.weight$"), ("attn_q", "attn_k", "attn_v")),
          (re.compile(r"^(blk\.\d+\.)(ffn_gate|ffn_up)\.weight$"), ("ffn_gate", "ffn_up")),
          (re.compile(r"^(.+\.self_attn\.)(q|k|v)_proj\.weight$"), ("q", "k", "v")),
          (re.compile(r"^(.+\.(?:mlp|shared_expert)\.)(gate|up)_proj\.weight$"), ("gate", "up")))


class RepackCache:
    """One file's entry: `get` from it when it is whole, else `add` each repacked weight and `commit` at the end
    of the load (`abandon` when the load stops early)."""

    def __init__(self, entry: Path, source: str | None = None, num_experts: int = 0):
        self.entry = entry
        self.source = source  # the GGUF file the entry is made from, recorded in its manifest
        self.num_experts = num_experts  # a MoE layer's experts, stored as one group (0: none)
        self._blocks: np.ndarray | None = None  # blocks.bin mapped, when the entry is whole
        self._mapped: torch.Tensor | None = None  # the same map as one tensor: weights are views of its storage
        self._manifest: dict = {}
        self._pending: dict[tuple[str, str], dict[str, gguf_blocks.GGUFWeight]] = {}  # join groups arriving
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
        # the layout, as the code lays it out now (the numpy and the kernel that lay out the codes)
        layout = [gguf_repack.__file__, gguf_blocks.__file__, native.source_of(gguf_layout.SOURCE)]
        if header.architecture in gguf_hybrid.HYBRID_ARCHITECTURES:
            layout.append(gguf_hybrid.__file__)  # which rows of which tensors each HF weight is
        for source in layout:
            digest.update(Path(source).read_bytes())
        stat = path.stat()
        digest.update(f"{stat.st_size} {stat.st_mtime_ns}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(header.data_start))
        remove_abandoned(cache_dir / "gguf-blocks")  # a load killed mid-write left it; a hit never commits
        num_experts = header.metadata.get(f"{header.architecture}.expert_count", 0)
        return cls(cache_dir / "gguf-blocks" / digest.hexdigest(), str(path.resolve()), num_experts)

    def has_room(self, file_bytes: int) -> bool:
        """Whether the disk holds an entry made from a file of `file_bytes` (about that size: logged when not).
        Why ask first: a fill that runs out of disk is abandoned after repacking the file once for nothing, and
        the load then repacks it again into memory."""
        where = next(p for p in self.entry.parents if p.exists())  # the cache's folder, or what holds it
        free, needed = shutil.disk_usage(where).free, int(file_bytes * _ROOM)
        if free >= needed:
            return True
        logger.warning("weight cache: %s has %.1f GiB free and this file's entry takes about %.1f GiB: not "
                       "written, so every start repacks the file's blocks into memory (free some space, or "
                       "pass --cache-dir elsewhere)", where, free / 2**30, needed / 2**30)
        return False

    def reopened(self) -> RepackCache:
        """The entry as committed (by this process's fill_block_cache, or another's written first)."""
        return RepackCache(self.entry, self.source, self.num_experts)

    @property
    def failed(self) -> bool:
        """Whether a write failed: this load stores nothing more, and the entry is abandoned."""
        return self._written is None

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
        group = _join_group(name, self.num_experts)
        if group is None:
            self._write([(name, weight)])
            return
        key, size = group
        pending = self._pending.setdefault(key, {})
        pending[name] = weight
        if len(pending) == size:
            self._write(_in_join_order(self._pending.pop(key)))

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
                    self._out.write(data)  # the array's own bytes: no copy
            self._written.update(records)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written must not fail the load
            logger.warning("weight cache not written to %s: %s", self.entry, exc)
            self.abandon()

    def commit(self) -> None:
        """The entry renamed into place whole (another process's, written first, stands)."""
        for members in self._pending.values():  # groups the file has only part of
            self._write(_in_join_order(members))
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
                if source is None or not Path(source).exists():  # its file deleted or moved: never read again
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


def _join_group(name: str, num_experts: int) -> tuple[tuple[str, str], int] | None:
    """(the group's key, its size) of a tensor stored side by side with others, else None. A MoE layer's experts
    form two groups: every expert's gate and up, and every expert's down."""
    for pattern, roles in _JOINS:
        member = pattern.match(name)
        if member is not None:
            return (member[1], roles[0]), len(roles)
    expert = EXPERT_KEY.match(name)
    if expert is None or num_experts == 0:
        return None
    down = expert["proj"] == "down_proj"
    return (expert["prefix"], "down" if down else "gate_up"), num_experts * (1 if down else 2)


def _in_join_order(members: dict[str, gguf_blocks.GGUFWeight]) -> list[tuple[str, gguf_blocks.GGUFWeight]]:
    """A group's members in the order their consumer joins them: a layer's roles in _JOINS's order; experts by
    index, each one's gate before its up where every gate and up share a format (layers/gguf_moe.py joins each
    expert's then), else all the gates, then all the ups."""
    one_format = joins_gate_up(w.ggml_type for w in members.values())

    def position(name: str) -> tuple[int, ...]:
        expert = EXPERT_KEY.match(name)
        if expert is None:
            return (next(roles.index(m[2]) for pattern, roles in _JOINS if (m := pattern.match(name))),)
        index, is_up = int(expert["expert"]), int(expert["proj"] == "up_proj")
        return (index, is_up) if one_format else (is_up, index)

    return sorted(members.items(), key=lambda item: position(item[0]))
