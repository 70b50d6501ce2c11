"""Decode attention over an int4 KV segment, without materializing full-precision K/V.

One query token per head attends to one cache segment whose K and V are stored packed
(two int4 values per uint8, a float32 scale per token per head, see `cache.py`). The result is
a *partial* softmax — unnormalized output, running max and sum per head — so segments (a
shared prefix, the request's own cache) are merged by log-sum-exp afterwards:

    o [H, hd]  = sum_c exp(s_c - m) * v_c        m [H] = max_c s_c        l [H] = sum_c exp(s_c - m)

Two implementations with one signature:
  * `int4_attention_pallas`: a Pallas (Triton) kernel. Grid (head, split of the slots); each
    program streams its slots in blocks, unpacks nibbles and scales in registers, and keeps an
    online softmax. The packed layout is used as is: the even channels of a token are the low
    nibbles, the odd ones the high nibbles, so q and the output are split into even/odd halves
    outside the kernel instead of interleaving nibbles inside it.
  * `int4_attention_ref`: pure jnp (dequantize, then attend). Used on CPU, and the oracle.
`int4_attention(..., impl=)` runs the one named by the model's static configuration
(`ModelConfig.int4_attention`: the kernel on GPU, the reference elsewhere; resolved once, when
the config is made, from `TINYLOOP_INT4_ATTENTION` = auto | pallas | interpret | jnp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import quant
from .attention import NEG, merge, visible


def int4_attention_ref(q, q_pos, k, ks, v, vs, key_pos, *, window: int):
    """q [H, hd] f32 (already scaled by 1/sqrt(hd)); q_pos [] int32; k, v [KV, C, hd/2] uint8;
    ks, vs [KV, C, 1] f32; key_pos [C] int32 (-1 = empty) -> (o [H, hd], m [H], l [H]). Query
    head h reads key/value head h // (H / KV) (grouped-query attention)."""
    group = q.shape[0] // k.shape[0]
    kf = jnp.repeat(quant.dequantize(quant.unpack_int4(k), ks, 2 * k.shape[-1]), group, axis=0)
    vf = jnp.repeat(quant.dequantize(quant.unpack_int4(v), vs, 2 * v.shape[-1]), group, axis=0)
    ok = visible(key_pos, q_pos, window)[None]  # [1, C]
    s = jnp.where(ok, jnp.einsum("hd,hcd->hc", q, kf), NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(ok, jnp.exp(s - m[:, None]), 0.0)
    return jnp.einsum("hc,hcd->hd", p, vf), m, jnp.sum(p, axis=-1)


def _kernel(q_e_ref, q_o_ref, qpos_ref, k_ref, ks_ref, v_ref, vs_ref, kpos_ref,
            o_e_ref, o_o_ref, m_ref, l_ref, *, block: int, n_blocks: int, window: int):
    # One program: one head, one split of the slots. Refs: q_* [hd/2]; k, v [split, hd/2] uint8;
    # ks, vs, kpos [split]; outputs o_* [hd/2], m, l [].
    q_e, q_o, q_pos = q_e_ref[...], q_o_ref[...], qpos_ref[...]

    def nibbles(x):  # uint8 [block, hd/2] -> (even, odd) channels as float32 in [-8, 7]
        lo = (x & 0xF).astype(jnp.int32) - 8
        hi = (x >> 4).astype(jnp.int32) - 8
        return lo.astype(jnp.float32), hi.astype(jnp.float32)

    def body(i, carry):
        o_e, o_o, m, l = carry
        sl = pl.ds(i * block, block)
        k_lo, k_hi = nibbles(k_ref[sl, :])
        s = jnp.sum(k_lo * q_e[None, :] + k_hi * q_o[None, :], axis=1) * ks_ref[sl]  # [block]
        ok = visible(kpos_ref[sl], q_pos, window)
        s = jnp.where(ok, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s))
        corr = jnp.exp(m - m_new)
        e = jnp.where(ok, jnp.exp(s - m_new), 0.0)
        p = e * vs_ref[sl]  # V's per-token scale folded into the weights
        v_lo, v_hi = nibbles(v_ref[sl, :])
        o_e = o_e * corr + jnp.sum(p[:, None] * v_lo, axis=0)
        o_o = o_o * corr + jnp.sum(p[:, None] * v_hi, axis=0)
        l = l * corr + jnp.sum(e)
        return o_e, o_o, m_new, l

    zeros = jnp.zeros(q_e.shape, jnp.float32)
    o_e, o_o, m, l = jax.lax.fori_loop(0, n_blocks, body, (zeros, zeros, jnp.float32(NEG), jnp.float32(0.0)))
    o_e_ref[...] = o_e
    o_o_ref[...] = o_o
    m_ref[...] = m
    l_ref[...] = l


