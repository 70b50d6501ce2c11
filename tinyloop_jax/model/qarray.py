"""Weights kept quantized: GGUF's Q8_0 / Q4_0 / Q4_1 blocks as one pytree leaf, `QuantArray`,
and the helpers every matmul, embedding lookup and LM head goes through (`matmul`, `head`,
`take`), which dequantize inside the jitted program.

A block is 32 consecutive values along the contraction axis K of one output column:

    q8_0   q [K/32, 32, *out] int8                    value = q * d
    q4_0   q [K/32, 16, *out] uint8, two per byte     value = (nibble - 8) * d
    q4_1   q [K/32, 16, *out] uint8, two per byte     value = nibble * d + m
           d, m [K/32, *out] float16

Byte j of a 4-bit block holds value j in its low nibble and value j + 16 in its high one,
exactly as GGUF stores it, and d / m are GGUF's float16 numbers: a file's tensors are kept
bit for bit, only rearranged so that the output axes are the minor ones. The logical array is
[K, *out] (a projection weight, `x @ W`), or [*out, K] with `transposed` (the embedding and
the head, [V, D]).

How a product is computed: on XLA:CPU with one device, by the native kernel
(`tinyloop_jax.native`, an XLA FFI custom call): a decode step streams each packed byte once,
and a prompt's chunk multiplies by a dequantized float32 panel per 64 columns. The kernel reads
the same bytes in its own order (`tile`: 64 columns at a time, each tile's blocks contiguous, so
a tile is one sequential stream), which a `Model` puts its packed weights in once, at
construction; checkpoints, fingerprints, meshes and everything else see GGUF's order
(`canonical`). Elsewhere (a GPU,
a mesh, or the kernel turned off) XLA dequantizes: a dequantize feeding a dot is a fusion that
writes the float32 matrix, then the dot reads it; in a decode loop XLA hoists that
loop-invariant work out of the loop, so a call holds a float32 copy of each weight while it
runs and decodes at about float32 speed. Forcing the dequantize into every step, in cache-sized
tiles tied to the step's input (`matmul(..., tile=n)`), keeps the float copy away but runs at
XLA:CPU's ~1.3 G weights/s dequantize speed (scripts/bench_quant.py, docs/benchmarks.md).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .. import native

BLOCK = 32
TILE = 64  # columns per tile of the kernel's layout (`tile`)
FORMATS = ("q8_0", "q4_0", "q4_1")
QUANTIZE = {"int8": "q8_0", "int4": "q4_0"}  # quantize_weights= -> the format it writes
_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # GGUF's bytes per block


@struct.dataclass
class QuantArray:
    q: jax.Array  # [K/32, 32 | 16, *out] int8 | uint8
    scale: jax.Array  # [K/32, *out] float16
    min: jax.Array | None  # [K/32, *out] float16 (q4_1)
    fmt: str = struct.field(pytree_node=False)
    transposed: bool = struct.field(pytree_node=False, default=False)
    # the kernel's layout (`tile`): the logical output axes, which q's shape no longer shows
    tiled: tuple | None = struct.field(pytree_node=False, default=None)

    @property
    def out_shape(self) -> tuple:
        return tuple(self.q.shape[2:]) if self.tiled is None else self.tiled

    @property
    def k(self) -> int:
        return self.q.shape[0 if self.tiled is None else 1] * BLOCK

    @property
    def shape(self) -> tuple:
        return (*self.out_shape, self.k) if self.transposed else (self.k, *self.out_shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q, self.scale, self.min) if a is not None)

    @property
    def T(self) -> "QuantArray":  # noqa: N802  (numpy's name)
        return self.replace(transposed=not self.transposed)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The logical float array ([K, *out], or [*out, K] when transposed)."""
        c = canonical(self)
        w = _dequantize(c.q, c.scale, c.min, self.fmt)  # [K, *out]
        w = jnp.moveaxis(w, 0, -1) if self.transposed else w
        return w.astype(dtype)


def is_quant(a) -> bool:
    return isinstance(a, QuantArray)


