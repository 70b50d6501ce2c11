"""The looped GPT-2 forward pass as pure functions over (params, caches).

One function, `forward`, serves prefill (a chunk of T tokens) and decode (T = 1). A chunk
attends to three kinds of keys, with one softmax over all of them:

    read-only segments (a shared prefix)  +  own segment (earlier tokens)  +  the chunk itself

and is then written into the own segment. Masks come from absolute positions, so causality
and the sliding window hold across segments, and a reused prefix is only ever read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cache as kvc
from . import int4_attention as i4
from .config import ModelConfig
from .params import BlockParams, Params, block_for_layer

_NEG = -1e30  # finite: a fully masked (padding) row must give numbers, not NaN


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's tanh approximation ("gelu_new")."""
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def attend_mask(key_pos: jax.Array, q_pos: jax.Array, window: int) -> jax.Array:
    """[T, C] bool: key at absolute position key_pos is visible to query at q_pos."""
    k, q = key_pos[None, :], q_pos[:, None]
    ok = (k >= 0) & (k <= q)
    if window > 0:
        ok &= k > q - window
    return ok


def attend_partial(q: jax.Array, q_pos: jax.Array, k: jax.Array, v: jax.Array, key_pos: jax.Array, window: int):
    """One segment's partial softmax: q [H, T, hd] (pre-scaled), k, v [H, C, hd], key_pos [C] ->
    (o [H, T, hd] unnormalized, m [H, T] row max, l [H, T] row sum of exp(s - m))."""
    ok = attend_mask(key_pos, q_pos, window)[None]
    s = jnp.where(ok, jnp.einsum("htd,hcd->htc", q, k), _NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    return jnp.einsum("htc,hcd->htd", p, v), m, jnp.sum(p, axis=-1)


def merge_partials(parts: list) -> jax.Array:
    """Partial softmaxes of several segments -> normalized attention output, by log-sum-exp:
    the result equals one softmax over all the segments' keys (cascade attention)."""
    o, _, l = i4.merge(*(jnp.stack(x) for x in zip(*parts)))
    return o / jnp.where(l > 0, l, 1.0)[..., None]  # l = 0 only for padding rows that see no key


def attention(q: jax.Array, q_pos: jax.Array, kvs: list, window: int) -> jax.Array:
    """q [H, T, hd]; kvs: list of (k [H, C, hd], v [H, C, hd], key_pos [C]) -> [H, T, hd].

    Each segment (a shared prefix, the own cache, the chunk itself) gives a partial softmax;
    they are merged by log-sum-exp. Under `vmap` over requests with a shared prefix left
    unbatched, the prefix's part is one matmul of all requests' queries against one copy."""
    q = q * q.shape[-1] ** -0.5
    return merge_partials([attend_partial(q, q_pos, k, v, p, window) for k, v, p in kvs])


def attention_int4_decode(q: jax.Array, q_pos: jax.Array, segs: list, window: int) -> jax.Array:
    """Decode (T = 1) attention over int4 segments [(entry, key_pos [C])] read packed: one
    partial softmax per segment (the Pallas kernel on GPU), merged by log-sum-exp."""
    qs = q[:, 0] * q.shape[-1] ** -0.5
    parts = [i4.int4_attention(qs, q_pos[0], e["k"], e["ks"], e["v"], e["vs"], p, window=window) for e, p in segs]
    return merge_partials(parts)[:, None]


def qkv_heads(x: jax.Array, blk: BlockParams, cfg: ModelConfig):
    """x [T, D] -> h [T, D] (the normalized input), q, k, v, each [H, T, hd]."""
    T = x.shape[0]
    h = layer_norm(x, blk.ln1_g, blk.ln1_b, cfg.layer_norm_eps)
    qkv = (h @ blk.w_qkv + blk.b_qkv).reshape(T, 3, cfg.n_heads, cfg.head_dim).transpose(1, 2, 0, 3)
    return h, qkv[0], qkv[1], qkv[2]


def kv_weights(blk: BlockParams, cfg: ModelConfig):
    """The K/V half of the fused projection: w [D, 2D], b [2D] (for the h modes)."""
    D = cfg.d_model
    return blk.w_qkv[:, D:], blk.b_qkv[D:]


def read_kv(cfg: ModelConfig, entry: dict, blk: BlockParams, kv_mode: str | None = None):
    """A cache layer's stored arrays (in `kv_mode`, default the model's) -> float32 K, V [H, C, hd]."""
    return kvc.decode(kv_mode or cfg.kv_mode, entry, *kv_weights(blk, cfg), cfg.n_heads)


def block_out(x: jax.Array, a: jax.Array, blk: BlockParams, cfg: ModelConfig) -> jax.Array:
    """Residual update from the attention output a [H, T, hd], then the MLP."""
    T = x.shape[0]
    x = x + a.transpose(1, 0, 2).reshape(T, cfg.d_model) @ blk.w_o + blk.b_o
    h2 = layer_norm(x, blk.ln2_g, blk.ln2_b, cfg.layer_norm_eps)
    return x + gelu(h2 @ blk.w_fc + blk.b_fc) @ blk.w_proj + blk.b_proj


def block(x, blk: BlockParams, cfg: ModelConfig, layer: int, q_pos, key_pos_self, slots, ro, own, own_entry,
          window):
    """One transformer block on a chunk x [T, D]: cache layer `layer` of the read-only segments,
    and `own_entry` (that layer of `own`). Returns (x', own's new entry for the layer)."""
    T = x.shape[0]
    h, q, k, v = qkv_heads(x, blk, cfg)
    fresh = kvc.encode(cfg.kv_mode, h, k, v)
    if own.kv_mode != cfg.kv_mode:
        # A call-scoped working segment (see `materialize`): store the values the model's mode
        # would give when read back, so results do not depend on where a token is kept.
        fresh = kvc.encode(own.kv_mode, h, *read_kv(cfg, fresh, blk))
    if T == 1 and own.kv_mode == "int4" and all(seg.kv_mode == "int4" for seg in ro):
        # packed K/V straight into the attention kernel
        entry = kvc.write_layer(own_entry, fresh, slots)
        segs = [(seg.layers[layer], seg.pos) for seg in ro]
        segs.append((entry, kvc.write_positions(own.pos, q_pos, slots)))
        return block_out(x, attention_int4_decode(q, q_pos, segs, window), blk, cfg), entry
    kvs = [(*read_kv(cfg, seg.layers[layer], blk, seg.kv_mode), seg.pos) for seg in ro]
    if T == 1:
        # Decode: write first, then attend to the updated buffer. The data dependency lets XLA
        # update the buffer in place; reading the old buffer beside the write forces a copy.
        entry = kvc.write_layer(own_entry, fresh, slots)
        kvs.append((*read_kv(cfg, entry, blk, own.kv_mode), kvc.write_positions(own.pos, q_pos, slots)))
    else:
        # Prefill: the chunk attends to itself directly (it may be longer than a window's ring
        # buffer), seeing its K/V exactly as a cache would hold them; then it is written.
        kvs.append((*read_kv(cfg, own_entry, blk, own.kv_mode), own.pos))
        kvs.append((*read_kv(cfg, fresh, blk, own.kv_mode), key_pos_self))
        entry = kvc.write_layer(own_entry, fresh, slots)
    return block_out(x, attention(q, q_pos, kvs, window), blk, cfg), entry


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array,
            start_pos: jax.Array, ro: tuple, own: kvc.KVCache, loops: int, window: int):
    """Run a chunk through the model and append it to `own`.

    tokens [T] int32 (only the first n_valid are real; the rest is bucket padding), at
    absolute positions start_pos + i. ro: read-only KVCache segments (a prefix). own: the
    segment this call writes, with n_pre_blocks + loops layers.
    Returns (hidden [T, D] after the final LayerNorm, new own cache).
    """
    x = embed(params, tokens, start_pos)
    _, x, _, own = run_layers(params, cfg, x, n_valid, start_pos, ro, own, 0, cfg.n_cache_layers(loops), window)
    return x, own


