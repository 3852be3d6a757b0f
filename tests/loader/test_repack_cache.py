"""A GGUF's blocks in the kernels' layout kept on disk (loader/repack_cache.py): a second load maps them instead of
repacking and gets the same weights and logits (a MoE layer's experts and the joined layers as views of the map);
a damaged entry is rebuilt, never used; a changed file gets a new entry; a load that stops early leaves none."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import gguf
import pytest
import torch

from pagellm.layers.gguf_moe import GGUFMoeExperts
from pagellm.loader import gguf_hybrid, gguf_repack, tokenizer_cache
from pagellm.loader.cache_staging import process_space
from pagellm.loader.default_model import default_model_path
from pagellm.loader.gguf import read_gguf_header
from pagellm.loader.model_loader import load_model
from pagellm.loader.repack_cache import RepackCache
from tests.loader.gguf_builders import write_tiny_gguf
from tests.loader.gguf_hybrid_builders import CASES, convert_to_gguf, write_hf_checkpoint

T = gguf.GGMLQuantizationType
# q/k rows permuted by llama.cpp (Q4_0, Q8_0), k-quants, legacy 5-bit, and the embedding: every kernel format
TYPES = {"blk.0.attn_q.weight": T.Q4_0, "blk.0.attn_k.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q4_K,
         "blk.1.ffn_down.weight": T.Q6_K, "blk.0.ffn_gate.weight": T.Q5_0, "token_embd.weight": T.Q8_0}


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "m.gguf", "llama", types=TYPES)


def _load(path, cache_dir):
    return load_model(str(path), torch.float32, torch.device("cpu"), with_tokenizer=False, quantization="auto",
                      cache_dir=str(cache_dir) if cache_dir is not None else None).model


def _logits(model):
    from tests.models.paged_harness import PagedHarness

    return PagedHarness(model).prefill("a", [3, 5, 7, 11, 13])


def _counting_repacks(monkeypatch) -> list:
    calls, repack = [], gguf_repack.repack
    counting = lambda *a, **k: calls.append(1) or repack(*a, **k)  # noqa: E731
    monkeypatch.setattr(gguf_repack, "repack", counting)
    monkeypatch.setitem(gguf_hybrid._KEEPERS, "gguf", counting)  # the hybrid families' recipes repack through it
    return calls


def test_a_second_load_maps_the_stored_blocks(tiny, tmp_path, monkeypatch, caplog):
    reference = _logits(_load(tiny.path, None))
    calls = _counting_repacks(monkeypatch)
    with caplog.at_level(logging.INFO, logger="pagellm.loader"):
        first = _load(tiny.path, tmp_path / "cache")
    assert "repacking m.gguf's blocks" in caplog.text and "written in" in caplog.text  # the slow start is said
    caplog.clear()
    assert len(calls) == len(TYPES)  # every kept tensor repacked once, and stored
    (entry,) = (tmp_path / "cache" / "gguf-blocks").iterdir()
    assert not list(entry.parent.glob(".partial-*"))
    with caplog.at_level(logging.INFO, logger="pagellm.loader"):
        second = _load(tiny.path, tmp_path / "cache")
    assert len(calls) == len(TYPES) and "repacking" not in caplog.text  # none repacked again
    torch.testing.assert_close(_logits(first), reference, rtol=0, atol=0)
    torch.testing.assert_close(_logits(second), reference, rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["truncated", "manifest"])
def test_a_damaged_entry_is_rebuilt_not_used(tiny, tmp_path, monkeypatch, caplog, damage):
    reference = _logits(_load(tiny.path, tmp_path / "cache"))
    (entry,) = (tmp_path / "cache" / "gguf-blocks").iterdir()
    if damage == "truncated":
        with open(entry / "blocks.bin", "r+b") as f:
            f.truncate(os.path.getsize(entry / "blocks.bin") - 7)
    else:
        (entry / "manifest.json").write_text(json.dumps({"size": 1})[:-2])
    calls = _counting_repacks(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="pagellm.loader"):
        rebuilt = _load(tiny.path, tmp_path / "cache")
    assert "corrupt or stale: rebuilt" in caplog.text and len(calls) == len(TYPES)
    torch.testing.assert_close(_logits(rebuilt), reference, rtol=0, atol=0)
    assert json.loads((entry / "manifest.json").read_text())["size"] == os.path.getsize(entry / "blocks.bin")


def test_a_changed_file_gets_its_own_entry(tiny, tmp_path):
    _load(tiny.path, tmp_path / "cache")
    other = write_tiny_gguf(tiny.path, "llama", types=TYPES, seed=1)  # same header, other weights, new mtime
    os.utime(other.path, ns=(os.stat(other.path).st_atime_ns, os.stat(other.path).st_mtime_ns + 10**9))
    changed = _logits(_load(other.path, tmp_path / "cache"))
    assert len(list((tmp_path / "cache" / "gguf-blocks").iterdir())) == 2
    torch.testing.assert_close(changed, _logits(_load(other.path, None)), rtol=0, atol=0)


def test_a_commit_keeps_one_older_entry_of_its_file_and_no_unnamed_one(tiny, tmp_path):
    """Each entry is a whole copy of a model's blocks: entries orphaned by a changed file (or a changed layout)
    must not pile up. The newest older one stays (two pagellm versions sharing a cache keep one each); one written
    before manifests named their file goes; another file's entry stays."""
    cache = tmp_path / "cache"
    entries = cache / "gguf-blocks"
    other_file = write_tiny_gguf(tmp_path / "other.gguf", "llama", types=TYPES, seed=2)
    _load(other_file.path, cache)
    (other_entry,) = entries.iterdir()
    unnamed = entries / ("0" * 64)
    unnamed.mkdir()
    (unnamed / "manifest.json").write_text(json.dumps({"size": 0, "tensors": {}}))
    made = []
    for seed in range(3):  # the same path rewritten three times: three keys
        write_tiny_gguf(tiny.path, "llama", types=TYPES, seed=seed)
        os.utime(tiny.path, ns=(0, (seed + 1) * 10**9))
        _load(tiny.path, cache)
        made.append(next(e for e in entries.iterdir() if e not in (other_entry, unnamed, *made)))
    assert sorted(entries.iterdir()) == sorted([other_entry, made[1], made[2]])
    reference = _logits(_load(tiny.path, None))
    torch.testing.assert_close(_logits(_load(tiny.path, cache)), reference, rtol=0, atol=0)  # the newest is whole


