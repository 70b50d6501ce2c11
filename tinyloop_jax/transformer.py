"""The looped GPT-2 forward pass as pure functions over (params, cache segments).

One function, `run_layers`, serves prefill (a chunk of T tokens), decode (T = 1) and the
extra passes of a deeper prefix. A chunk attends to three kinds of keys, with one softmax over
all of them (see `attention`):

    read-only segments (a shared prefix)  +  own segment (earlier tokens)  +  the chunk itself

and is then written into the own segment. The pre blocks run one after another; the loop
block's passes run under `lax.fori_loop` over the stacked pass axis of the caches, so a
program's size does not depend on the depth.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import cache as kvc
from . import int4_attention as i4
from .attention import attention, normalize
from .cache import KVCache
from .config import ModelConfig
from .kv_modes import pack_kv, unpack_kv
from .params import BlockParams, Params


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's tanh approximation ("gelu_new")."""
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def embed(params: Params, tokens: jax.Array, start_pos: jax.Array) -> jax.Array:
    """tokens [T] at positions start_pos + i -> the residual stream [T, D]."""
    q_pos = start_pos + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return params.wte[tokens] + params.wpe[jnp.minimum(q_pos, params.wpe.shape[0] - 1)]


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Streams [..., D] (before the final LayerNorm) -> logits [..., V] with the tied embedding."""
    x = layer_norm(x, params.lnf_g, params.lnf_b, cfg.layer_norm_eps)
    return jnp.einsum("...d,vd->...v", x, params.wte)


def qkv_heads(x: jax.Array, blk: BlockParams, cfg: ModelConfig):
    """x [T, D] -> h [T, D] (the normalized input), q, k, v, each [H, T, hd]."""
    T = x.shape[0]
    h = layer_norm(x, blk.ln1_g, blk.ln1_b, cfg.layer_norm_eps)
    qkv = (h @ blk.w_qkv + blk.b_qkv).reshape(T, 3, cfg.n_heads, cfg.head_dim).transpose(1, 2, 0, 3)
    return h, qkv[0], qkv[1], qkv[2]


def read_kv(cfg: ModelConfig, stored: dict, blk: BlockParams, kv_mode: str):
    """One layer's stored arrays in `kv_mode` -> float32 K, V [H, C, hd] (h modes rebuild them
    with the K/V half of the block's fused projection)."""
    D = cfg.d_model
    return unpack_kv(kv_mode, stored, blk.w_qkv[:, D:], blk.b_qkv[D:], cfg.n_heads)


def block_out(x: jax.Array, a: jax.Array, blk: BlockParams, cfg: ModelConfig) -> jax.Array:
    """Residual update from the attention output a [H, T, hd], then the MLP."""
    T = x.shape[0]
    x = x + a.transpose(1, 0, 2).reshape(T, cfg.d_model) @ blk.w_o + blk.b_o
    h2 = layer_norm(x, blk.ln2_g, blk.ln2_b, cfg.layer_norm_eps)
    return x + gelu(h2 @ blk.w_fc + blk.b_fc) @ blk.w_proj + blk.b_proj


class Chunk(NamedTuple):
    """Where a chunk of T tokens goes: q_pos [T] absolute positions; self_pos [T] the same with
    padding at -1 (so the chunk's padding is never a key); slots [T] own-segment slots (>= C:
    not stored)."""
    q_pos: jax.Array
    self_pos: jax.Array
    slots: jax.Array


class Layer(NamedTuple):
    """One cache layer of a segment as attention reads it."""
    stored: dict  # arrays [lead, C, w] in kv_mode
    key_pos: jax.Array  # [C]
    kv_mode: str


