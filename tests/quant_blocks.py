"""Packed weights of every GGUF block type for the kernel and format tests (`qpack.random`:
quantized by the `gguf` package, or random blocks for the K-quants, which it cannot quantize)."""

import numpy as np

from tinyloop_jax.model import qarray
from tinyloop_jax.model import qpack

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def encode(kind: str, w: np.ndarray, rng) -> np.ndarray:
    """A [rows, row] float32 matrix in GGUF type `kind` (raw bytes, uint8 [rows, bytes]); a
    K-quant: random blocks of w's shape (`qpack.random_blocks`)."""
    return qpack.random_blocks(kind.lower(), w, rng)


def packed(fmt: str, k: int, n: int, seed: int = 0, transposed: bool = False):
    """A `QuantArray` of logical shape [k, n] ([n, k] when transposed) and its float32 values."""
    w = qpack.random(fmt, k, n, seed, transposed)
    return w, np.asarray(w.dequantize())


def width(fmt: str, k: int) -> int:
    """k rounded up to a whole number of `fmt`'s blocks."""
    b = qarray.block_values(fmt)
    return -(-k // b) * b