def test_a_commit_removes_the_entries_of_files_that_are_gone(tiny, tmp_path):
    """A deleted (or moved) model's entry, a whole copy of its blocks, goes at the next commit."""
    cache = tmp_path / "cache"
    gone = write_tiny_gguf(tmp_path / "gone.gguf", "llama", types=TYPES, seed=3)
    _load(gone.path, cache)
    (gone_entry,) = (cache / "gguf-blocks").iterdir()
    os.remove(gone.path)
    _load(tiny.path, cache)
    entries = list((cache / "gguf-blocks").iterdir())
    assert len(entries) == 1 and gone_entry not in entries


def test_a_commit_removes_partial_entries_a_killed_load_left(tiny, tmp_path):
    """A load killed mid-write (SIGKILL, power) leaves its temporary directory; one untouched for an hour goes at
    the next commit, one still being written stays."""
    entries = tmp_path / "cache" / "gguf-blocks"
    entries.mkdir(parents=True)
    for name, age in ((".partial-killed", 7200), (".partial-writing", 5)):
        (entries / name).mkdir()
        (entries / name / "blocks.bin").write_bytes(b"\0" * 64)
        then = time.time() - age
        for path in (entries / name / "blocks.bin", entries / name):
            os.utime(path, (then, then))
    _load(tiny.path, tmp_path / "cache")
    left = sorted(p.name for p in entries.iterdir())
    assert ".partial-killed" not in left and ".partial-writing" in left and len(left) == 2


