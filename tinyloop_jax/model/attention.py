"""Attention as per-segment partial softmaxes merged by log-sum-exp (cascade attention).

A query attends to several segments — a shared prefix, its own cache, the chunk itself. Each
segment gives a *partial* softmax, and the partials merge exactly into one softmax over all the
segments' keys:

    o [.., hd] = sum_c exp(s_c - m) v_c      m = max_c s_c      l = sum_c exp(s_c - m)
    merged:  m* = max_i m_i,  o* = sum_i exp(m_i - m*) o_i,  l* = sum_i exp(m_i - m*) l_i,  out = o* / l*

Masks come from absolute positions, so causality and the sliding window hold across segments.
The model and the int4 decode kernel both use this module (`NEG`, `visible`, `merge`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity": a fully masked row gives numbers, not NaN


def visible(key_pos: jax.Array, q_pos: jax.Array, window) -> jax.Array:
    """Is the key at absolute position key_pos visible to the query at q_pos? Broadcasts
    (key_pos [C] with q_pos [] -> [C]; key_pos [1, C] with q_pos [T, 1] -> [T, C]). Empty slots
    hold position -1 and are never visible. window: an int (static), or a traced int32 [] (a
    request's own, in a batch of others; <= 0: none)."""
    ok = (key_pos >= 0) & (key_pos <= q_pos)
    if not isinstance(window, int):
        return ok & ((window <= 0) | (key_pos > q_pos - window))
    if window > 0:
        ok &= key_pos > q_pos - window
    return ok


def partial_softmax(q: jax.Array, q_pos: jax.Array, k: jax.Array, v: jax.Array, key_pos: jax.Array, window: int):
    """One segment: q [H, T, hd] (pre-scaled), q_pos [T], k, v [H, C, hd], key_pos [C] ->
    (o [H, T, hd] unnormalized, m [H, T] row max, l [H, T] row sum of exp(s - m))."""
    ok = visible(key_pos[None, :], q_pos[:, None], window)[None]
    s = jnp.where(ok, jnp.einsum("htd,hcd->htc", q, k), NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    return jnp.einsum("htc,hcd->htd", p, v), m, jnp.sum(p, axis=-1)


def merge(o: jax.Array, m: jax.Array, l: jax.Array):
    """Merge partials stacked on axis 0: o [S, ..., hd], m, l [S, ...] -> (o, m, l) of one softmax."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    return jnp.sum(o * w[..., None], axis=0), m_all, jnp.sum(l * w, axis=0)


def normalize(parts: list) -> jax.Array:
    """A list of (o, m, l) partials -> the normalized attention output."""
    o, _, l = merge(*(jnp.stack(x) for x in zip(*parts)))
    return o / jnp.where(l > 0, l, 1.0)[..., None]  # l = 0 only for padding rows that see no key


def attention(q: jax.Array, q_pos: jax.Array, segments: list, window: int) -> jax.Array:
    """q [H, T, hd]; segments: list of (k [KV, C, hd], v [KV, C, hd], key_pos [C]) -> [H, T, hd].

    Grouped-query attention (KV < H): query head h uses key/value head h // (H / KV); the G
    query heads of a group are folded into the rows, so each K/V head is read once. Under `vmap`
    over requests with a shared prefix left unbatched, the prefix's part is one matmul of all
    requests' queries against one copy of it."""
    H, T, hd = q.shape
    kv = segments[0][0].shape[0]
    q = (q * hd ** -0.5).reshape(kv, (H // kv) * T, hd)  # row g * T + t of group k: head k G + g, token t
    q_pos = jnp.tile(q_pos, H // kv)
    out = normalize([partial_softmax(q, q_pos, k, v, p, window) for k, v, p in segments])
    return out.reshape(H, T, hd)