def tile(w: QuantArray) -> QuantArray:
    """The native kernel's layout of the same bytes: the output axes flattened to N and cut into
    C = ceil(N / 64) tiles of 64 columns, each tile's blocks contiguous (q [C, K/32, R, 64],
    d / m [C, K/32, 64]; the last tile padded with zero columns), so that the kernel reads a
    tile as one sequential stream (tinyloop_jax/native/qmatmul.cc)."""
    if w.tiled is not None:
        return w
    n = int(np.prod(w.out_shape, dtype=np.int64))
    c = -(-n // TILE)
    flat = pad_out(reshape_out(w, n), c * TILE - n)
    return _fields(flat, lambda a: jnp.moveaxis(a.reshape(*a.shape[:-1], c, TILE), -2, 0)).replace(tiled=w.out_shape)


def canonical(w):
    """A packed weight in GGUF's own order (fields [K/32, ..., *out]), from either layout;
    anything else as it is."""
    if not is_quant(w) or w.tiled is None:
        return w
    n = int(np.prod(w.tiled, dtype=np.int64))

    def f(a):  # [C, nb, (R,) 64] -> [nb, (R,) *out]
        a = jnp.moveaxis(a, 0, -2)
        return a.reshape(*a.shape[:-2], -1)[..., :n].reshape(*a.shape[:-2], *w.tiled)
    return _map(w, f).replace(tiled=None)


def tile_params(params):
    """Every packed weight of a params tree in the kernel's layout (`tile`)."""
    return jax.tree.map(lambda a: tile(a) if is_quant(a) else a, params, is_leaf=is_quant)


def _dequantize(q, scale, mn, fmt: str) -> jax.Array:
    """q [nb, 32 | 16, *out], scale / min [nb, *out] -> float32 [nb * 32, *out]."""
    d = scale.astype(jnp.float32)[:, None]
    if fmt == "q8_0":
        v = q.astype(jnp.float32) * d
    else:
        nib = jnp.stack([q & 15, q >> 4], axis=1).astype(jnp.float32)  # [nb, 2, 16, *out]: values j, j + 16
        v = nib.reshape(q.shape[0], BLOCK, *q.shape[2:]) * d
        v = v - 8 * d if fmt == "q4_0" else v + mn.astype(jnp.float32)[:, None]
    return v.reshape(-1, *q.shape[2:])


# ---- building: from GGUF's bytes, or by quantizing floats -----------------------------------

def from_blocks(raw: np.ndarray, fmt: str, k: int, transposed: bool) -> QuantArray:
    """GGUF's bytes of a matrix, raw [rows, K/32 * bytes per block] uint8 (rows = the output
    axis) -> a QuantArray of logical shape [K, rows] (or [rows, K] when transposed)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; valid: {', '.join(FORMATS)}")
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(rows, k // BLOCK, _BYTES[fmt])
    d = b[..., 0:2].copy().view(np.float16)[..., 0]  # [rows, nb]
    mn = b[..., 2:4].copy().view(np.float16)[..., 0] if fmt == "q4_1" else None
    body = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
    q = body.view(np.int8) if fmt == "q8_0" else body  # [rows, nb, 32 | 16]
    out = lambda a: jnp.asarray(np.ascontiguousarray(np.moveaxis(a, 0, -1)))  # noqa: E731  rows last
    return QuantArray(q=out(q), scale=out(d), min=None if mn is None else out(mn), fmt=fmt, transposed=transposed)


def quantize(w, fmt: str, transposed: bool = False) -> QuantArray:
    """A float matrix (logical [K, N], or [N, K] when transposed) quantized the way llama.cpp's
    reference quantizer does (the `gguf` package's `quants.quantize`)."""
    from gguf import GGMLQuantizationType, quants

    a = np.asarray(w, np.float32)
    rows = a if transposed else a.T  # [N, K]: GGUF's rows
    if rows.shape[1] % BLOCK:
        raise ValueError(f"a {fmt} weight needs its input width to be a multiple of {BLOCK}, got {rows.shape[1]}")
    raw = quants.quantize(np.ascontiguousarray(rows), GGMLQuantizationType[fmt.upper()])
    return from_blocks(raw, fmt, rows.shape[1], transposed)


def apply(fn, *ws):
    """fn over the output axes of weights that are all packed alike (fuse q|k|v, stack
    gate|up: fn sees each field with leading block axes, so it must index axes from the end);
    plain arrays (or a mix) go through fn as floats."""
    ws = [canonical(w) for w in ws]
    if all(is_quant(w) and not w.transposed and w.fmt == ws[0].fmt for w in ws):
        field = lambda name: None if getattr(ws[0], name) is None else fn(*(getattr(w, name) for w in ws))  # noqa: E731
        return QuantArray(q=field("q"), scale=field("scale"), min=field("min"), fmt=ws[0].fmt)
    return fn(*(dense(w) for w in ws))


def dense(w, dtype=None):
    """A weight as a float array (packed ones dequantized)."""
    if is_quant(w):
        return w.dequantize(jnp.float32 if dtype is None else dtype)
    return w if dtype is None else w.astype(dtype)


def _fields(w: QuantArray, f) -> QuantArray:
    """f over q, scale and min (those present) in GGUF's order: an operation on the output axes,
    which every field ends with."""
    return _map(canonical(w), f)


def _map(w: QuantArray, f) -> QuantArray:
    """f over q, scale and min (those present), in whichever layout w is."""
    return w.replace(q=f(w.q), scale=f(w.scale), min=None if w.min is None else f(w.min))


def reshape_out(w: QuantArray, *out) -> QuantArray:
    """The output axes reshaped (row-major, so every column keeps its blocks)."""
    return _fields(w, lambda a: a.reshape(*a.shape[:a.ndim - len(w.out_shape)], *out))


def pad_out(w: QuantArray, pad: int) -> QuantArray:
    """`pad` zero output columns (a mesh's vocabulary padding; zero scale: zero weights)."""
    return _fields(w, lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]))