def _killed_writer_folder(parent) -> str:
    """A staging folder whose writer was killed mid-write (SIGKILL: nothing of it ran after)."""
    script = ("import os, signal, sys; from pathlib import Path; from pagellm.loader.cache_staging import "
              "staging_folder; f = staging_folder(Path(sys.argv[1])); (f / 'blocks.bin').write_bytes(b'x'); "
              "print(f.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", script, str(parent)], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done.stdout.strip()


def test_a_start_removes_what_a_killed_load_left_at_once(tiny, tmp_path):
    """A start that finds its entry whole (so commits nothing) still removes a staging folder whose writer in this
    process's namespace is gone, at once; one whose writer still runs, or of another host or container, stays
    while it is fresh."""
    cache = tmp_path / "cache"
    _load(tiny.path, cache)  # the entry, whole
    entries = cache / "gguf-blocks"
    killed = _killed_writer_folder(entries)
    running, elsewhere = (entries / ".partial-running"), (entries / ".partial-elsewhere")
    container = entries / ".partial-other-container"  # same host name, a dead process id of another namespace
    for folder, owner in ((running, f"{process_space()} {os.getppid()}"), (elsewhere, "other-host 1"),
                          (container, f"{socket.gethostname()}/boot/pid:[1] {2**22 + 1}")):
        folder.mkdir()
        (folder / "owner").write_text(owner)
    tokenizers = cache / "tokenizers"
    killed_tokenizer = _killed_writer_folder(tokenizers)
    _load(tiny.path, cache)
    left = {p.name for p in entries.iterdir()}
    assert killed not in left and {running.name, elsewhere.name, container.name} <= left
    tokenizer_cache.converted(Path(default_model_path()), cache)
    assert killed_tokenizer not in {p.name for p in tokenizers.iterdir()}


