"""Storage modes of the KV cache: what one cache layer stores per token, and the codecs.

    fp32 / fp16     k, v            [H, C, hd]        float32 / float16
    int8            k, v            [H, C, hd]        int8, + ks, vs [H, C, 1] float32 (per token, per head)
    int4            k, v            [H, C, hd/2]      uint8 (two per byte), + ks, vs [H, C, 1]
    fp16-h          h               [1, C, D]         float16: the block's normalized input
    int8-h / int4-h h               [1, C, D or D/2], + hs [1, C, D/G] float32 (groups of G channels)

Every stored array has the slot axis at position 1 (`[lead, C, width]`), so writing and slicing
never depend on the mode. h modes rebuild K/V = h @ W_kv + b_kv from the layer's weights
whenever they are read. `pack_kv` turns fresh values into stored arrays, `unpack_kv` stored
arrays into float32 K/V; quantization is per token, so a cache filled in one chunk or token by
token holds the same values.
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


def layer_shapes(kv_mode: str, n_heads: int, capacity: int, head_dim: int) -> dict:
    """Stored arrays of one cache layer: name -> (shape, dtype)."""
    base, is_h = split_mode(kv_mode)
    lead, width = (1, n_heads * head_dim) if is_h else (n_heads, head_dim)
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


def layer_nbytes(kv_mode: str, n_heads: int, capacity: int, head_dim: int) -> int:
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in layer_shapes(kv_mode, n_heads, capacity,
                                                                                head_dim).values())


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
    """Fresh h [T, D] and K, V [H, T, hd] float32 -> the stored arrays of a chunk."""
    base, is_h = split_mode(kv_mode)
    if is_h:
        return {"h" + sfx: a for sfx, a in _store(base, h[None], h_group(h.shape[-1])).items()}
    out = {}
    for name, x in (("k", k), ("v", v)):
        out.update({name + sfx: a for sfx, a in _store(base, x, x.shape[-1]).items()})
    return out


def unpack_kv(kv_mode: str, stored: dict, w_kv: jax.Array, b_kv: jax.Array, n_heads: int):
    """One layer's stored arrays -> float32 K, V [H, C, hd]. h modes rebuild them with the
    layer's K/V projection (w_kv [D, 2D], b_kv [2D])."""
    base, is_h = split_mode(kv_mode)
    if not is_h:
        hd = stored["k"].shape[-1] * (2 if base == "int4" else 1)
        return _load(base, stored, "k", hd), _load(base, stored, "v", hd)
    h = _load(base, stored, "h", h_group(w_kv.shape[0]))[0]  # [C, D]
    C, D = h.shape
    kv = (h @ w_kv + b_kv).reshape(C, 2, n_heads, D // n_heads).transpose(1, 2, 0, 3)
    return kv[0], kv[1]
