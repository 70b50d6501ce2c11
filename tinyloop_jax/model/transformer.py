"""The looped forward pass as pure functions over (params, cache segments): GPT-2 or Llama
blocks (RMSNorm, RoPE, SwiGLU, grouped-query attention), a stack of k loop blocks, Ouro's
sandwich norms, per-pass final norm and early-exit gate, Huginn's normed residuals, adjacent-pair
RoPE and concat adapter (see `recurrence`).

One function, `run_layers`, serves prefill (a chunk of T tokens), decode (T = 1) and the
extra passes of a deeper prefix. A chunk is written into its own segment, then attends to
its keys with one softmax over all of them (see `attention`):

    read-only segments (a shared prefix)  +  own segment (earlier tokens and the chunk)

(under a sliding window, whose ring buffer a long chunk may overrun, the chunk attends to
itself directly and is written after). The pre blocks run one after another; the loop
stack's passes run under `lax.fori_loop` over the stacked pass axis of the caches, so a
program's size does not depend on the depth.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import cache as kvc
from . import int4_attention as i4
from . import qarray
from . import recurrence as rec
from .attention import attention, normalize
from .cache import KVCache
from .config import ModelConfig
from .kv_modes import KVMode
from .params import Params
from .exits import Exit, ExitCarry, exit_update
from .layers import final_norm, layer_window, qkv_heads, read_kv, block_out
from .precision import exact
from .stack import Stacked, is_stacked


def embed(params: Params, tokens: jax.Array, start_pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """tokens [T] at positions start_pos + i -> the residual stream [T, D] (times embed_scale
    (Gemma) unless the model is an injection model, whose pre blocks' output is scaled where
    the recurrence starts: `run_pre`)."""
    x = qarray.take(params.wte, tokens)
    if cfg.embed_scale != 1.0 and not rec.injected(cfg):
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    if params.wpe is None:  # RoPE models: positions enter in attention
        return x
    q_pos = start_pos + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    # clamped only for tokens whose outputs are discarded (bucket padding, speculative drafts past
    # max_tokens): real positions past the table are refused on the host (`ModelConfig.check_positions`)
    return x + params.wpe[jnp.minimum(q_pos, params.wpe.shape[0] - 1)]


@exact
def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Streams [..., D] after the last pass -> float32 logits [..., V]: the final norm (already
    applied with `pass_norm`), then the head (the tied embedding unless the model has its own)."""
    if not cfg.pass_norm:
        x = final_norm(params, cfg, x)
    w = params.wte if params.head is None else params.head
    logits = qarray.head(x, w)
    if cfg.mesh is not None:  # computed where the vocabulary-split head is, then gathered once: no
        # collectives in sampling, and the head's weights never move
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(cfg.mesh, P(*[None] * (logits.ndim - 1),
                                                                                      "model")))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(cfg.mesh, P()))
    return logits if w.shape[0] == cfg.vocab_size else logits[..., :cfg.vocab_size]  # a mesh's vocabulary padding


class Chunk(NamedTuple):
    """Where a chunk of T tokens goes: q_pos [T] absolute positions; self_pos [T] the same with
    padding at -1 (so the chunk's padding is never a key); slots [T] own-segment slots (>= C:
    not stored)."""
    q_pos: jax.Array
    self_pos: jax.Array
    slots: jax.Array
    src: jax.Array  # [C] the chunk token each own slot takes (-1: none; `cache.write_sources`)


class Layer(NamedTuple):
    """One cache layer of a segment as attention reads it."""
    stored: dict  # arrays [lead, C, w] in kv_mode
    key_pos: jax.Array  # [C]
    kv_mode: KVMode