def test_a_load_that_stops_early_leaves_no_entry(tiny, tmp_path, monkeypatch):
    repack = gguf_repack.repack
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("out of memory")
        return repack(*args, **kwargs)

    monkeypatch.setattr(gguf_repack, "repack", failing)
    with pytest.raises(MemoryError):
        _load(tiny.path, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf-blocks").iterdir())



def test_joined_layers_map_their_stored_blocks(tmp_path):
    """q/k/v and gate/up of one format are one layer each; on a load that wrote the entry and on every later one,
    their joined blocks are views of the stored entry (one range of blocks.bin each), not heap copies, and compute
    what the uncached load computes."""
    joined = {f"blk.{i}.{role}.weight": fmt for i in range(2) for role, fmt in
              [("attn_q", T.Q8_0), ("attn_k", T.Q8_0), ("attn_v", T.Q8_0), ("ffn_gate", T.Q4_0), ("ffn_up", T.Q4_0)]}
    tiny = write_tiny_gguf(tmp_path / "j.gguf", "llama", types=joined)
    reference = _logits(_load(tiny.path, None))
    first = _load(tiny.path, tmp_path / "cache")
    (entry,) = (tmp_path / "cache" / "gguf-blocks").iterdir()
    second = _load(tiny.path, tmp_path / "cache")
    mapped = os.path.getsize(entry / "blocks.bin")
    for model, is_view in ((first, True), (second, True)):  # the first start loads again from what it wrote
        layers = [m for name, m in model.named_modules() if name.endswith(("qkv_proj", "gate_up_proj"))]
        assert len(layers) == 4
        for layer in layers:
            assert len(layer.formats) == 1  # one segment: the parts were joined
            for name in ("qs0", "gp0"):
                assert (layer.get_buffer(name).untyped_storage().nbytes() == mapped) is is_view, (layer, name)
    torch.testing.assert_close(_logits(second), reference, rtol=0, atol=0)
    torch.testing.assert_close(_logits(first), reference, rtol=0, atol=0)


def _hybrid_gguf(tmp_path, case: str, expert_types: tuple[T, T, T]) -> str:
    """CASES[case] with every 2-D weight Q8_0 and the experts' gate, up and down as `expert_types`."""
    family, conversion = CASES[case]
    write_hf_checkpoint(family, tmp_path / "hf")
    probe = convert_to_gguf(tmp_path / "hf", tmp_path / "probe.gguf", conversion)
    types = {n: T.Q8_0 for n, v in probe.items() if v.ndim >= 2 and v.shape[-1] % 32 == 0 and v.shape[-2] % 16 == 0}
    for name in [n for n in types if "_exps." in n]:
        gate, up, down = expert_types
        types[name] = {"ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down,
                       "ffn_gate_up_exps": gate}[name.split(".")[2]]
    convert_to_gguf(tmp_path / "hf", tmp_path / "model.gguf", dataclasses.replace(conversion, types=types))
    return str(tmp_path / "model.gguf")


@pytest.mark.parametrize("case,expert_types", [
    ("qwen3.5-moe-mtp-fused", (T.Q8_0, T.Q8_0, T.Q8_0)),  # DeltaNet + gated attention; gate_up stored fused
    ("qwen3-moe", (T.Q8_0, T.Q4_0, T.Q5_0)),  # gate and up of two formats: stacked apart, not joined
])
def test_a_moe_file_s_second_load_maps_its_experts(tmp_path, monkeypatch, case, expert_types):
    """The MoE and hybrid families' files (their tensors read through gguf_hybrid's recipes, under HF names) are
    cached too: a second load repacks nothing, the stacked experts and joined layers of both loads are views of the
    stored entry, not heap copies, and their logits are those of the uncached load, bit for bit."""
    path = _hybrid_gguf(tmp_path, case, expert_types)
    reference = _logits(_load(path, None))
    calls = _counting_repacks(monkeypatch)
    first = _load(path, tmp_path / "cache")
    repacked = len(calls)
    second = _load(path, tmp_path / "cache")
    assert repacked > 0 and len(calls) == repacked  # none repacked again
    (entry,) = (tmp_path / "cache" / "gguf-blocks").iterdir()
    mapped = os.path.getsize(entry / "blocks.bin")
    experts = [m for model in (first, second) for m in model.modules() if isinstance(m, GGUFMoeExperts)]
    joined = [m for model in (first, second) for name, m in model.named_modules()
              if name.endswith(("qkv_proj", "gate_up_proj"))]
    assert experts and joined
    for module in experts + joined:  # the first load too: it loads again from the entry it wrote
        for name, buffer in module.named_buffers():  # (a format without sub-scales has an empty third array)
            assert buffer.numel() == 0 or buffer.untyped_storage().nbytes() == mapped, (module, name)
    assert {tuple(e.formats.values()) for e in experts} == (
        {(T.Q8_0, T.Q8_0)} if expert_types[0] == expert_types[1] else {expert_types})
    torch.testing.assert_close(_logits(first), reference, rtol=0, atol=0)
    torch.testing.assert_close(_logits(second), reference, rtol=0, atol=0)


def test_the_load_that_writes_the_entry_holds_one_join_group_at_a_time(tmp_path, monkeypatch):
    """The first start writes the entry before any layer takes a weight, dropping each repacked weight once it is
    stored: at most one join group (a layer's experts' gate/up) is alive at a time, never the model's weights, so
    its peak is a layer's blocks, not the file's size twice."""
    path = _hybrid_gguf(tmp_path, "qwen3.5-moe-mtp-fused", (T.Q8_0,) * 3)
    alive, most, made, repack = [], [0], [0], gguf_repack.repack

    def watched(*args, **kwargs):
        alive[:] = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(alive))
        weight = repack(*args, **kwargs)
        alive.append(weakref.ref(weight))
        made[0] += 1
        return weight

    monkeypatch.setattr(gguf_repack, "repack", watched)
    monkeypatch.setitem(gguf_hybrid._KEEPERS, "gguf", watched)
    model = _load(path, tmp_path / "cache")
    experts = [m for m in model.modules() if isinstance(m, GGUFMoeExperts)]
    group = 2 * experts[0].num_experts  # every expert's gate and up, stored side by side
    assert made[0] > 3 * group  # the model's repacked weights: several groups' worth
    assert most[0] <= group + 2, (most[0], group)  # the group pending, the weight being stored and the one before


