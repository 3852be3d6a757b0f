"""The GGUF container: metadata and tensor table, parsed by hand, tensor data memory-mapped.

    header  magic "GGUF" | version u32 | tensor count u64 | kv count u64
    kv      key string | value type u32 | value            (kv count times)
    tensors name string | n_dims u32 | dims u64[n_dims] | ggml type u32 | offset u64
    data    aligned to general.alignment (32); each tensor at data_start + offset

We parse the header ourselves instead of with gguf.GGUFReader: the reader builds
several numpy views for every element of every metadata array, which is slow for a
large vocabulary such as Gemma 3's (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md;
tested equal to the reader's output in tests/loader). What the tensors mean is gguf.py's business.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.errors import KernelBuildError

# The GGUF vocabulary's library (csrc/sentencepiece_vocab.cpp beside this file): the tokenizer's, not a kernel,
# built and cached as the kernels are (kernels/build/native.py); no vector code, so one build, at the generic level,
# serves every CPU.
VOCABULARY = (str(Path(__file__).with_name("csrc") / "sentencepiece_vocab.cpp"), "generic")

_GGUF_VERSIONS = (2, 3)  # v1 counted with 32-bit integers and is long gone
_DEFAULT_ALIGNMENT = 32
# metadata value types: fixed-size scalars by struct format; 8 = string, 9 = array
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
# the ggml types the file holds as plain numbers, viewed with their numpy dtype (as GGUFReader does);
# every other type (BF16 included) is viewed as uint8 rows of blocks
PLAIN_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def drop_pages(address: int, nbytes: int) -> None:
    """Drop the whole pages of a file mapping's [address, address + nbytes) from the resident set: a later read
    faults them back in from the file (the page cache keeps them). Only for pages nothing has written."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    start, end = address // mmap.PAGESIZE * mmap.PAGESIZE, address + nbytes
    if advice is not None and end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: the reverse of the file's dims
    data: np.ndarray = field(repr=False)  # read-only memmap view: typed for plain types, else uint8 blocks

    def release(self, first_row: int = 0, end_row: int | None = None) -> None:
        """Drop the file pages of rows [first_row, end_row) (all by default) from the process's resident set once
        a loader is done with them. Why: the mapped pages read so far otherwise count in the process's RSS until
        the whole map is closed, a peak of the file's size on top of the weights built from it. Safe whatever
        still views the data: the map is read-only, so a later read faults the pages back in from the file (the
        page cache keeps them)."""
        if self.data.nbytes == 0:
            return
        row_bytes = self.data.nbytes // self.shape[0]
        end_row = self.shape[0] if end_row is None else end_row
        drop_pages(self.data.ctypes.data + first_row * row_bytes, (end_row - first_row) * row_bytes)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]  # scalars, strings, and numeric arrays as lists
    array_lengths: dict[str, int]  # every array's length; string arrays' contents are not read
    tensors: tuple[GGUFTensor, ...]
    data_start: int = 0  # bytes before the tensor data: the metadata (whole vocabularies too) and the tensor table
    string_arrays: dict[str, int] = field(default_factory=dict)  # key -> file offset of its first string
    number_arrays: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> (file offset, numpy dtype)

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    def strings(self, key: str) -> list[str] | None:
        """A string array's values (a vocabulary, merges), read now from the file; None when the key is absent.
        Why not at header time: most loads never need them, and 262k pieces cost ~0.1 s to decode."""
        if key not in self.string_arrays:
            return None
        blob = np.memmap(self.path, mode="r", dtype=np.uint8)
        data, pos, out = blob[: self.data_start].tobytes(), self.string_arrays[key], []
        for _ in range(self.array_lengths[key]):
            (length,) = struct.unpack_from("<Q", data, pos)
            out.append(data[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        return out

    def numbers(self, key: str) -> np.ndarray | None:
        """A numeric array as a read-only numpy view of the file; None when the key is absent. The metadata has
        it as a list too; this is for the long ones (a vocabulary's scores and types), which numpy and C++ then
        read without a conversion."""
        if key not in self.number_arrays:
            return None
        offset, dtype = self.number_arrays[key]
        return np.memmap(self.path, mode="r", dtype=dtype, offset=offset, shape=(self.array_lengths[key],))

    def required(self, key: str) -> Any:
        """The metadata value of `key`; a ValueError naming the file and the key when it is absent."""
        if key not in self.metadata:
            raise ValueError(f"{str(self.path)!r}: metadata key {key} is missing")
        return self.metadata[key]


def header_of(source: str | Path | GGUFHeader) -> GGUFHeader:
    """A header read once and handed on (reading one parses every metadata value: the whole vocabulary), or
    read now from a path."""
    return source if isinstance(source, GGUFHeader) else read_gguf_header(source)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor table of a GGUF file; tensor data is only memory-mapped, not read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic bytes)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in _GGUF_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"{str(path)!r} is GGUF version {version}{hint}; supported versions: {_GGUF_VERSIONS}")
    pos, metadata, lengths, string_arrays, number_arrays = 24, {}, {}, {}, {}
    for _ in range(n_kv):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        start = pos + 4
        metadata[key], length, pos = _read_value(blob, start, value_type, key)
        if length is not None:
            lengths[key] = length
        if metadata[key] is None:  # a string array: its strings start after the item type and count
            string_arrays[key] = start + 12
        elif length is not None:
            number_arrays[key] = start + 12, "<" + _SCALAR_FORMATS[struct.unpack_from("<I", blob, start)[0]]
    if "general.architecture" not in metadata:
        raise ValueError(f"{str(path)!r} has no general.architecture in its metadata")
    table, pos = _read_tensor_table(blob, n_tensors, pos, path)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = tuple(_tensor_view(blob, data_start, *entry) for entry in table)
    metadata = {k: v for k, v in metadata.items() if v is not None}  # string arrays: lengths only
    return GGUFHeader(path, metadata, lengths, tensors, data_start, string_arrays, number_arrays)


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's values as a writable float32 torch tensor of its torch-order shape."""
    values = gguf.quants.dequantize(tensor.data, tensor.ggml_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    return torch.from_numpy(values).reshape(tensor.shape)


def _read_string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _read_value(blob: np.ndarray, pos: int, value_type: int, key: str) -> tuple[Any, int | None, int]:
    """(value, array length or None, position after it). String arrays come back as None."""
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        value = struct.unpack_from(fmt, blob, pos)[0]
        if value_type == _FLOAT32:  # shortest decimal of the float32: 1e-06, not 9.999999974752427e-07
            value = float(str(np.float32(value)))
        return value, None, pos + struct.calcsize(fmt)
    if value_type == _STRING:
        value, pos = _read_string(blob, pos)
        return value, None, pos
    if value_type != _ARRAY:
        raise ValueError(f"GGUF metadata key {key!r} has unknown value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item_type in _SCALAR_FORMATS:
        fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
        return list(struct.unpack_from(fmt, blob, pos)), count, pos + struct.calcsize(fmt)
    if item_type != _STRING:
        raise ValueError(f"GGUF metadata key {key!r} is an array of type {item_type}, which is not supported")
    return None, count, _strings_end(blob, pos, count, key)  # vocabularies and merges: the tokenizer reads them


def _strings_end(blob: np.ndarray, pos: int, count: int, key: str) -> int:
    """Where the `count` strings from `pos` end. In C++ where there is a compiler: in Python, the walk over a
    large vocabulary is a share of every start worth having back."""
    walk = _compiled_walk()
    if walk is not None:
        end = walk(blob.ctypes.data, blob.size, pos, count)
    else:
        end = pos
        for _ in range(count):
            if end + 8 > blob.size:
                end = -1
                break
            end += 8 + struct.unpack_from("<Q", blob, end)[0]
    if end < 0 or end > blob.size:
        raise ValueError(f"GGUF metadata key {key!r}: its strings run past the end of the file")
    return end


def _compiled_walk():
    """gguf_strings_end of the vocabulary's library (csrc/sentencepiece_vocab.cpp), typed; None without it."""
    try:
        lib = native.load(*VOCABULARY)
    except KernelBuildError:
        return None  # the reader needs no compiled code: the tokenizer reports a broken build where it needs one
    if lib is None:
        return None
    walk = lib.gguf_strings_end
    if walk.restype is not ctypes.c_int64:  # typed once per loaded library
        walk.argtypes, walk.restype = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64), ctypes.c_int64
    return walk


def _read_tensor_table(blob: np.ndarray, count: int, pos: int, path: Path) -> tuple[list[tuple], int]:
    table = []
    for _ in range(count):
        name, pos = _read_string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        raw_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has unknown ggml type id {raw_type}") from None
        table.append((name, ggml_type, tuple(reversed(dims)), offset))  # GGUF dims run fastest first
    return table, pos


def _tensor_view(blob: np.ndarray, data_start: int, name: str, ggml_type, shape: tuple, offset: int) -> GGUFTensor:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n_elements = int(np.prod(shape, dtype=np.int64))
    n_bytes = n_elements // block_size * type_size
    start = data_start + offset
    if start + n_bytes > blob.size:
        raise ValueError(f"GGUF file is truncated: tensor {name!r} ends past the end of the file")
    raw = blob[start : start + n_bytes]
    if ggml_type in PLAIN_DTYPES:
        data = raw.view(PLAIN_DTYPES[ggml_type]).reshape(shape)
    else:
        data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, ggml_type))
    return GGUFTensor(name, ggml_type, shape, data)