def block(x: jax.Array, blk, cfg: ModelConfig, chunk: Chunk, ro: list, own: KVCache, store: dict,
          index, window: int):
    """One transformer block on a chunk x [T, D]. ro: this layer of each read-only segment
    ([Layer]); store: own's arrays for this layer — a pre layer (index None) or the loop stack
    (index = (pass, loop block)). Returns (x', store with the chunk written)."""
    window = layer_window(window, blk)
    h, q, k, v = qkv_heads(x, blk, cfg, chunk.q_pos)
    fresh = cfg.storage.pack(h, k, v)
    if own.kv_mode != cfg.storage:
        # A call-scoped working segment (see `materialize`): store the values the model's mode
        # would give when read back, so results do not depend on where a token is kept.
        fresh = own.kv_mode.pack(h, *read_kv(cfg, fresh, blk, cfg.storage, chunk.q_pos))
    if x.shape[0] == 1 or window == 0:
        # Write first, then attend to the updated buffer: one partial softmax over the own
        # segment, the chunk included. The data dependency lets XLA update the buffer in place
        # (reading the old buffer beside the write forces a copy of it), and a prefill computes
        # the chunk's scores once, not against the old buffer and again against itself. Without
        # a window every real token of the chunk is stored (own segments are sized for them).
        store = kvc.write(store, fresh, chunk.slots, chunk.src, index)
        segs = ro + [Layer(kvc.read(store, index), kvc.write_positions(own.pos, chunk.q_pos, chunk.slots, chunk.src),
                           own.kv_mode)]
        if x.shape[0] == 1 and all(s.kv_mode.packed_int4 for s in segs):
            return block_out(x, attention_int4_decode(q, chunk.q_pos, segs, window, cfg.int4_attention, cfg.mesh),
                             blk, cfg), store
        kvs = [(*read_kv(cfg, s.stored, blk, s.kv_mode, s.key_pos), s.key_pos) for s in segs]
    else:
        # Prefill under a window: the chunk attends to itself directly (it may be longer than the
        # ring buffer), seeing its K/V exactly as a cache would hold them; then it is written.
        kvs = [(*read_kv(cfg, s.stored, blk, s.kv_mode, s.key_pos), s.key_pos) for s in ro]
        kvs.append((*read_kv(cfg, kvc.read(store, index), blk, own.kv_mode, own.pos), own.pos))
        kvs.append((*read_kv(cfg, fresh, blk, own.kv_mode, chunk.q_pos), chunk.self_pos))
        store = kvc.write(store, fresh, chunk.slots, chunk.src, index)
    return block_out(x, attention(q.astype(jnp.float32), chunk.q_pos, kvs, window), blk, cfg), store


def attention_int4_decode(q: jax.Array, q_pos: jax.Array, segs: list, window: int, impl: str,
                          mesh=None) -> jax.Array:
    """Decode (T = 1) attention over int4 segments read packed: one partial softmax per segment
    (the Pallas kernel on GPU), merged by log-sum-exp. On a mesh the kernel runs per device under
    `shard_map` over heads (XLA cannot split a custom kernel itself)."""
    qs = q[:, 0].astype(jnp.float32) * q.shape[-1] ** -0.5
    f = partial(i4.int4_attention, window=window, impl=impl)
    if mesh is not None and impl != "jnp":
        heads, rep = P("model"), P()
        f = jax.shard_map(f, mesh=mesh, in_specs=(heads, rep, heads, heads, heads, heads, rep),
                          out_specs=(heads, heads, heads), check_vma=False)
    parts = [f(qs, q_pos[0], s.stored["k"], s.stored["ks"], s.stored["v"], s.stored["vs"], s.key_pos) for s in segs]
    return normalize(parts)[:, None]


class Run(NamedTuple):
    """What `run_layers` returns."""
    x: jax.Array  # [T, D] the streams after the last pass (before the coda); injection: (state | e) [T, 2D]
    own: KVCache  # own with the chunk appended
    states: jax.Array | None  # [n_pre + loops, D] the last real token's stream after each pre block and pass
    exit_x: jax.Array  # [T, D] the streams the logits come from (after the coda; or the early exit's pick)


