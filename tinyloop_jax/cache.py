"""The KV cache: an immutable pytree of fixed-capacity buffers, and its storage modes.

One `KVCache` is one *segment* of a sequence's attention context. A plain generation has one
segment; a request served from a prefix reads the prefix's segment (never written) and
writes only its own:

    prefix segment (read-only, shared)        own segment (per request, written)
    ┌─────────────────────────────┐           ┌──────────────────────┐
    │ pos 0 .. P-1                │           │ pos P .. P+n-1       │
    └─────────────────────────────┘           └──────────────────────┘
    layers[l] = {"k": [H, C, hd], "v": [H, C, hd]}    (fp modes; other modes store other keys)
    pos       = [C] int32: absolute position held by each slot, -1 = empty
    length    = []  int32: one past the last position written

Slot of position p is `p % C`. A contiguous run of at most C positions never collides, so
the same rule serves a full cache (C >= tokens) and a sliding-window ring buffer (C >= W:
old positions are overwritten, and attention masks by position anyway).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import quant
from .config import check_kv_mode


@struct.dataclass
class KVCache:
    layers: tuple  # tuple[dict[str, Array], ...], one per cache layer
    pos: jax.Array  # [C] int32
    length: jax.Array  # [] int32
    kv_mode: str = struct.field(pytree_node=False)

    @property
    def capacity(self) -> int:
        return int(self.pos.shape[-1])

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self)))


# ---- storage modes ---------------------------------------------------------------------------
# What one cache layer stores per token, by mode. Every stored array has the slot axis at
# position 1, so writing and slicing never depend on the mode.
#
#   fp32 / fp16     k, v            [H, C, hd]        float32 / float16
#   int8            k, v            [H, C, hd]        int8, + ks, vs [H, C, 1] float32 (per token, per head)
#   int4            k, v            [H, C, hd/2]      uint8 (two per byte), + ks, vs [H, C, 1]
#   fp16-h          h               [1, C, D]         float16: the block's normalized input
#   int8-h / int4-h h               [1, C, D or D/2], + hs [1, C, D/G] float32 (groups of G channels)
#
# h modes rebuild K/V = h @ W_kv + b_kv from the layer's weights whenever they are read.

H_GROUP = 64
_FLOAT = {"fp32": jnp.float32, "fp16": jnp.float16}
_BITS = {"int8": 8, "int4": 4}


def _split(kv_mode: str) -> tuple[str, bool]:
    """'int4-h' -> ('int4', True)."""
    check_kv_mode(kv_mode)
    return (kv_mode[:-2], True) if kv_mode.endswith("-h") else (kv_mode, False)


def h_group(d_model: int) -> int:
    return H_GROUP if d_model % H_GROUP == 0 else d_model


def layer_shapes(kv_mode: str, n_heads: int, capacity: int, head_dim: int) -> dict:
    """Stored arrays of one cache layer: name -> (shape, dtype)."""
    base, is_h = _split(kv_mode)
    lead, width = (1, n_heads * head_dim) if is_h else (n_heads, head_dim)
    names = ("h",) if is_h else ("k", "v")
    out = {}
    for n in names:
        if base in _FLOAT:
            out[n] = ((lead, capacity, width), _FLOAT[base])
        else:
            groups = width // h_group(width) if is_h else 1
            packed = base == "int4"
            out[n] = ((lead, capacity, width // 2 if packed else width), jnp.uint8 if packed else jnp.int8)
            out[n + "s"] = ((lead, capacity, groups), jnp.float32)
    return out


def _store(base: str, x: jax.Array, group: int) -> dict:
    """x [lead, T, width] float32 -> stored arrays (value, and scale for integer modes)."""
    if base in _FLOAT:
        return {"": x.astype(_FLOAT[base])}
    q, scale = quant.quantize(x, _BITS[base], group)
    return {"": quant.pack_int4(q) if base == "int4" else q, "s": scale}


def _load(base: str, entry: dict, name: str, group: int) -> jax.Array:
    if base in _FLOAT:
        return entry[name].astype(jnp.float32)
    q = quant.unpack_int4(entry[name]) if base == "int4" else entry[name]
    return quant.dequantize(q, entry[name + "s"], group)


def encode(kv_mode: str, h: jax.Array, k: jax.Array, v: jax.Array) -> dict:
    """Fresh h [T, D] and K, V [H, T, hd] float32 -> the stored arrays of a chunk."""
    base, is_h = _split(kv_mode)
    if is_h:
        return {"h" + sfx: a for sfx, a in _store(base, h[None], h_group(h.shape[-1])).items()}
    out = {}
    for name, x in (("k", k), ("v", v)):
        out.update({name + sfx: a for sfx, a in _store(base, x, x.shape[-1]).items()})
    return out


def decode(kv_mode: str, entry: dict, w_kv: jax.Array, b_kv: jax.Array, n_heads: int) -> tuple[jax.Array, jax.Array]:
    """Stored arrays -> float32 K, V [H, C, hd]. h modes rebuild them with the layer's K/V
    projection (w_kv [D, 2D], b_kv [2D])."""
    base, is_h = _split(kv_mode)
    if not is_h:
        hd = entry["k"].shape[-1] * (2 if base == "int4" else 1)
        return _load(base, entry, "k", hd), _load(base, entry, "v", hd)
    h = _load(base, entry, "h", h_group(w_kv.shape[0]))[0]  # [C, D]
    C, D = h.shape
    kv = (h @ w_kv + b_kv).reshape(C, 2, n_heads, D // n_heads).transpose(1, 2, 0, 3)
    return kv[0], kv[1]


# ---- allocation ------------------------------------------------------------------------------

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Capacity/length bucket for n: powers of two up to 128, then multiples of 128. Few
    distinct shapes (few compiles) while padding wastes at most 127 tokens on long prompts."""
    n = max(int(n), 1)
    if n > 128:
        return -(-n // 128) * 128
    return max(minimum, 1 << (n - 1).bit_length())


def segment_capacity(n_tokens: int, cache_window: int) -> int:
    """Slots needed to hold `n_tokens` positions, or only the last `cache_window` of them."""
    need = n_tokens if cache_window <= 0 else min(n_tokens, cache_window)
    return bucket(max(need, 1))


def cache_nbytes(kv_mode: str, n_layers: int, n_heads: int, capacity: int, head_dim: int) -> int:
    per_layer = sum(int(np.prod(s)) * np.dtype(d).itemsize
                    for s, d in layer_shapes(kv_mode, n_heads, capacity, head_dim).values())
    return n_layers * per_layer + capacity * 4 + 4


def _free_bytes() -> int | None:
    """Memory the backend can still hand out, if it says; else host memory available."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def empty(kv_mode: str, n_layers: int, n_heads: int, capacity: int, head_dim: int,
          batch: int | None = None) -> KVCache:
    """A fresh cache (with `batch`: one per request, every array with a leading request axis).
    Out of memory is a RuntimeError, checked before allocating so that nothing is half-built
    (and the host is not pushed into swap)."""
    lead = () if batch is None else (batch,)
    need = cache_nbytes(kv_mode, n_layers, n_heads, capacity, head_dim) * (batch or 1)
    free = _free_bytes()
    if free is not None and need > free:
        raise RuntimeError(
            f"out of memory: a KV cache of {n_layers} layers x {capacity} slots ({kv_mode}) needs "
            f"{need / 2**20:.1f} MiB but only {free / 2**20:.1f} MiB is free; "
            "shorten the prompt, lower loops, or set cache_window")
    shapes = layer_shapes(kv_mode, n_heads, capacity, head_dim)
    try:
        layers = tuple({name: jnp.zeros(lead + s, d) for name, (s, d) in shapes.items()} for _ in range(n_layers))
        return KVCache(layers=layers, pos=jnp.full(lead + (capacity,), -1, jnp.int32),
                       length=jnp.zeros(lead, jnp.int32), kv_mode=kv_mode)
    except Exception as e:  # noqa: BLE001 - XLA reports OOM as a generic runtime error
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            raise RuntimeError(f"out of memory while allocating a KV cache: {e}") from e
        raise


# ---- writing ---------------------------------------------------------------------------------

def write_slots(positions: jax.Array, n_valid: jax.Array, capacity: int) -> jax.Array:
    """Slots for a chunk of positions [T]; tokens that must not be stored point past the end
    (dropped): padding (index >= n_valid) and all but the last `capacity` valid tokens."""
    idx = jnp.arange(positions.shape[0])
    keep = (idx < n_valid) & (idx >= n_valid - capacity)
    return jnp.where(keep, positions % capacity, capacity)


def write_layer(entry: dict, fresh: dict, slots: jax.Array) -> dict:
    """Scatter a chunk's stored arrays ([H, T, ...]) into a layer's buffers at `slots` [T]."""
    if slots.shape[0] == 1:  # decode: one in-place dynamic-update-slice per buffer
        return {n: jax.lax.dynamic_update_slice_in_dim(entry[n], fresh[n], slots[0], axis=1)
                for n in entry}
    return {n: entry[n].at[:, slots].set(fresh[n], mode="drop") for n in entry}


def write_positions(cache_pos: jax.Array, positions: jax.Array, slots: jax.Array) -> jax.Array:
    if slots.shape[0] == 1:
        return jax.lax.dynamic_update_slice_in_dim(cache_pos, positions, slots[0], axis=0)
    return cache_pos.at[slots].set(positions, mode="drop")


def copy_prefix(src: KVCache, k: jax.Array, capacity: int) -> KVCache:
    """A new segment of `capacity` slots holding src's positions in [k - capacity, k) (those
    src still holds), length k: the first k tokens of a cached prompt, ready to be extended.
    Stored values are copied as they are (no re-quantization), so the result is exact."""
    s = jnp.arange(capacity)
    p = s + capacity * ((k - 1 - s) // capacity)  # the last position < k that lands in slot s
    src_slot = p % src.capacity
    ok = (p >= 0) & (src.pos[src_slot] == p)
    layers = tuple({n: jnp.where(ok[None, :, None], jnp.take(a, src_slot, axis=1), jnp.zeros((), a.dtype))
                    for n, a in entry.items()} for entry in src.layers)
    return KVCache(layers=layers, pos=jnp.where(ok, p, -1).astype(jnp.int32), length=jnp.asarray(k, jnp.int32),
                   kv_mode=src.kv_mode)
