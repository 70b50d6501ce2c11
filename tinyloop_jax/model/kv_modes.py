"""Storage modes of the KV cache as values: a number format (one codec each) and what is stored.

    fp32 / fp16     k, v            [KV, C, hd]       float32 / float16 (KV: key/value heads)
    int8            k, v            [KV, C, hd]       int8, + ks, vs [KV, C, 1] float32 (per token, per head)
    int4            k, v            [KV, C, hd/2]     uint8 (two per byte), + ks, vs [KV, C, 1]
    fp16-h          h               [1, C, D]         float16: the block's normalized input
    int8-h / int4-h h               [1, C, D or D/2], + hs [1, C, D/G] float32 (groups of G channels)

A mode string is parsed once (`kv_mode("int4-h")`) into a `KVMode`: its `Format` (the codec:
`FloatFormat` or `IntFormat`, chosen by type, never by string) and whether it stores h. Every
module asks the value (`mode.h`, `mode.working`, `mode.splits_heads`, `mode.packed_int4`)
instead of taking the string apart.

Every stored array has the slot axis at position 1 (`[lead, C, width]`), so writing and slicing
never depend on the mode. h modes rebuild K/V = h @ W_kv + b_kv from the layer's weights
whenever they are read (RoPE blocks then rotate K at the stored positions). `pack_kv` turns
fresh values into stored arrays, `unpack_kv` stored arrays into float32 K/V; quantization is
per token, so a cache filled in one chunk or token by token holds the same values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from . import quant
H_GROUP = 64
# Storage modes of the KV cache (SPEC §3): K/V as floats or quantized integers, or the
# "-h" forms that store the block's normalized input h and rebuild K/V from it.
KV_MODES = ("fp16", "fp32", "int8", "int4", "fp16-h", "int8-h", "int4-h")


def check_kv_mode(kv_mode: str) -> str:
    if kv_mode in KV_MODES:
        return kv_mode
    raise ValueError(f"unknown kv_mode {kv_mode!r}; valid modes: {', '.join(KV_MODES)}")


# ---- number formats: one codec each ----------------------------------------------------------

@dataclass(frozen=True)
class FloatFormat:
    """Values stored as floats of `dtype`: no scales."""
    name: str
    dtype: object
    packed = False

    def shapes(self, name: str, lead: int, capacity: int, width: int, group: int) -> dict:
        return {name: ((lead, capacity, width), self.dtype)}

    def encode(self, x: jax.Array, group: int) -> dict:
        """x [lead, T, width] float32 -> {suffix: stored array}."""
        return {"": x.astype(self.dtype)}

    def decode(self, stored: dict, name: str, group: int) -> jax.Array:
        return stored[name].astype(jnp.float32)

    def width(self, stored: dict, name: str) -> int:
        return stored[name].shape[-1]


@dataclass(frozen=True)
class IntFormat:
    """Symmetric integers of `bits` (8, or 4 packed two per byte) + one float32 scale per group."""
    name: str
    bits: int

    @property
    def packed(self) -> bool:
        return self.bits == 4

    def shapes(self, name: str, lead: int, capacity: int, width: int, group: int) -> dict:
        stored = ((lead, capacity, width // 2), jnp.uint8) if self.packed else ((lead, capacity, width), jnp.int8)
        return {name: stored, name + "s": ((lead, capacity, width // group), jnp.float32)}

    def encode(self, x: jax.Array, group: int) -> dict:
        q, scale = quant.quantize(x, self.bits, group)
        return {"": quant.pack_int4(q) if self.packed else q, "s": scale}

    def decode(self, stored: dict, name: str, group: int) -> jax.Array:
        q = quant.unpack_int4(stored[name]) if self.packed else stored[name]
        return quant.dequantize(q, stored[name + "s"], group)

    def width(self, stored: dict, name: str) -> int:
        return stored[name].shape[-1] * (2 if self.packed else 1)


FORMATS = {"fp32": FloatFormat("fp32", jnp.float32), "fp16": FloatFormat("fp16", jnp.float16),
           "int8": IntFormat("int8", 8), "int4": IntFormat("int4", 4)}


# ---- a storage mode --------------------------------------------------------------------------

@dataclass(frozen=True)
class KVMode:
    """A parsed `kv_mode`: `format` (the codec) and `h` (store the block's input, not K/V).
    Hashable: it is static pytree metadata of `KVCache` and part of jit cache keys."""
    name: str
    format: FloatFormat | IntFormat
    h: bool

    def __str__(self) -> str:
        return self.name

    @property
    def working(self) -> "KVMode":
        """The mode of a call-scoped segment that extends a prefix of this mode: h modes work
        in float32 K/V (a row's own tokens cannot be stored back as h and re-read cheaply)."""
        return kv_mode("fp32") if self.h else self

    @property
    def splits_heads(self) -> bool:
        """Stored arrays have a KV-head axis a mesh can split (h modes store [1, C, D])."""
        return not self.h

    @property
    def packed_int4(self) -> bool:
        """K/V packed int4: decode attention may read them packed (the int4 kernel)."""
        return not self.h and self.format.packed

    def _layout(self, n_kv_heads: int, head_dim: int, d_model: int) -> tuple[tuple[str, ...], int, int, int]:
        """(stored names, lead, width, group) of one layer."""
        if self.h:
            return ("h",), 1, d_model, h_group(d_model)
        return ("k", "v"), n_kv_heads, head_dim, head_dim

    def layer_shapes(self, n_kv_heads: int, capacity: int, head_dim: int, d_model: int) -> dict:
        """Stored arrays of one cache layer: name -> (shape, dtype)."""
        names, lead, width, group = self._layout(n_kv_heads, head_dim, d_model)
        out = {}
        for n in names:
            out.update(self.format.shapes(n, lead, capacity, width, group))
        return out

    def layer_nbytes(self, n_kv_heads: int, capacity: int, head_dim: int, d_model: int) -> int:
        shapes = self.layer_shapes(n_kv_heads, capacity, head_dim, d_model)
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values())

    def pack(self, h: jax.Array, k: jax.Array, v: jax.Array) -> dict:
        """Fresh h [T, D] and K, V [KV, T, hd] -> the stored arrays of a chunk (h may be None
        where the mode stores K/V)."""
        h, k, v = (None if a is None else a.astype(jnp.float32) for a in (h, k, v))
        if self.h:
            return {"h" + sfx: a for sfx, a in self.format.encode(h[None], h_group(h.shape[-1])).items()}
        out = {}
        for name, x in (("k", k), ("v", v)):
            out.update({name + sfx: a for sfx, a in self.format.encode(x, x.shape[-1]).items()})
        return out

    def unpack(self, stored: dict, kv_from_h):
        """One layer's stored arrays -> float32 K, V [KV, C, hd]. h modes rebuild them from the
        stored h [C, D] with `kv_from_h` (the layer's K/V projection, and RoPE at the slots' positions)."""
        fmt = self.format
        if not self.h:
            hd = fmt.width(stored, "k")
            return fmt.decode(stored, "k", hd), fmt.decode(stored, "v", hd)
        return kv_from_h(fmt.decode(stored, "h", h_group(fmt.width(stored, "h")))[0])


@functools.lru_cache(maxsize=None)
def _parse(name: str) -> KVMode:
    check_kv_mode(name)
    base, h = (name[:-2], True) if name.endswith("-h") else (name, False)
    return KVMode(name, FORMATS[base], h)


def kv_mode(mode: str | KVMode) -> KVMode:
    """'int4-h' -> KVMode(int4, h=True); a KVMode passes through. Unknown names: ValueError."""
    return mode if isinstance(mode, KVMode) else _parse(mode)


def h_group(d_model: int) -> int:
    return H_GROUP if d_model % H_GROUP == 0 else d_model