def test_a_disk_without_room_for_the_entry_is_said_and_the_file_repacked_once(tiny, tmp_path, monkeypatch, caplog):
    """A fill that would run out of disk is not started: a warning names the space, nothing is written, every
    kept tensor is repacked once (into memory) and the model computes what the uncached load computes."""
    reference = _logits(_load(tiny.path, None))
    calls = _counting_repacks(monkeypatch)
    monkeypatch.setattr("pagellm.loader.repack_cache.shutil.disk_usage",
                        lambda where: shutil._ntuple_diskusage(10 << 30, 10 << 30, os.path.getsize(tiny.path)))
    with caplog.at_level(logging.WARNING, logger="pagellm.loader"):
        model = _load(tiny.path, tmp_path / "cache")
    assert "GiB free" in caplog.text and "--cache-dir" in caplog.text
    assert len(calls) == len(TYPES)
    assert not list((tmp_path / "cache").rglob("blocks.bin"))
    torch.testing.assert_close(_logits(model), reference, rtol=0, atol=0)


def test_a_write_that_fails_mid_fill_stops_it_and_the_load_repacks_into_memory(tmp_path, monkeypatch, caplog):
    """A disk that fills during the entry's write: the fill stops at once (not repacking the rest for nothing),
    nothing is left behind, and the load repacks every weight once into memory, computing the same logits."""
    path = _hybrid_gguf(tmp_path, "qwen3-moe", (T.Q8_0,) * 3)
    reference = _logits(_load(path, None))
    calls = _counting_repacks(monkeypatch)
    _load(path, tmp_path / "probe")
    kept = len(calls)
    real_open, writes = open, []

    class FillingDisk:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            writes.append(1)
            if len(writes) == 5:
                raise OSError(28, "No space left on device")
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    def opening(file, mode="r", *args, **kwargs):  # the entry's blocks.bin is the one file opened to write
        opened = real_open(file, mode, *args, **kwargs)
        return FillingDisk(opened) if "w" in mode else opened

    monkeypatch.setattr("pagellm.loader.repack_cache.open", opening, raising=False)
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="pagellm.loader"):
        model = _load(path, tmp_path / "cache")
    assert "not written" in caplog.text and len(writes) == 5
    assert kept < len(calls) < 2 * kept  # the fill stopped early; the load repacked every weight once
    assert not list((tmp_path / "cache").rglob("blocks.bin"))
    torch.testing.assert_close(_logits(model), reference, rtol=0, atol=0)


def test_a_hybrid_file_s_entry_follows_the_recipes_source(tmp_path, monkeypatch):
    """Which rows of which tensors an HF weight is comes from gguf_hybrid.py: a change there is a new entry for
    a hybrid file, and no change for any other."""
    hybrid = _hybrid_gguf(tmp_path, "qwen3-moe", (T.Q8_0,) * 3)
    dense = write_tiny_gguf(tmp_path / "m.gguf", "llama", types=TYPES).path
    before = [RepackCache.for_file(tmp_path, Path(p), read_gguf_header(p)).entry for p in (hybrid, dense)]
    edited = tmp_path / "gguf_hybrid.py"
    edited.write_text(Path(gguf_hybrid.__file__).read_text() + "\n# edited\n")
    monkeypatch.setattr(gguf_hybrid, "__file__", str(edited))
    after = [RepackCache.for_file(tmp_path, Path(p), read_gguf_header(p)).entry for p in (hybrid, dense)]
    assert after[0] != before[0] and after[1] == before[1]