def block(x: jax.Array, blk: BlockParams, cfg: ModelConfig, chunk: Chunk, ro: list, own: KVCache, store: dict,
          index, window: int):
    """One transformer block on a chunk x [T, D]. ro: this layer of each read-only segment
    ([Layer]); store: own's arrays for this layer — a pre layer (index None) or the loop stack
    (index = the pass). Returns (x', store with the chunk written)."""
    h, q, k, v = qkv_heads(x, blk, cfg)
    fresh = pack_kv(cfg.kv_mode, h, k, v)
    if own.kv_mode != cfg.kv_mode:
        # A call-scoped working segment (see `materialize`): store the values the model's mode
        # would give when read back, so results do not depend on where a token is kept.
        fresh = pack_kv(own.kv_mode, h, *read_kv(cfg, fresh, blk, cfg.kv_mode))
    if x.shape[0] == 1:
        # Decode: write first, then attend to the updated buffer. The data dependency lets XLA
        # update the buffer in place; reading the old buffer beside the write forces a copy.
        store = kvc.write(store, fresh, chunk.slots, index)
        segs = ro + [Layer(kvc.read(store, index), kvc.write_positions(own.pos, chunk.q_pos, chunk.slots),
                           own.kv_mode)]
        if all(s.kv_mode == "int4" for s in segs):
            return block_out(x, attention_int4_decode(q, chunk.q_pos, segs, window, cfg.int4_attention), blk,
                             cfg), store
        kvs = [(*read_kv(cfg, s.stored, blk, s.kv_mode), s.key_pos) for s in segs]
    else:
        # Prefill: the chunk attends to itself directly (it may be longer than a window's ring
        # buffer), seeing its K/V exactly as a cache would hold them; then it is written.
        kvs = [(*read_kv(cfg, s.stored, blk, s.kv_mode), s.key_pos) for s in ro]
        kvs.append((*read_kv(cfg, kvc.read(store, index), blk, own.kv_mode), own.pos))
        kvs.append((*read_kv(cfg, fresh, blk, own.kv_mode), chunk.self_pos))
        store = kvc.write(store, fresh, chunk.slots, index)
    return block_out(x, attention(q, chunk.q_pos, kvs, window), blk, cfg), store


def attention_int4_decode(q: jax.Array, q_pos: jax.Array, segs: list, window: int, impl: str) -> jax.Array:
    """Decode (T = 1) attention over int4 segments read packed: one partial softmax per segment
    (the Pallas kernel on GPU), merged by log-sum-exp."""
    qs = q[:, 0] * q.shape[-1] ** -0.5
    parts = [i4.int4_attention(qs, q_pos[0], s.stored["k"], s.stored["ks"], s.stored["v"], s.stored["vs"], s.key_pos,
                               window=window, impl=impl) for s in segs]
    return normalize(parts)[:, None]


