"""Paged attention on a GPU: a Pallas (Triton) kernel reading each row's live pages only.

The contract is the native CPU kernel's (`native.paged_attention`): each row's queries q
[b, T, H, hd] (pre-scaled; query t at position start + t, real for t < n_new) against the row's
pages of one layer, in any stored format — fp32 / fp16 floats, int8 or int4 (two per byte, low
nibble = even channel) with a float32 scale per token per head — with grouped-query heads, a
per-row window, and a layer picked out of a loop stack without copying it.

One program per (row, KV head), as jax's `pallas.ops.gpu.paged_attention` groups query heads
per KV head: the G query heads of the KV head and the row's T tokens are the M = G T rows of
one block (padded to a power of two >= 16: Triton's tiles), so a page's K/V is read once
for all of them.
The program walks the row's pages from the first its window can see to the last holding a
live token (the page table is the whole context's; entries past the row's length are never
read), with an online softmax, scales folded into the scores (K) and the weights (V). An int4
page is used as stored: q and the output are split into even / odd channels outside the
kernel, so nibbles are never interleaved inside it (as `int4_attention` does).

Not split over the context (flash-decoding): a step holds many rows x KV heads programs; a
lone long row would want splits (said in docs/engine-plan.md). Tested in interpret mode
against the XLA reference, and by its CUDA lowering, on CPU; run on a GPU by
`scripts/gpu_check.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .attention import NEG

BLOCK_M = 16  # query rows of a program are padded to this: Triton's smallest dot operand


def _kernel(meta_ref, qpos_ref, pages_ref, *refs, page: int, kv_heads: int, packed: bool, scaled: bool):
    # meta [4] = (start, n_new, window, layer); qpos [M] (-1: padding); pages [R]; then q (one or
    # two halves [M, w]), k, v [LH, NP, P, w], (ks, vs [LH, NP, P]), and the outputs [M, w] x halves.
    halves = 2 if packed else 1
    q_refs, refs = refs[:halves], refs[halves:]
    k_ref, v_ref, refs = refs[0], refs[1], refs[2:]
    (ks_ref, vs_ref), refs = (refs[:2], refs[2:]) if scaled else ((None, None), refs)
    o_refs = refs
    start, n_new, window, layer = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    lh = layer * kv_heads + pl.program_id(1)  # the KV head's entry of the flattened stack
    qpos = qpos_ref[...]
    qs = [r[...] for r in q_refs]
    first = jnp.where(window > 0, jnp.maximum(start - window + 1, 0), 0) // page
    last = (start + n_new + page - 1) // page  # pages past the row's last live token are never read

    def values(ref, i):  # one page's stored values as float32 halves [P, w]
        x = ref[lh, i]
        if not packed:
            return [x.astype(jnp.float32)]
        return [((x & 0xF).astype(jnp.int32) - 8).astype(jnp.float32),
                ((x >> 4).astype(jnp.int32) - 8).astype(jnp.float32)]

    def body(n, carry):
        os_, m, l = carry
        i = pages_ref[n]
        s = sum(jnp.dot(q, k.T, precision=jax.lax.Precision.HIGHEST) for q, k in zip(qs, values(k_ref, i)))
        if scaled:
            s = s * ks_ref[lh, i][None, :]
        kp = n * page + jnp.arange(page, dtype=jnp.int32)[None, :]  # [1, P] key positions
        ok = (kp <= qpos[:, None]) & ((window <= 0) | (kp > qpos[:, None] - window))
        s = jnp.where(ok, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        e = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        l = l * corr + jnp.sum(e, axis=1)
        p = e * vs_ref[lh, i][None, :] if scaled else e
        os_ = tuple(o * corr[:, None] + jnp.dot(p, v, precision=jax.lax.Precision.HIGHEST)
                    for o, v in zip(os_, values(v_ref, i)))
        return os_, m_new, l

    M = qpos.shape[0]
    zeros = tuple(jnp.zeros((M, q.shape[1]), jnp.float32) for q in qs)
    os_, _, l = jax.lax.fori_loop(first, last, body, (zeros, jnp.full((M,), NEG, jnp.float32),
                                                      jnp.zeros((M,), jnp.float32)))
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)  # padding queries: zeros
    for ref, o in zip(o_refs, os_):
        ref[...] = o * inv[:, None]


@functools.partial(jax.jit, static_argnames=("fmt", "kv_heads", "interpret", "num_warps"))
def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, ks: jax.Array | None, vs: jax.Array | None,
                    table: jax.Array, start: jax.Array, n_new: jax.Array, layer: jax.Array, fmt: str, window,
                    kv_heads: int, *, interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """`native.paged_attention`'s contract, on the Pallas kernel: q [b, T, H, hd] f32 pre-scaled;
    k, v one layer's pages [.., KV, NP, P, w] (or a stack, `layer` [] choosing a leading entry);
    ks, vs [.., KV, NP, P, 1] (int formats) or None; table [b, R]; start, n_new [b]; window an
    int or [b] (<= 0: none) -> float32 [b, T, H, hd], zeros at padding queries."""
    b, T, H, hd = q.shape
    KV, NP, P, w = k.shape[-4:]
    G, packed, scaled = H // kv_heads, fmt == "int4", fmt in ("int8", "int4")
    flat = lambda a: a.reshape(-1, NP, P, a.shape[-1])  # noqa: E731  [LH, NP, P, w]: layer l's head g at l KV + g
    M = max(BLOCK_M, 1 << (G * T - 1).bit_length())  # Triton tiles are powers of two
    # queries per (row, KV head): its G heads' T tokens, one block of M rows
    qg = q.astype(jnp.float32).reshape(b, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(b, KV, G * T, hd)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, M - G * T), (0, 0)))
    t = jnp.arange(M, dtype=jnp.int32) % T
    qpos = jnp.where((jnp.arange(M) < G * T)[None] & (t[None] < n_new[:, None]), start[:, None] + t[None], -1)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    meta = jnp.stack([i32(start), i32(n_new), jnp.broadcast_to(i32(window), (b,)),
                      jnp.broadcast_to(i32(layer), (b,))], axis=1)  # [b, 4]
    qs = [qg[..., 0::2], qg[..., 1::2]] if packed else [qg]
    whole = [flat(k), flat(v)] + ([flat(ks)[..., 0], flat(vs)[..., 0]] if scaled else [])
    row = lambda *blk: pl.BlockSpec((None, *blk), lambda r, g: (r,) + (0,) * len(blk))  # noqa: E731
    full = lambda a: pl.BlockSpec(a.shape, lambda r, g: (0,) * a.ndim)  # noqa: E731
    per_head = pl.BlockSpec((None, None, M, qs[0].shape[-1]), lambda r, g: (r, g, 0, 0))
    outs = pl.pallas_call(
        functools.partial(_kernel, page=P, kv_heads=KV, packed=packed, scaled=scaled),
        grid=(b, KV),
        in_specs=[row(4), row(M), row(table.shape[1])] + [per_head] * len(qs) + [full(a) for a in whole],
        out_specs=[per_head] * len(qs),
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in qs],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="tinyloop_paged_attention",
    )(meta, qpos, i32(table), *qs, *whole)
    o = jnp.stack(outs, axis=-1).reshape(b, KV, M, hd) if packed else outs[0]  # channels re-interleaved
    return o[:, :, :G * T].reshape(b, KV, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(b, T, H, hd)