@exact
def run_layers(params: Params, cfg: ModelConfig, x: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
               ro: tuple, own: KVCache, loops: int, window: int, keep_states: bool = False,
               exit: Exit | None = None, seed: jax.Array | None = None) -> Run:
    """Run a chunk's stream x [T, D] through own's layers and append the chunk to `own`.

    Only the first n_valid of the T tokens are real (the rest is bucket padding); they sit at
    absolute positions start_pos + i. `own` holds either every pre layer or none (then x is the
    stream entering the first pass), and at least `loops` passes; `ro` segments (a prefix) hold
    every pre layer and at least `loops` passes. Passes 0..loops-1 run (each pass the k loop
    blocks in order, then the final norm with `pass_norm`); deeper ones are not touched. Then the
    coda blocks, whose layers every segment holds (at this depth). With a gate model and `exit`,
    `exit_x` is the exit's pick among the passes' outputs.

    Injection models (`recurrence`): x is the chunk's embeddings [T, D] (scaled here by
    embed_scale; the initial states drawn from `seed`, uint32 [], None: 0), or, when own holds
    no pre layers, the (state | e) carry [T, 2D] an earlier call returned as `Run.x`.
    """
    T, n_pre = x.shape[0], len(own.pre)
    inject = rec.injected(cfg)
    continuing = inject and x.shape[-1] == 2 * cfg.d_model
    if (n_pre not in (0, cfg.n_pre_blocks) or own.passes < loops or any(s.passes < loops for s in ro)
            or any(len(s.post) != cfg.n_post_blocks for s in (own, *ro))
            or (inject and n_pre != (0 if continuing else cfg.n_pre_blocks))):
        raise ValueError(f"segments do not fit loops={loops}: own has {n_pre} pre layers, {own.passes} passes and "
                         f"{len(own.post)} coda layers, read-only segments have {[s.passes for s in ro]} passes"
                         + (f"; an injection model takes embeddings [T, D] with every pre layer or its (state | e) "
                            f"carry [T, 2D] with none, got x {tuple(x.shape)}" if inject else ""))
    chunk = make_chunk(start_pos, n_valid, T, own.capacity)
    ring = make_chunk(start_pos, n_valid, T, own.ring_capacity) if own.rings else None
    last = jnp.maximum(n_valid - 1, 0)
    at_last = lambda x: jax.lax.dynamic_index_in_dim(x, last, axis=0, keepdims=False)  # noqa: E731
    gated = exit is not None and cfg.early_exit_gate

    x, e, pre, states = run_pre(params, cfg, x, chunk, ro, own, window, seed, continuing, ring)

    def loop_block(x, blk, stack, index):
        layers = [Layer(kvc.read(s.loop, index), s.pos, s.kv_mode) for s in ro]
        return block(x, blk, cfg, chunk, layers, own, stack, index, window)

    def post_block(y, blk, store, j):
        return block(y, blk, cfg, chunk, [Layer(s.post[j], s.pos, s.kv_mode) for s in ro], own, store, None, window)

    x, loop, passes, pick = run_passes(params, cfg, x, e, loops, own.loop, loop_block, exit if gated else None,
                                       at_last if keep_states else None)
    y, post = coda(params, cfg, x, own.post, post_block)
    new_own = own.replace(pre=tuple(pre), loop=loop, post=post,
                          pos=kvc.write_positions(own.pos, chunk.q_pos, chunk.slots, chunk.src),
                          ring_pos=None if ring is None else kvc.write_positions(own.ring_pos, ring.q_pos, ring.slots,
                                                                                 ring.src),
                          length=(start_pos + n_valid).astype(jnp.int32))
    if keep_states:
        states = jnp.concatenate([jnp.stack(states), passes]) if states else passes
    exit_x = pick if gated else y
    return Run(rec.carry(x, e) if inject else x, new_own, states if keep_states else None, exit_x)


def make_chunk(start_pos: jax.Array, n_valid: jax.Array, T: int, capacity: int) -> Chunk:
    """Where a chunk of T tokens (the first n_valid real) at start_pos goes in a segment of
    `capacity` slots."""
    q_pos = start_pos + jnp.arange(T, dtype=jnp.int32)
    return Chunk(q_pos, jnp.where(jnp.arange(T) < n_valid, q_pos, -1), kvc.write_slots(q_pos, n_valid, capacity),
                 kvc.write_sources(start_pos, n_valid, capacity))


def run_pre(params: Params, cfg: ModelConfig, x: jax.Array, chunk: Chunk, ro: tuple, own: KVCache, window: int,
            seed: jax.Array | None, continuing: bool = False, ring: Chunk | None = None):
    """The chunk through own's pre blocks (if it holds them; its ring layers written by `ring`,
    the chunk placed in their slots). Returns (the stream entering the first pass [T, D]
    (injection: the initial state), the pre blocks' output e (injection, else None), own's pre
    layers with the chunk written, the last real token's stream after each pre block ([D] each))."""
    inject = rec.injected(cfg)
    last = jnp.maximum(jnp.sum(chunk.self_pos >= 0) - 1, 0)
    if continuing:
        x, e = rec.split_carry(x)
    elif inject and cfg.embed_scale != 1.0:  # other models' embeddings are scaled by `embed`
        x = x * cfg.embed_scale
    e = e if continuing else None
    # stacked blocks over a chunk: one block in the program (a layer loop). A single token keeps
    # them unrolled: copying every pre layer in and out of the loop's stack would cost a quarter
    # of its step (SmolLM2's `decode_step`: 15 -> 19 ms)
    if is_stacked(params.pre) and own.pre and not own.rings and x.shape[0] > 1:
        x, pre, states = pre_loop(params.pre, cfg, x, chunk, ro, own, window, last)
        if inject and not continuing:
            e, x = x, rec.initial_state(cfg, seed, chunk.q_pos)
        return x, e, pre, states
    pre, states = [], []
    ring_own = own.replace(pos=own.ring_pos) if own.rings else None
    for j, store in enumerate(own.pre):
        layers = [Layer(s.pre[j], s.pre_pos(j), s.kv_mode) for s in ro]
        mine, at = (ring_own, ring) if j in own.rings else (own, chunk)
        x, store = block(x, params.pre[j], cfg, at, layers, mine, store, None, window)
        pre.append(store)
        states.append(jax.lax.dynamic_index_in_dim(x, last, axis=0, keepdims=False))
    if inject and not continuing:
        e, x = x, rec.initial_state(cfg, seed, chunk.q_pos)
    return x, e, pre, states