def run_layers(params: Params, cfg: ModelConfig, x: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
               ro: tuple, own: KVCache, loops: int, window: int, keep_states: bool = False):
    """Run a chunk's stream x [T, D] through own's layers and append the chunk to `own`.

    Only the first n_valid of the T tokens are real (the rest is bucket padding); they sit at
    absolute positions start_pos + i. `own` holds either every pre layer or none (then x is the
    stream entering the first pass), and at least `loops` passes; `ro` segments (a prefix) hold
    every pre layer and at least `loops` passes. Passes 0..loops-1 run; deeper ones are not
    touched. Returns (x after the last pass [T, D], new own, and with keep_states the last real
    token's stream after each layer run [layers, D], else None).
    """
    T, n_pre = x.shape[0], len(own.pre)
    if n_pre not in (0, cfg.n_pre_blocks) or own.passes < loops or any(s.passes < loops for s in ro):
        raise ValueError(f"segments do not fit loops={loops}: own has {n_pre} pre layers and {own.passes} passes, "
                         f"read-only segments have {[s.passes for s in ro]} passes")
    q_pos = start_pos + jnp.arange(T, dtype=jnp.int32)
    chunk = Chunk(q_pos, jnp.where(jnp.arange(T) < n_valid, q_pos, -1), kvc.write_slots(q_pos, n_valid, own.capacity))
    last = jnp.maximum(n_valid - 1, 0)
    at_last = lambda x: jax.lax.dynamic_index_in_dim(x, last, axis=0, keepdims=False)  # noqa: E731

    pre, states = [], []
    for j, store in enumerate(own.pre):
        layers = [Layer(s.pre[j], s.pos, s.kv_mode) for s in ro]
        x, store = block(x, params.pre[j], cfg, chunk, layers, own, store, None, window)
        pre.append(store)
        states.append(at_last(x))

    def one_pass(i, carry):
        x, stack, passes = carry
        layers = [Layer(kvc.read(s.loop, i), s.pos, s.kv_mode) for s in ro]
        x, stack = block(x, params.loop, cfg, chunk, layers, own, stack, i, window)
        if keep_states:
            passes = passes.at[i].set(at_last(x))
        return x, stack, passes

    passes = jnp.zeros((loops, x.shape[1]), x.dtype) if keep_states else None
    x, loop, passes = jax.lax.fori_loop(0, loops, one_pass, (x, own.loop, passes))
    new_own = own.replace(pre=tuple(pre), loop=loop, pos=kvc.write_positions(own.pos, q_pos, chunk.slots),
                          length=(start_pos + n_valid).astype(jnp.int32))
    if keep_states:
        states = jnp.concatenate([jnp.stack(states), passes]) if states else passes
    return x, new_own, states if keep_states else None


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
            ro: tuple, own: KVCache, loops: int, window: int):
    """Embed tokens [T] (positions start_pos + i) and run them through every layer, appending
    them to `own`. Returns (streams after the last pass [T, D], new own)."""
    x, own, _ = run_layers(params, cfg, embed(params, tokens, start_pos), n_valid, start_pos, ro, own, loops, window)
    return x, own


def last_logits(params: Params, cfg: ModelConfig, x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Next-token logits [V] after the last real token of streams x [T, D]."""
    return lm_head(params, cfg, jax.lax.dynamic_index_in_dim(x, jnp.maximum(n_valid - 1, 0), axis=0, keepdims=False))


def materialize(params: Params, cfg: ModelConfig, seg: KVCache, passes: int) -> KVCache:
    """The segment's first `passes` passes with K/V stored in float32 ("fp32" mode): for h modes,
    K/V rebuilt from the stored h once, so that a whole call (every decode step, every request
    of a batch) reads them instead of re-projecting h at each step."""
    kv = lambda stored, blk: dict(zip("kv", read_kv(cfg, stored, blk, seg.kv_mode)))  # noqa: E731
    loop = {n: a[:passes] for n, a in seg.loop.items()}
    return seg.replace(pre=tuple(kv(e, b) for e, b in zip(seg.pre, params.pre)),
                       loop=jax.vmap(lambda e: kv(e, params.loop))(loop), kv_mode="fp32")


def forward_seq(params: Params, cfg: ModelConfig, tokens: jax.Array, loops: int, window: int = 0) -> jax.Array:
    """Cache-free forward over a whole sequence (training and evaluation): tokens [T] -> logits
    [T, V]. K/V pass through the kv_mode round trip, as the cached path sees them. The passes
    run under `lax.scan` (differentiable, one copy of the block in the program)."""
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def layer(x, blk):
        h, q, k, v = qkv_heads(x, blk, cfg)
        k, v = read_kv(cfg, pack_kv(cfg.kv_mode, h, k, v), blk, cfg.kv_mode)  # as a cache would hold them
        return block_out(x, attention(q, pos, [(k, v, pos)], window), blk, cfg)

    x = params.wte[tokens] + params.wpe[pos]
    for blk in params.pre:
        x = layer(x, blk)
    x, _ = jax.lax.scan(lambda x, _: (layer(x, params.loop), None), x, None, length=loops)
    return lm_head(params, cfg, x)
