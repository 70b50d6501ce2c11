"""Packed weights built: from GGUF's bytes (`from_blocks`, and back: `to_blocks`), by quantizing
floats as llama.cpp's reference quantizer does (`quantize`), or at random for tests and
benchmarks (`random`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .qarray import FORMATS, SPECS, QuantArray, block_values, canonical


def from_blocks(raw: np.ndarray, fmt: str, k: int, transposed: bool) -> QuantArray:
    """GGUF's bytes of a matrix, raw [rows, K/S * bytes per block] uint8 (rows = the output
    axis) -> a QuantArray of logical shape [K, rows] (or [rows, K] when transposed)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; valid: {', '.join(FORMATS)}")
    values, size, at_d, at_m = SPECS[fmt]
    if k % values:
        raise ValueError(f"a {fmt} matrix needs its rows' length to be a multiple of {values}, got {k}")
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(rows, k // values, size)
    half = lambda at: b[..., at:at + 2].copy().view(np.float16)[..., 0]  # noqa: E731  [rows, nb]
    d, mn = half(at_d), None if at_m is None else half(at_m)
    keep = np.ones(size, bool)
    keep[at_d:at_d + 2] = False
    if at_m is not None:
        keep[at_m:at_m + 2] = False
    q = b[..., keep]  # [rows, nb, R]: the block's other bytes, in order
    q = q.view(np.int8) if fmt == "q8_0" else q
    out = lambda a: jnp.asarray(np.ascontiguousarray(np.moveaxis(a, 0, -1)))  # noqa: E731  rows last
    return QuantArray(q=out(q), scale=out(d), min=None if mn is None else out(mn), fmt=fmt, transposed=transposed)


def to_blocks(w: QuantArray) -> np.ndarray:
    """Inverse of `from_blocks`: GGUF's bytes [rows, K/S * bytes per block] of a weight in
    GGUF's order (rows: its output axes flattened)."""
    w = canonical(w)
    values, size, at_d, at_m = SPECS[w.fmt]
    def flat(a):  # [nb, (R,) *out] -> contiguous [rows, nb, (R)]
        a = np.asarray(a)
        return np.ascontiguousarray(np.moveaxis(a.reshape(*a.shape[:a.ndim - len(w.out_shape)], -1), -1, 0))
    q, d = flat(w.q).view(np.uint8), flat(w.scale).view(np.uint8)  # [rows, nb, R], [rows, nb, 2]
    b = np.zeros((*q.shape[:2], size), np.uint8)
    keep = np.ones(size, bool)
    b[..., at_d:at_d + 2] = d.reshape(*q.shape[:2], 2)
    keep[at_d:at_d + 2] = False
    if at_m is not None:
        b[..., at_m:at_m + 2] = flat(w.min).view(np.uint8).reshape(*q.shape[:2], 2)
        keep[at_m:at_m + 2] = False
    b[..., keep] = q
    return b.reshape(q.shape[0], -1)


def quantize(w, fmt: str, transposed: bool = False) -> QuantArray:
    """A float matrix (logical [K, N], or [N, K] when transposed) quantized the way llama.cpp's
    reference quantizer does (the `gguf` package's `quants.quantize`)."""
    from gguf import GGMLQuantizationType, quants

    a = np.asarray(w, np.float32)
    rows = a if transposed else a.T  # [N, K]: GGUF's rows
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; valid: {', '.join(FORMATS)}")
    if rows.shape[1] % block_values(fmt):
        raise ValueError(f"a {fmt} weight needs its input width to be a multiple of {block_values(fmt)}, "
                         f"got {rows.shape[1]}")
    raw = quants.quantize(np.ascontiguousarray(rows), GGMLQuantizationType[fmt.upper()])
    return from_blocks(raw, fmt, rows.shape[1], transposed)


def random_blocks(fmt: str, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """GGUF's bytes [rows, K/S * bytes per block] of a float matrix w [rows, K] in `fmt`, for
    benchmarks and tests: quantized (the `gguf` package) where it can; a K-quant, which it
    cannot quantize, as random blocks (only w's shape is used) with d (and dmin) 2e-3 (Q6_K:
    2e-4), so that the values stay in a sane range."""
    if fmt not in ("q4_k", "q5_k", "q6_k"):
        from gguf import GGMLQuantizationType, quants
        return quants.quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType[fmt.upper()])
    values, size, at_d, at_m = SPECS[fmt]
    rows, n = w.shape[0], w.shape[1] // values
    raw = rng.integers(0, 256, (rows, n, size), dtype=np.uint8)
    raw[:, :, at_d:at_d + 2] = np.full((rows, n, 1), 2e-4 if fmt == "q6_k" else 2e-3, np.float16).view(np.uint8)
    if at_m is not None:
        raw[:, :, at_m:at_m + 2] = raw[:, :, at_d:at_d + 2]
    return raw.reshape(rows, n * size)


def random(fmt: str, k: int, n: int, seed: int = 0, transposed: bool = False) -> QuantArray:
    """A random packed weight of logical shape [k, n] ([n, k] when transposed): `random_blocks`
    of a normal matrix scaled by 1 / sqrt(k)."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(fmt, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), rng)
    w = from_blocks(raw, fmt, k, transposed=True)  # [n, k]
    return w if transposed else w.T
