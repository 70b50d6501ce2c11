"""Weights kept quantized: GGUF's blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q4_K,
Q5_K, Q6_K) as one pytree leaf, `QuantArray`, and the helpers every matmul, embedding lookup
and LM head goes through (`matmul`, `head`, `take`), which dequantize inside the jitted program.

A block is S consecutive values along the contraction axis K of one output column (S = 32, or
256 for a K-quant's super-block), stored as GGUF stores it: its float16 scale d (and min m)
split out, every other byte of the block, in order, in q:

    fmt    S    q [K/S, R, *out]                       value
    q8_0   32   R = 32: int8                            q * d
    q4_0   32   R = 16: nibbles                         (nibble - 8) * d
    q4_1   32   R = 16: nibbles                         nibble * d + m
    q5_0   32   R = 20: qh[4] (the 5th bits), qs[16]    (q5 - 16) * d
    q5_1   32   R = 20: qh[4], qs[16]                   q5 * d + m
    q4_k   256  R = 140: scales[12], qs[128]            d * sc_j * q4 - m * mn_j  (8 sub-blocks j of 32)
    q5_k   256  R = 172: scales[12], qh[32], qs[128]    d * sc_j * q5 - m * mn_j
    q6_k   256  R = 208: ql[128], qh[64], scales[16]    d * sc_j * (q6 - 32)      (16 sub-blocks, int8 sc)
           d, m [K/S, *out] float16 (m: q4_1, q5_1 and the dmin of q4_k / q5_k)

Byte j of a Q4_0 / Q4_1 / Q5_x block holds value j in its low nibble and value j + 16 in its
high one; a K-quant's nibbles, 6-bit sub-block scales and high bits are as ggml packs them
(`_dequantize`, tested block by block against ggml's C in tests/test_gguf.py): a file's tensors
are kept bit for bit, only rearranged so that the output axes are the minor ones. The logical array is
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

BLOCK = 32  # values per block of the 32-value formats
TILE = 64  # columns per tile of the kernel's layout (`tile`)
# fmt -> (values per block, GGUF's bytes per block, byte offset of d, of m (None: no m))
SPECS = {"q8_0": (32, 34, 0, None), "q4_0": (32, 18, 0, None), "q4_1": (32, 20, 0, 2),
         "q5_0": (32, 22, 0, None), "q5_1": (32, 24, 0, 2),
         "q4_k": (256, 144, 0, 2), "q5_k": (256, 176, 0, 2), "q6_k": (256, 210, 208, None)}
FORMATS = tuple(SPECS)
QUANTIZE = {"int8": "q8_0", "int4": "q4_0"}  # quantize_weights= -> the format it writes
ACTIVATIONS = native.ACTIVATIONS  # what packed weights multiply: "float32" inputs, or "int8"-rounded ones


def block_values(fmt: str) -> int:
    """Values per block of `fmt` along the contraction axis (32, or 256 for a K-quant)."""
    return SPECS[fmt][0]


def has_min(fmt: str) -> bool:
    return SPECS[fmt][3] is not None


@struct.dataclass
class QuantArray:
    q: jax.Array  # [K/S, R, *out] int8 (q8_0) | uint8 (see the module doc)
    scale: jax.Array  # [K/S, *out] float16
    min: jax.Array | None  # [K/S, *out] float16 (`has_min` formats)
    fmt: str = struct.field(pytree_node=False)
    transposed: bool = struct.field(pytree_node=False, default=False)
    # the kernel's layout (`tile`): the logical output axes, which q's shape no longer shows
    tiled: tuple | None = struct.field(pytree_node=False, default=None)
    # what a product multiplies it by (`ACTIVATIONS`): the inputs as given, or rounded to 8 bits
    # per 32 (`round_activations`; llama.cpp's arithmetic), a load-time choice (`with_activations`)
    act: str = struct.field(pytree_node=False, default="float32")
    # one layer of a stack (`stack.Stacked`): q, scale and min then hold every layer's fields
    # ([L, ...]) and this int32 [] picks one; the native kernel reads it in place, the rest
    # slices it out (`own`). None: the fields are this weight's.
    layer: jax.Array | None = None

    @property
    def _lead(self) -> int:
        return 0 if self.layer is None else 1

    @property
    def out_shape(self) -> tuple:
        return tuple(self.q.shape[2 + self._lead:]) if self.tiled is None else self.tiled

    @property
    def k(self) -> int:
        return self.q.shape[(0 if self.tiled is None else 1) + self._lead] * block_values(self.fmt)

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

    def own(self) -> "QuantArray":
        """This weight with fields of its own: a stack's layer (`layer`) sliced out (a copy)."""
        if self.layer is None:
            return self
        pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(  # noqa: E731
            a, jnp.asarray(self.layer, jnp.int32), 0, keepdims=False)
        return self.replace(q=pick(self.q), scale=pick(self.scale), min=pick(self.min), layer=None)

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
    C = ceil(N / 64) tiles of 64 columns, each tile's blocks contiguous (q [C, K/S, R, 64],
    d / m [C, K/S, 64]; the last tile padded with zero columns), so that the kernel reads a
    tile as one sequential stream (tinyloop_jax/native/qmatmul.cc)."""
    if w.tiled is not None:
        return w
    w = w.own()
    n = int(np.prod(w.out_shape, dtype=np.int64))
    c = -(-n // TILE)
    flat = pad_out(reshape_out(w, n), c * TILE - n)
    return _fields(flat, lambda a: jnp.moveaxis(a.reshape(*a.shape[:-1], c, TILE), -2, 0)).replace(tiled=w.out_shape)


def canonical(w):
    """A packed weight in GGUF's own order (fields [K/32, ..., *out]), from either layout;
    anything else as it is."""
    if not is_quant(w):
        return w
    w = w.own()
    if w.tiled is None:
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
    """q [nb, R, *out], scale / min [nb, *out] -> float32 [nb * S, *out] (S: `block_values`)."""
    d = scale.astype(jnp.float32)[:, None]
    out = q.shape[2:]
    if fmt == "q8_0":
        return (q.astype(jnp.float32) * d).reshape(-1, *out)
    if fmt in ("q4_0", "q4_1"):
        v = _nibbles(q).astype(jnp.float32)
        v = v * d - 8 * d if fmt == "q4_0" else v * d + mn.astype(jnp.float32)[:, None]
        return v.reshape(-1, *out)
    if fmt in ("q5_0", "q5_1"):  # value j's 5th bit: bit j of qh (a little-endian uint32)
        v = (_nibbles(q[:, 4:]) | (_bits(q[:, :4], 8) << 4)).astype(jnp.float32)  # [nb, 32, *out]
        v = v * d - 16 * d if fmt == "q5_0" else v * d + mn.astype(jnp.float32)[:, None]
        return v.reshape(-1, *out)
    nb = q.shape[0]
    if fmt in ("q4_k", "q5_k"):
        sc, mins = _scales_k4(q[:, :12].astype(jnp.int32))  # [nb, 8, *out] each
        qs = q[:, -128:].reshape(nb, 4, 1, 32, *out)  # 4 runs of 32 bytes: sub-blocks 2i (low), 2i + 1 (high)
        v = jnp.concatenate([qs & 15, qs >> 4], axis=2)  # [nb, 4, 2, 32, *out]
        if fmt == "q5_k":  # bit 2i (low) / 2i + 1 (high) of qh byte l: value l of those sub-blocks
            shift = jnp.arange(8, dtype=jnp.uint8).reshape(1, 4, 2, 1, *([1] * len(out)))
            v = v | (((q[:, 12:44].reshape(nb, 1, 1, 32, *out) >> shift) & 1) << 4)
        v = v.reshape(nb, 8, 32, *out).astype(jnp.float32)
        dm = (mn.astype(jnp.float32)[:, None] * mins.astype(jnp.float32))[:, :, None]
        return (d[:, :, None] * sc.astype(jnp.float32)[:, :, None] * v - dm).reshape(-1, *out)
    if fmt == "q6_k":  # per half h of 128 values: ql[64 h:], qh[32 h:]; value 128 h + 32 k + l
        ql = q[:, :128].reshape(nb, 2, 1, 2, 32, *out)  # [nb, h, ., a, l]: byte ql[64 h + 32 a + l]
        low = jnp.concatenate([ql & 15, ql >> 4], axis=2).reshape(nb, 2, 4, 32, *out)  # k = 2 nibble + a
        shift = (2 * jnp.arange(4, dtype=jnp.uint8)).reshape(1, 1, 4, 1, *([1] * len(out)))
        high = (q[:, 128:192].reshape(nb, 2, 1, 32, *out) >> shift) & 3
        v = (low | (high << 4)).astype(jnp.float32) - 32  # [nb, 2, 4, 32, *out]
        sc = jax.lax.bitcast_convert_type(q[:, 192:208], jnp.int8).astype(jnp.float32)  # [nb, 16, *out]
        v = v.reshape(nb, 16, 16, *out) * sc[:, :, None]  # sub-block (value // 16)
        return (v * d[:, :, None]).reshape(-1, *out)
    raise ValueError(f"unknown quantized format {fmt!r}; valid: {', '.join(FORMATS)}")


def _nibbles(q):
    """[nb, 16, *out] bytes -> [nb, 32, *out]: the low nibbles (values 0-15), then the high ones."""
    return jnp.concatenate([q & 15, q >> 4], axis=1)


def _bits(b, per: int):
    """[nb, n, *out] bytes -> [nb, n * per, *out]: bit i of byte j at index per * j + i."""
    shift = jnp.arange(per, dtype=b.dtype).reshape(1, 1, per, *([1] * (b.ndim - 2)))
    return ((b[:, :, None] >> shift) & 1).reshape(b.shape[0], -1, *b.shape[2:])


def _scales_k4(s):
    """ggml's get_scale_min_k4 over every sub-block: scales[12] [nb, 12, *out] int32 -> the 6-bit
    scales and mins [nb, 8, *out] (sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7; 4-7 from
    the nibbles of bytes 8-11 and the top 2 bits of bytes 0-3 / 4-7)."""
    sc = jnp.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mins = jnp.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mins


@struct.dataclass
class Fused:
    """A fused projection (q | k | v, gate | up) whose parts are packed in different formats, as
    a Q4_K_M file stores them (k in one type, v in another): each part kept as it is, and the
    fused weight's column j is column `order[j]` of the parts' columns side by side."""
    parts: tuple  # QuantArray (or float) [K, n_i] each
    order: tuple = struct.field(pytree_node=False)  # a permutation of the sum of n_i
    out: tuple = struct.field(pytree_node=False)  # the fused output axes

    @property
    def shape(self) -> tuple:
        return (self.parts[0].shape[0], *self.out)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def combine(self, ys: list) -> jax.Array:
        """The parts' products ys[i] [..., n_i] -> the fused product [..., *out]."""
        y = jnp.concatenate(ys, axis=-1)
        return jnp.take(y, jnp.asarray(self.order, jnp.int32), axis=-1).reshape(*y.shape[:-1], *self.out)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.combine([dense(p, dtype) for p in self.parts])


