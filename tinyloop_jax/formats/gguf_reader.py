"""A GGUF file's header: metadata and tensor index, parsed with bounds checks; tensor bytes
memory-mapped and read when used.

    "GGUF" | u32 version (2, 3) | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 type, value)       value: scalar | string | array (u32 type, u64 n, items)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] fastest first, u32 ggml type, u64 offset)
    padding to `general.alignment` (32), then the tensors' data, each at its offset

Strings are u64 length + UTF-8 bytes. (`gguf.GGUFReader` parses the same into one numpy array per
string: 5 s for a 49k-token vocabulary; this takes a tenth of a second.) Anything that does not
fit (a count or a length past the end, an unknown type, a tensor whose bytes the file does not
hold) is a ValueError naming the file.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct

import numpy as np

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple  # GGUF order, fastest first: a [out, in] matrix is (in, out)
    ggml_type: int
    offset: int  # from the start of the file

    @property
    def shape(self) -> tuple:
        """Row-major shape (dims reversed): Hugging Face's [out, in] for a matrix."""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{self.path} is truncated or corrupt: needs {n} bytes at offset {self.pos}, "
                             f"the file has {len(self.buf)}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path} is corrupt: a string at offset {self.pos - len(raw)} is not UTF-8") from e

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path} is corrupt: unknown metadata value type {kind} at offset {self.pos - 4}")
        item, n = self.scalar("<I"), self.scalar("<Q")
        if item in _SCALARS:  # numbers in one read
            fmt = _SCALARS[item]
            return np.frombuffer(self.take(n * struct.calcsize(fmt)), np.dtype(fmt)).tolist()
        return [self.value(item) for _ in range(n)]


class GGUFFile:
    """`fields` (metadata key -> value), `tensors` (name -> TensorInfo) and `data(info)`."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            head = f.read(4)
            if head != MAGIC:
                raise ValueError(f"{self.path} is not a GGUF file (starts with {head!r}, not {MAGIC!r})")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(memoryview(self._map), self.path)
        cur.take(4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3; big-endian files "
                             "are not supported)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.fields = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.scalar("<I")
            if n_dims > 4:
                raise ValueError(f"{self.path} is corrupt: tensor {name!r} has {n_dims} dims")
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align < 1 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment={align!r} is not a power of two")
        start = -(-cur.pos // align) * align
        self.tensors = {}
        for name, dims, kind, offset in infos:
            if name in self.tensors:
                raise ValueError(f"{self.path} is corrupt: tensor {name!r} appears twice")
            info = TensorInfo(name, dims, kind, start + offset)
            end = info.offset + self.nbytes(info)
            if end > len(self._map):
                raise ValueError(f"{self.path} is truncated: tensor {name!r} ends at byte {end}, the file has "
                                 f"{len(self._map)}")
            self.tensors[name] = info

    def type_name(self, info: TensorInfo) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(info.ggml_type).name
        except ValueError:
            return f"unknown type {info.ggml_type}"

    def nbytes(self, info: TensorInfo) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {info.name!r} has ggml type {info.ggml_type}, unknown") from None
        n = int(np.prod(info.dims, dtype=np.int64)) if info.dims else 1
        if not info.dims or info.dims[0] % block:
            raise ValueError(f"{self.path}: tensor {info.name!r} ({self.type_name(info)}) has rows of {info.dims[:1]} "
                             f"values, not a multiple of the block size {block}")
        return n // block * size

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as `gguf.quants.dequantize` takes them: [rows, bytes per row] uint8
        (F32 and F16 as float32 / float16 [rows, row])."""
        raw = np.frombuffer(self._map, np.uint8, self.nbytes(info), info.offset)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.dims) > 1 else 1
        kind = self.type_name(info)
        if kind in ("F32", "F16"):
            return raw.view(np.float32 if kind == "F32" else np.float16).reshape(rows, -1)
        return raw.reshape(rows, -1)