def pre_loop(blocks: Stacked, cfg: ModelConfig, x: jax.Array, chunk: Chunk, ro: tuple, own: KVCache, window: int,
             last: jax.Array):
    """`run_pre` over stacked blocks under `fori_loop`: own's (and each read-only segment's) pre
    layers stacked for the loop (layer j at index (j,)), a copy that is small beside the chunk's
    work, and split again after. Returns (x, own's pre layers, [D] each after each block)."""
    stacked = lambda layers: jax.tree.map(lambda *a: jnp.stack(a), *layers)  # noqa: E731
    ro_pre = [stacked(s.pre) for s in ro]

    def body(i, carry):
        x, store, states = carry
        layers = [Layer(kvc.read(p, (i,)), s.pos, s.kv_mode) for p, s in zip(ro_pre, ro)]
        x, store = block(x, blocks.at(i), cfg, chunk, layers, own, store, (i,), window)
        return x, store, states.at[i].set(jax.lax.dynamic_index_in_dim(x, last, axis=0, keepdims=False))

    states = jnp.zeros((len(blocks), x.shape[-1]), x.dtype)
    x, store, states = jax.lax.fori_loop(0, len(blocks), body, (x, stacked(own.pre), states))
    return x, list(Stacked(store)), list(states)  # (a stack's layers as views: sliced)


def one_pass(params: Params, cfg: ModelConfig, i, x: jax.Array, e: jax.Array | None, stack, loop_block,
             slot=lambda i: i):
    """Pass i (traced) of the loop stack over streams x [N, D] (injection: the state, with the pre
    blocks' output e): the pass's input, the k loop blocks in order (loop_block(x, blk, stack,
    (slot(i), j)) -> (x, stack): a storage's block, writing pass i's layers of `stack`; slot: a
    compact store's, `kv_share`), then the final norm with `pass_norm`. Every forward's pass:
    dense segments, pages, adaptive depth."""
    if e is not None:
        x = rec.pass_input(params, x, e)
    for j, blk in enumerate(params.loop):
        x, stack = loop_block(x, blk, stack, (slot(i), j))
    if cfg.pass_norm:
        x = final_norm(params, cfg, x)
    return x, stack


class Settle(NamedTuple):
    """A compact store's last word on the step's tokens (`kv_share` avg / first: what later
    tokens read is not the last pass written): acc = after(i, stack, acc) after each pass,
    from `start`; stack = end(stack, acc) after the last."""
    start: object
    after: object
    end: object


def run_passes(params: Params, cfg: ModelConfig, x: jax.Array, e: jax.Array | None, loops, stack, loop_block,
               exit: Exit | None = None, keep=None, slot=lambda i: i, settle: Settle | None = None):
    """Passes 0..loops-1 (`one_pass`; loops static, or traced) under `fori_loop`, with the early
    exit's pick among the passes' outputs (`exit`: a gate model's) and keep(x) -> [D] (or [b, D]),
    one position's (or b positions') stream after each pass; slot / settle: a compact store's (`kv_share`). Returns
    (x after the last pass, stack, kept [loops, ...] | None, the exit's pick [N, D] | None)."""
    def body(i, carry):
        x, stack, kept, sel, acc = carry
        x, stack = one_pass(params, cfg, i, x, e, stack, loop_block, slot)
        if keep is not None:
            kept = kept.at[i].set(keep(x))
        if exit is not None:
            sel = exit_update(params, exit, i, i == loops - 1, x, sel)
        if settle is not None:
            acc = settle.after(i, stack, acc)
        return x, stack, kept, sel, acc

    kept = jnp.zeros((loops, *jax.eval_shape(keep, x).shape), x.dtype) if keep is not None else None
    sel = ExitCarry.start(x) if exit is not None else None
    x, stack, kept, sel, acc = jax.lax.fori_loop(0, loops, body, (x, stack, kept, sel,
                                                                 None if settle is None else settle.start))
    if settle is not None:
        stack = settle.end(stack, acc)
    return x, stack, kept, None if sel is None else sel.pick(x)


