"""Storage modes of the KV cache: what one cache layer stores per token, and the codecs.

    fp32 / fp16     k, v            [KV, C, hd]       float32 / float16 (KV: key/value heads)
    int8            k, v            [KV, C, hd]       int8, + ks, vs [KV, C, 1] float32 (per token, per head)
    int4            k, v            [KV, C, hd/2]     uint8 (two per byte), + ks, vs [KV, C, 1]
    fp16-h          h               [1, C, D]         float16: the block's normalized input
    int8-h / int4-h h               [1, C, D or D/2], + hs [1, C, D/G] float32 (groups of G channels)

Every stored array has the slot axis at position 1 (`[lead, C, width]`), so writing and slicing
never depend on the mode. h modes rebuild K/V = h @ W_kv + b_kv from the layer's weights
whenever they are read (RoPE blocks then rotate K at the stored positions). `pack_kv` turns
fresh values into stored arrays, `unpack_kv` stored arrays into float32 K/V; quantization is
per token, so a cache filled in one chunk or token by token holds the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import quant
from .config import check_kv_mode

H_GROUP = 64
_FLOAT = {"fp32": jnp.float32, "fp16": jnp.float16}
_BITS = {"int8": 8, "int4": 4}


def split_mode(kv_mode: str) -> tuple[str, bool]:
    """'int4-h' -> ('int4', True)."""
    check_kv_mode(kv_mode)
    return (kv_mode[:-2], True) if kv_mode.endswith("-h") else (kv_mode, False)


def h_group(d_model: int) -> int:
    return H_GROUP if d_model % H_GROUP == 0 else d_model


def layer_shapes(kv_mode: str, n_kv_heads: int, capacity: int, head_dim: int, d_model: int) -> dict:
    """Stored arrays of one cache layer: name -> (shape, dtype)."""
    base, is_h = split_mode(kv_mode)
    lead, width = (1, d_model) if is_h else (n_kv_heads, head_dim)
    out = {}
    for n in ("h",) if is_h else ("k", "v"):
        if base in _FLOAT:
            out[n] = ((lead, capacity, width), _FLOAT[base])
        else:
            groups = width // h_group(width) if is_h else 1
            packed = base == "int4"
            out[n] = ((lead, capacity, width // 2 if packed else width), jnp.uint8 if packed else jnp.int8)
            out[n + "s"] = ((lead, capacity, groups), jnp.float32)
    return out


def layer_nbytes(kv_mode: str, n_kv_heads: int, capacity: int, head_dim: int, d_model: int) -> int:
    shapes = layer_shapes(kv_mode, n_kv_heads, capacity, head_dim, d_model)
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values())


def _store(base: str, x: jax.Array, group: int) -> dict:
    """x [lead, T, width] float32 -> stored arrays (value, and scale for integer modes)."""
    if base in _FLOAT:
        return {"": x.astype(_FLOAT[base])}
    q, scale = quant.quantize(x, _BITS[base], group)
    return {"": quant.pack_int4(q) if base == "int4" else q, "s": scale}


def _load(base: str, stored: dict, name: str, group: int) -> jax.Array:
    if base in _FLOAT:
        return stored[name].astype(jnp.float32)
    q = quant.unpack_int4(stored[name]) if base == "int4" else stored[name]
    return quant.dequantize(q, stored[name + "s"], group)


def pack_kv(kv_mode: str, h: jax.Array, k: jax.Array, v: jax.Array) -> dict:
    """Fresh h [T, D] and K, V [KV, T, hd] -> the stored arrays of a chunk."""
    h, k, v = (a.astype(jnp.float32) for a in (h, k, v))
    base, is_h = split_mode(kv_mode)
    if is_h:
        return {"h" + sfx: a for sfx, a in _store(base, h[None], h_group(h.shape[-1])).items()}
    out = {}
    for name, x in (("k", k), ("v", v)):
        out.update({name + sfx: a for sfx, a in _store(base, x, x.shape[-1]).items()})
    return out


def unpack_kv(kv_mode: str, stored: dict, kv_from_h):
    """One layer's stored arrays -> float32 K, V [KV, C, hd]. h modes rebuild them from the
    stored h [C, D] with `kv_from_h` (the layer's K/V projection, and RoPE at the slots' positions)."""
    base, is_h = split_mode(kv_mode)
    if not is_h:
        hd = stored["k"].shape[-1] * (2 if base == "int4" else 1)
        return _load(base, stored, "k", hd), _load(base, stored, "v", hd)
    width = stored["h"].shape[-1] * (2 if base == "int4" else 1)
    return kv_from_h(_load(base, stored, "h", h_group(width))[0])