def is_fused(a) -> bool:
    return isinstance(a, Fused)


def apply(fn, *ws):
    """fn over the output axes of weights [K, n_i] (fuse q|k|v, stack gate|up: fn sees each field
    with leading block axes, so it must index axes from the end). Packed alike: one packed
    weight; packed in different formats: a `Fused` of the parts; plain arrays (or a mix of
    packed and float): fn over floats."""
    ws = [canonical(w) for w in ws]
    if all(is_quant(w) and not w.transposed and w.fmt == ws[0].fmt for w in ws):
        field = lambda name: None if getattr(ws[0], name) is None else fn(*(getattr(w, name) for w in ws))  # noqa: E731
        return QuantArray(q=field("q"), scale=field("scale"), min=field("min"), fmt=ws[0].fmt, act=ws[0].act)
    if all(is_quant(w) and not w.transposed and len(w.out_shape) == 1 for w in ws):
        at = np.cumsum([0] + [w.out_shape[0] for w in ws])  # fn over column numbers: where each goes
        cols = np.asarray(fn(*(np.arange(at[i], at[i + 1]) for i in range(len(ws)))))
        return Fused(parts=tuple(ws), order=tuple(int(c) for c in cols.reshape(-1)), out=cols.shape)
    return fn(*(dense(w) for w in ws))