def specs(w: QuantArray, spec, sizes: dict):
    """The PartitionSpecs of a packed weight's fields from its logical spec: the contraction
    axis's entry goes to the block axis, the output axes keep theirs; an axis that the mesh axis
    (`sizes`: name -> devices) does not divide is replicated. (GGUF's order: the kernel's tiled
    layout is for one device.)"""
    from jax.sharding import PartitionSpec as P

    if w.tiled is not None:
        raise ValueError("a weight in the kernel's tiled layout cannot be sharded; place it before tiling")

    s = list(spec) + [None] * (w.ndim - len(spec))
    k, out = (s[-1], s[:-1]) if w.transposed else (s[0], s[1:])

    def fit(a, names):
        return P(*(n if n is None or a.shape[i] % sizes[n] == 0 else None for i, n in enumerate(names)))
    return w.replace(q=fit(w.q, [k, None, *out]), scale=fit(w.scale, [k, *out]),
                     min=None if w.min is None else fit(w.min, [k, *out]))


# ---- use: inside jitted programs ------------------------------------------------------------

def _after(x: jax.Array, a: jax.Array) -> jax.Array:
    """a, scheduled after x exists (an optimization barrier over both): XLA may not hoist a
    tile's dequantization away from its dot."""
    return jax.lax.optimization_barrier((x, a))[1]


def _columns(w: QuantArray, x: jax.Array, tile: int | None):
    """Yield float32 [K, t] dequantized column tiles over the flattened output axes: the whole
    matrix (tile None), or about `tile` floats at a time, each tied to x."""
    n = int(np.prod(w.out_shape, dtype=np.int64))
    flat = reshape_out(w, n)
    if tile is None:
        yield _dequantize(flat.q, flat.scale, flat.min, w.fmt)
        return
    t = max([c for c in range(1, n + 1) if n % c == 0 and c * w.k <= tile] + [min(n, 8)])
    for c in range(0, n, t):
        part = _fields(flat, lambda a: a[..., c:c + t])  # noqa: B023  (used at once)
        yield _dequantize(part.q, _after(x, part.scale), part.min, w.fmt)


def _product(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array, fmt: str) -> jax.Array:
    """x [..., K] @ the packed fields of a [K, N] weight, through XLA (dequantize, then dot)."""
    return jnp.einsum("...k,kn->...n", x, _dequantize(q, d, m, fmt).astype(x.dtype))


def _tiled_product(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array, fmt: str, n: int) -> jax.Array:
    """`_product` of a weight in the kernel's layout (flattened to n columns)."""
    w = canonical(QuantArray(q=q, scale=d, min=m, fmt=fmt, tiled=(n,)))
    return _product(x, w.q, w.scale, w.min, fmt)


def _kernel(x: jax.Array, w: QuantArray) -> jax.Array:
    """x [..., K] @ w [K, *out] -> float32 [..., N] (N: the output axes flattened) by the native
    kernel, which reads the packed bytes once (`tinyloop_jax.native`; callers check
    `native.available()`). A weight in GGUF's order is tiled here, inside the program: models
    hold theirs tiled already (`tile_params`)."""
    t, n = tile(w), int(np.prod(w.out_shape, dtype=np.int64))
    return native.qmatmul(x, t.q, t.scale, t.min, w.fmt, n, partial(_tiled_product, fmt=w.fmt, n=n))


def matmul(x: jax.Array, w, tile: int | None = None) -> jax.Array:
    """x [..., K] @ w [K, *out] -> [..., *out] in x's dtype (float weights: one tensordot).
    Packed weights go through the native kernel where it runs (XLA:CPU, one device), else
    XLA dequantizes them; `tile`: that, about that many floats at a time inside the step (see
    the module doc)."""
    if not is_quant(w):
        return jnp.tensordot(x, w, axes=1)
    if tile is None and native.available():
        return _kernel(x, w).astype(x.dtype).reshape(*x.shape[:-1], *w.out_shape)
    parts = [jnp.einsum("...k,kn->...n", x, t.astype(x.dtype)) for t in _columns(w, x, tile)]
    y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return y.reshape(*x.shape[:-1], *w.out_shape)


def head(x: jax.Array, w) -> jax.Array:
    """x [..., D] against w [V, D] (the embedding or the head) -> float32 [..., V]."""
    if not is_quant(w):
        return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)
    if native.available():  # w's blocks run along D: the kernel's [K, N] weight with N = V
        return _kernel(x, w)
    (t,) = _columns(w, x, None)
    return jnp.einsum("...d,dv->...v", x, t.astype(x.dtype), preferred_element_type=jnp.float32)


def take(w, rows: jax.Array) -> jax.Array:
    """Rows of w [V, D] (an embedding lookup) -> [T, D] float32 for packed, as stored otherwise."""
    if not is_quant(w):
        return w[rows]
    if w.tiled is not None:  # row r is column r % 64 of tile r // 64
        c, lane = rows // TILE, rows % TILE
        pick = lambda a: jnp.moveaxis(a[c, ..., lane], 0, -1)  # noqa: E731  [T, nb, (R)] -> [nb, (R,) T]
        q, d = pick(w.q), pick(w.scale)
        return _dequantize(q, d, None if w.min is None else pick(w.min), w.fmt).T
    part = _fields(w, lambda a: a[..., rows])
    return _dequantize(part.q, part.scale, part.min, w.fmt).T