def embed(params: Params, tokens: jax.Array, start_pos: jax.Array) -> jax.Array:
    q_pos = start_pos + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return params.wte[tokens] + params.wpe[jnp.minimum(q_pos, params.wpe.shape[0] - 1)]


def run_layers(params: Params, cfg: ModelConfig, x: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
               ro: tuple, own: kvc.KVCache, first: int, last: int, window: int):
    """Cache layers first .. last-1 on the residual stream x [T, D] (the state entering layer
    `first`); `own` holds exactly those layers, read-only segments hold all `last` layers.
    Returns (x after layer last-1 [T, D], x after LayerNorm, states [last-first, D] of the last
    real token after each layer, new own)."""
    T = x.shape[0]
    if own.n_layers != last - first or any(s.n_layers != last for s in ro):
        raise ValueError(f"cache has {own.n_layers} layers for layers {first}..{last - 1} "
                         f"(read-only segments: {[s.n_layers for s in ro]})")
    q_pos = start_pos + jnp.arange(T, dtype=jnp.int32)
    key_pos_self = jnp.where(jnp.arange(T) < n_valid, q_pos, -1)
    slots = kvc.write_slots(q_pos, n_valid, own.capacity)
    new_layers, states = [], []
    for layer in range(first, last):
        x, entry = block(x, block_for_layer(params, layer), cfg, layer, q_pos, key_pos_self, slots, ro, own,
                         own.layers[layer - first], window)
        new_layers.append(entry)
        states.append(jax.lax.dynamic_index_in_dim(x, jnp.maximum(n_valid - 1, 0), axis=0, keepdims=False))
    new_own = own.replace(layers=tuple(new_layers),
                          pos=kvc.write_positions(own.pos, q_pos, slots),
                          length=(start_pos + n_valid).astype(jnp.int32))
    return x, layer_norm(x, params.lnf_g, params.lnf_b, cfg.layer_norm_eps), jnp.stack(states), new_own


