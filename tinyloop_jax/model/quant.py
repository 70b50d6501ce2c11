"""Symmetric per-group quantization and int4 packing (pure jnp, shape-preserving).

A group is `group` consecutive values of the last axis of one token, so a token's stored
values never depend on other tokens: a cache filled in one chunk or token by token is
identical, and reuse equals recompute in every mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QMAX = {8: 127, 4: 7}


def quantize(x: jax.Array, bits: int, group: int) -> tuple[jax.Array, jax.Array]:
    """x [..., n] float -> (q [..., n] int8 in [-qmax, qmax], scale [..., n // group] float32)."""
    *lead, n = x.shape
    xg = x.astype(jnp.float32).reshape(*lead, n // group, group)
    absmax = jnp.max(jnp.abs(xg), axis=-1)
    scale = absmax / QMAX[bits]
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(xg / safe[..., None]), -QMAX[bits], QMAX[bits]).astype(jnp.int8)
    return q.reshape(*lead, n), scale


def dequantize(q: jax.Array, scale: jax.Array, group: int) -> jax.Array:
    """Inverse of `quantize` up to rounding: [..., n] float32. Error <= scale / 2 per element."""
    *lead, n = q.shape
    x = q.astype(jnp.float32).reshape(*lead, n // group, group) * scale[..., None]
    return x.reshape(*lead, n)


def pack_int4(q: jax.Array) -> jax.Array:
    """int8 values in [-7, 7], last axis even -> uint8 [..., n // 2] (low nibble = even index)."""
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: jax.Array) -> jax.Array:
    """uint8 [..., m] -> int8 [..., 2m]; exact inverse of `pack_int4`."""
    lo = (p & 0xF).astype(jnp.int8) - 8
    hi = (p >> 4).astype(jnp.int8) - 8
    return jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