def plan(capacity: int, n_heads: int, max_block: int = 64, target_programs: int = 256) -> tuple[int, int, int]:
    """(padded capacity, block, splits): blocks are powers of two (Triton tiles) dividing the
    padded capacity; the slots are split so that heads x splits approaches `target_programs`
    (flash-decoding: one head alone cannot fill a GPU)."""
    block = max_block
    while block > 16 and capacity % block:
        block //= 2
    padded = -(-capacity // block) * block
    n_blocks = padded // block
    want = max(1, target_programs // n_heads)
    splits = max(d for d in range(1, n_blocks + 1) if n_blocks % d == 0 and d <= want)
    return padded, block, splits


@functools.partial(jax.jit, static_argnames=("window", "interpret", "max_block", "num_warps"))
def int4_attention_pallas(q, q_pos, k, ks, v, vs, key_pos, *, window: int, interpret: bool = False,
                          max_block: int = 64, num_warps: int = 4):
    """Same contract as `int4_attention_ref`, computed by the Pallas kernel."""
    H = q.shape[0]
    KV, C, half = k.shape
    group = H // KV  # query head h reads key/value head h // group
    padded, block, splits = plan(C, H, max_block)
    if padded != C:  # odd capacities (direct calls): pad with empty slots
        pad = ((0, 0), (0, padded - C), (0, 0))
        k, v, ks, vs = jnp.pad(k, pad), jnp.pad(v, pad), jnp.pad(ks, pad), jnp.pad(vs, pad)
        key_pos = jnp.pad(key_pos, (0, padded - C), constant_values=-1)
    split = padded // splits
    kernel = functools.partial(_kernel, block=block, n_blocks=split // block, window=window)
    head = lambda h, s: (h, 0)  # noqa: E731
    slots2 = pl.BlockSpec((None, split, half), lambda h, s: (h // group, s, 0))
    slots1 = pl.BlockSpec((None, split), lambda h, s: (h // group, s))
    out_o = pl.BlockSpec((None, None, half), lambda h, s: (s, h, 0))
    out_s = pl.BlockSpec((None, None), lambda h, s: (s, h))
    o_e, o_o, m, l = pl.pallas_call(
        kernel,
        grid=(H, splits),
        in_specs=[pl.BlockSpec((None, half), head), pl.BlockSpec((None, half), head),
                  pl.BlockSpec((), lambda h, s: ()),
                  slots2, slots1, slots2, slots1,
                  pl.BlockSpec((split,), lambda h, s: (s,))],
        out_specs=[out_o, out_o, out_s, out_s],
        out_shape=[jax.ShapeDtypeStruct((splits, H, half), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((splits, H), jnp.float32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="tinyloop_int4_decode_attention",
    )(q[:, 0::2], q[:, 1::2], q_pos.astype(jnp.int32), k, ks[..., 0], v, vs[..., 0], key_pos)
    o = jnp.stack([o_e, o_o], axis=-1).reshape(splits, H, 2 * half)  # re-interleave channels
    return merge(o, m, l)


def int4_attention(q, q_pos, k, ks, v, vs, key_pos, *, window: int, impl: str):
    """`impl` = "jnp" (the reference), "pallas" (the kernel) or "interpret" (the kernel, interpreted)."""
    if impl == "jnp":
        return int4_attention_ref(q, q_pos, k, ks, v, vs, key_pos, window=window)
    return int4_attention_pallas(q, q_pos, k, ks, v, vs, key_pos, window=window, interpret=impl == "interpret")