def materialize(params: Params, cfg: ModelConfig, seg: kvc.KVCache) -> kvc.KVCache:
    """The same segment with K/V stored in float32 ("fp32" mode): for h modes, K/V rebuilt
    from the stored h once, so that a whole call (every decode step, every request of a batch)
    reads them instead of re-projecting h at each step."""
    layers = tuple(dict(zip("kv", read_kv(cfg, entry, block_for_layer(params, i), seg.kv_mode)))
                   for i, entry in enumerate(seg.layers))
    return seg.replace(layers=layers, kv_mode="fp32")


def lm_head(params: Params, x: jax.Array) -> jax.Array:
    """[..., D] -> [..., V] with the tied embedding."""
    return jnp.einsum("...d,vd->...v", x, params.wte)


def forward_seq(params: Params, cfg: ModelConfig, tokens: jax.Array, loops: int, window: int = 0) -> jax.Array:
    """Cache-free forward over a whole sequence (training and evaluation): tokens [T] -> logits
    [T, V]. K/V pass through the kv_mode round trip, as the cached path sees them."""
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = params.wte[tokens] + params.wpe[pos]
    for layer in range(cfg.n_cache_layers(loops)):
        blk = block_for_layer(params, layer)
        h, q, k, v = qkv_heads(x, blk, cfg)
        k, v = read_kv(cfg, kvc.encode(cfg.kv_mode, h, k, v), blk)  # as a cache would hold them
        x = block_out(x, attention(q, pos, [(k, v, pos)], window), blk, cfg)
    return lm_head(params, layer_norm(x, params.lnf_g, params.lnf_b, cfg.layer_norm_eps))