def dense(w, dtype=None):
    """A weight as a float array (packed ones dequantized)."""
    if is_quant(w) or is_fused(w):
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


def check_activations(act: str) -> str:
    if act not in ACTIVATIONS:
        raise ValueError(f"activations={act!r}; valid: {', '.join(map(repr, ACTIVATIONS))}")
    return act


def with_activations(params, act: str):
    """params with every packed weight's products over `act` inputs ("float32" or "int8", see
    `round_activations`); float weights are unchanged."""
    check_activations(act)
    return jax.tree.map(lambda a: a.replace(act=act) if is_quant(a) else a, params, is_leaf=is_quant)


def round_activations(x: jax.Array) -> jax.Array:
    """x [..., K] (K a multiple of 32) rounded to 8 bits per 32 consecutive inputs, as floats:
    q = rint(x / d) with d = max|x| / 127 over the 32 (ties to even; an all-zero block stays zero),
    then q * d. The native kernel multiplies q itself as integers (qmatmul.cc, `round_inputs`)."""
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, BLOCK)
    d = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / np.float32(127)
    inv = jnp.where(d > 0, 1 / jnp.where(d > 0, d, 1), 0)
    return (jnp.round(xb * inv) * d).reshape(x.shape).astype(x.dtype)


def _inputs(x: jax.Array, act: str) -> jax.Array:
    return round_activations(x) if act == "int8" else x