def coda(params: Params, cfg: ModelConfig, x: jax.Array, stores: tuple, post_block):
    """After the last pass: the final norm (`norm_before_coda`), then the coda blocks
    (post_block(y, blk, store, j) -> (y, store): a storage's block). Returns (streams for the
    head, the coda's stores)."""
    y, out = (final_norm(params, cfg, x) if cfg.norm_before_coda else x), []
    for j, (blk, store) in enumerate(zip(params.post, stores)):
        y, store = post_block(y, blk, store, j)
        out.append(store)
    return y, tuple(out)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
            ro: tuple, own: KVCache, loops: int, window: int, exit: Exit | None = None,
            seed: jax.Array | None = None):
    """Embed tokens [T] (positions start_pos + i) and run them through every layer, appending
    them to `own`. `seed` (uint32 []): injection models' initial states. Returns (the streams
    the logits come from [T, D], new own)."""
    out = run_layers(params, cfg, embed(params, tokens, start_pos, cfg), n_valid, start_pos, ro, own, loops, window,
                     exit=exit, seed=seed)
    return out.exit_x, out.own


def last_logits(params: Params, cfg: ModelConfig, x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Next-token logits [V] after the last real token of streams x [T, D]."""
    return lm_head(params, cfg, jax.lax.dynamic_index_in_dim(x, jnp.maximum(n_valid - 1, 0), axis=0, keepdims=False))


@exact
def materialize(params: Params, cfg: ModelConfig, seg: KVCache, passes: int) -> KVCache:
    """The segment's first `passes` passes with K/V stored in float32 ("fp32" mode): for h modes,
    K/V rebuilt from the stored h once, so that a whole call (every decode step, every request
    of a batch) reads them instead of re-projecting h at each step."""
    kv = lambda stored, blk: dict(zip("kv", read_kv(cfg, stored, blk, seg.kv_mode, seg.pos)))  # noqa: E731
    loop = {n: a[:passes] for n, a in seg.loop.items()}  # [passes, k, ...]
    per_block = [jax.vmap(lambda e, b=b: kv(e, b))({n: a[:, j] for n, a in loop.items()})
                 for j, b in enumerate(params.loop)]
    pre = tuple(dict(zip("kv", read_kv(cfg, e, b, seg.kv_mode, seg.pre_pos(j))))
                for j, (e, b) in enumerate(zip(seg.pre, params.pre)))
    return seg.replace(pre=pre,
                       loop={n: jnp.stack([p[n] for p in per_block], axis=1) for n in "kv"},
                       post=tuple(kv(e, b) for e, b in zip(seg.post, params.post)), kv_mode="fp32")


@exact
def forward_seq(params: Params, cfg: ModelConfig, tokens: jax.Array, loops: int, window: int = 0,
                seed: jax.Array | None = None) -> jax.Array:
    """Cache-free forward over a whole sequence (training and evaluation): tokens [T] -> logits
    [T, V]. K/V pass through the kv_mode round trip, as the cached path sees them. The passes
    run under `lax.scan` (differentiable, one copy of the loop stack in the program). `seed`:
    injection models' initial states (as `run_layers`)."""
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def layer(x, blk):
        h, q, k, v = qkv_heads(x, blk, cfg, pos)
        k, v = read_kv(cfg, cfg.storage.pack(h, k, v), blk, cfg.storage, pos)  # as a cache would hold them
        return block_out(x, attention(q.astype(jnp.float32), pos, [(k, v, pos)], layer_window(window, blk)), blk, cfg)

    inject = rec.injected(cfg)
    no_store = lambda x, blk, store, _: (layer(x, blk), store)  # noqa: E731 - no cache: nothing stored
    x = embed(params, tokens, jnp.int32(0), cfg)
    if inject and cfg.embed_scale != 1.0:
        x = x * cfg.embed_scale
    if is_stacked(params.pre):  # one block in the program
        x = jax.lax.fori_loop(0, len(params.pre), lambda i, x: layer(x, params.pre.at(i)), x)
    else:
        for blk in params.pre:
            x = layer(x, blk)
    e = None
    if inject:
        e, x = x, rec.initial_state(cfg, seed, pos)
    x, _ = jax.lax.scan(lambda x, i: (one_pass(params, cfg, i, x, e, (), no_store)[0], None), x, jnp.arange(loops))
    y, _ = coda(params, cfg, x, ((),) * len(params.post), no_store)
    return lm_head(params, cfg, y)