def _product(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array, fmt: str) -> jax.Array:
    """x [..., K] @ the packed fields of a [K, N] weight, through XLA (dequantize, then dot)."""
    return jnp.einsum("...k,kn->...n", x, _dequantize(q, d, m, fmt).astype(x.dtype))


def _tiled_product(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array, layer: jax.Array, fmt: str, n: int,
                   act: str = "float32") -> jax.Array:
    """`_product` of a weight in the kernel's layout (flattened to n columns; q, d, m a stack
    of them when their rank says so, `layer` picking one)."""
    stacked = q.ndim == 5
    w = canonical(QuantArray(q=q, scale=d, min=m, fmt=fmt, tiled=(n,), layer=layer if stacked else None))
    return _product(_inputs(x, act), w.q, w.scale, w.min, fmt)


def _kernel(x: jax.Array, w: QuantArray) -> jax.Array:
    """x [..., K] @ w [K, *out] -> float32 [..., N] (N: the output axes flattened) by the native
    kernel, which reads the packed bytes once (`tinyloop_jax.native`; callers check
    `native.available()`). A weight in GGUF's order is tiled here, inside the program: models
    hold theirs tiled already (`tile_params`)."""
    t, n = tile(w), int(np.prod(w.out_shape, dtype=np.int64))  # (a stack's layer is tiled: its models')
    return native.qmatmul(x, t.q, t.scale, t.min, w.fmt, n, partial(_tiled_product, fmt=w.fmt, n=n, act=w.act),
                          act=w.act, layer=t.layer)


def matmul(x: jax.Array, w, tile: int | None = None) -> jax.Array:
    """x [..., K] @ w [K, *out] -> [..., *out] in x's dtype (float weights: one tensordot).
    Packed weights go through the native kernel where it runs (XLA:CPU, one device), else
    XLA dequantizes them; `tile`: that, about that many floats at a time inside the step (see
    the module doc)."""
    if is_fused(w):
        return w.combine([matmul(x, p, tile).reshape(*x.shape[:-1], -1) for p in w.parts]).astype(x.dtype)
    if not is_quant(w):
        return jnp.tensordot(x, w, axes=1)
    if tile is None and native.available():
        return _kernel(x, w).astype(x.dtype).reshape(*x.shape[:-1], *w.out_shape)
    w, x = w.own(), _inputs(x, w.act)
    parts = [jnp.einsum("...k,kn->...n", x, t.astype(x.dtype)) for t in _columns(w, x, tile)]
    y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return y.reshape(*x.shape[:-1], *w.out_shape)


def head(x: jax.Array, w) -> jax.Array:
    """x [..., D] against w [V, D] (the embedding or the head) -> float32 [..., V]."""
    if not is_quant(w):
        return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)
    w = w.own()
    if native.available():  # w's blocks run along D: the kernel's [K, N] weight with N = V
        return _kernel(x, w)
    x = _inputs(x, w.act)
    (t,) = _columns(w, x, None)
    return jnp.einsum("...d,dv->...v", x, t.astype(x.dtype), preferred_element_type=jnp.float32)


def take(w, rows: jax.Array) -> jax.Array:
    """Rows of w [V, D] (an embedding lookup) -> [T, D] float32 for packed, as stored otherwise."""
    if not is_quant(w):
        return w[rows]
    w = w.own()
    if w.tiled is not None:  # row r is column r % 64 of tile r // 64
        c, lane = rows // TILE, rows % TILE
        pick = lambda a: jnp.moveaxis(a[c, ..., lane], 0, -1)  # noqa: E731  [T, nb, (R)] -> [nb, (R,) T]
        q, d = pick(w.q), pick(w.scale)
        return _dequantize(q, d, None if w.min is None else pick(w.min), w.fmt).T
    part = _fields(w, lambda a: a[..., rows])
    return _dequantize(part.q, part.scale, part.min, w.fmt).T
