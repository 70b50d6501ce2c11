"""Device programs of continuous batching (`serving.Engine`): a batch of B rows that requests
join and leave between steps, over a pool of G shared prefixes.

    pool  = one read-only segment of G slots x Cp positions: [..., G * Cp, ..]  (store prefixes)
    own   = B rows' own segments, stacked:                   [B, ..., Co, ..]   (prompt rest + new)

Row i reads pool slot group[i], positions < limit[i] only (the first limit[i] tokens of a
cached prompt it shares), and its own segment, which starts at position limit[i]. The pool is
unbatched: one matmul of every row's query against all of it, each row's keys outside its slot
masked out, so a prefix is read once per step for all the rows that share it and rows with
different prefixes still share the step; a masked key contributes an exact zero. Static
arguments are shapes only: one program per (B, Co, G * Cp, chunk) bucket, whatever the
requests are.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..model import transformer as tf
from ..model.cache import KVCache, copy_prefix
from ..model.config import ModelConfig
from ..decoding.programs import rows_in_loop, rows_out_of_loop
from ..model.params import Params
from ..decoding.sampling import Request, select_tokens

__all__ = ["decode_step", "prefill_chunk", "prefill_slot", "load_slot", "slot_prefix", "reshape_rows",
           "reset_row"]


def row(tree, i):
    """Row i of a stacked pytree (dynamic i)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), tree)


def set_row(tree, i, value):
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, axis=0), tree, value)


def visible_pool(pool: KVCache, slot_len: int, group: jax.Array, limit: jax.Array) -> KVCache:
    """The pool as one row sees it: slot `group`'s keys below `limit`, nothing else (positions
    -1 are never visible). The pool is one segment whose slot g is the slot range
    [g * slot_len, (g + 1) * slot_len)."""
    mine = (jnp.arange(pool.capacity) // slot_len == group) & (pool.pos >= 0) & (pool.pos < limit)
    return pool.replace(pos=jnp.where(mine, pool.pos, -1))


def pool_slot(pool: KVCache, slot_len: int, group: jax.Array) -> KVCache:
    """Slot `group` of the pool as a segment of its own (slot_len slots)."""
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, group * slot_len, slot_len, axis=a.ndim - 2)  # noqa: E731
    return KVCache(pre=tuple({n: take(a) for n, a in e.items()} for e in pool.pre),
                   loop={n: take(a) for n, a in pool.loop.items()},
                   pos=jax.lax.dynamic_slice_in_dim(pool.pos, group * slot_len, slot_len), length=pool.length,
                   kv_mode=pool.kv_mode, post=tuple({n: take(a) for n, a in e.items()} for e in pool.post))


def pool_slots(pool: KVCache, slot_len: int, ids: jax.Array) -> KVCache:
    """The pool's slots ids [S] side by side, as one segment of S * slot_len positions."""
    parts = [pool_slot(pool, slot_len, ids[j]) for j in range(ids.shape[0])]
    if len(parts) == 1:
        return parts[0]
    cat = lambda *a: jnp.concatenate(a, axis=a[0].ndim - 2)  # noqa: E731
    out = jax.tree.map(cat, *[p.replace(pos=p.pos[:, None], length=None) for p in parts])
    return out.replace(pos=out.pos[:, 0], length=parts[0].length)


@partial(jax.jit, static_argnames=("cfg", "loops", "slot_len"), donate_argnames=("own", "seen"))
def decode_step(params: Params, cfg: ModelConfig, pool: KVCache, slot_ids: jax.Array, own: KVCache, last: jax.Array,
                group: jax.Array, limit: jax.Array, active: jax.Array, seen: jax.Array, req: Request, steps: jax.Array,
                loops: int, slot_len: int, exit: tf.Exit | None = None):
    """One token for every active row: feed last [B] at each row's next position, choose the next
    token (row i's key index steps[i]). The step reads the pool slots slot_ids [S] (group[i]
    indexes slot_ids; S = all G slots reads the pool in place, slot_ids = 0..G-1). Inactive rows (free, or still
    prefilling) keep their segment: their write goes to an empty slot and their positions are
    restored. Returns (tokens [B], own, seen [B, V])."""
    if slot_ids.shape[0] < pool.capacity // slot_len:  # a few slots: their copy is cheaper than the rest
        pool = pool_slots(pool, slot_len, slot_ids)
    seen = jnp.where(active[:, None], seen.at[jnp.arange(last.shape[0]), last].set(True), seen)

    def one(tok, g, k, o):
        ro = (visible_pool(pool, slot_len, g, k),)  # the K/V are shared by all rows: read once
        x, o = tf.forward(params, cfg, tok[None], jnp.int32(1), o.length, ro, o, loops, 0, exit)
        return x[0], o

    carried = rows_in_loop(own)  # one row unbatched: in-place cache writes (see engine.rows_in_loop)
    if carried.length.ndim == 0:
        x, new = one(last[0], group[0], limit[0], carried)
        x, new = x[None], rows_out_of_loop(new)
    else:
        x, new = jax.vmap(one)(last, group, limit, own)
    new = new.replace(pos=jnp.where(active[:, None], new.pos, own.pos), length=jnp.where(active, new.length,
                                                                                          own.length))
    tok = select_tokens(tf.lm_head(params, cfg, x), seen, req, steps)
    return tok, new, seen


@partial(jax.jit, static_argnames=("cfg", "loops", "slot_len"), donate_argnames=("own", "seen"))
def prefill_chunk(params: Params, cfg: ModelConfig, pool: KVCache, own: KVCache, i: jax.Array, tokens: jax.Array,
                  n_valid: jax.Array, start: jax.Array, fresh: jax.Array, group: jax.Array, limit: jax.Array,
                  seen: jax.Array, prompt_seen: jax.Array, req: Request, loops: int, slot_len: int,
                  exit: tf.Exit | None = None):
    """Append tokens[:n_valid] (tokens [T]) of row i's prompt at positions start + j, reading pool
    slot `group` below `limit` (group < 0: no prefix). fresh: the row's first chunk (its segment
    is emptied first). Also sets the row's `seen` to prompt_seen [V] and picks its first token
    from the chunk's last logits (used after the prompt's last chunk; req: the row's request, one
    row). Returns (first token [], logits [V], depth states [n_pre + loops, D], own, seen)."""
    o = row(own, i)
    o = o.replace(pos=jnp.where(fresh, -1, o.pos), length=jnp.where(fresh, start, o.length))
    slot = pool_slot(pool, slot_len, jnp.maximum(group, 0))
    slot = slot.replace(pos=jnp.where((group >= 0) & (slot.pos < limit), slot.pos, -1))
    run = tf.run_layers(params, cfg, tf.embed(params, tokens, start), n_valid, start, (slot,), o, loops, 0,
                        keep_states=True, exit=exit)
    logits = tf.last_logits(params, cfg, run.exit_x, n_valid)
    tok = select_tokens(logits[None], prompt_seen[None], req, jnp.int32(0))[0]
    seen = jax.lax.dynamic_update_index_in_dim(seen, prompt_seen, i, axis=0)
    return tok, logits, run.states, set_row(own, i, run.own), seen


def put_slot(pool: KVCache, g: jax.Array, seg: KVCache, slot_len: int) -> KVCache:
    """The pool with slot g replaced by seg (slot_len slots)."""
    put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), g * slot_len,  # noqa: E731
                                                           axis=a.ndim - 2)
    return KVCache(pre=tuple({k: put(a[k], b[k]) for k in a} for a, b in zip(pool.pre, seg.pre)),
                   loop={k: put(pool.loop[k], seg.loop[k]) for k in pool.loop},
                   pos=jax.lax.dynamic_update_slice_in_dim(pool.pos, seg.pos, g * slot_len, axis=0),
                   length=pool.length, kv_mode=pool.kv_mode,
                   post=tuple({k: put(a[k], b[k]) for k in a} for a, b in zip(pool.post, seg.post)))


@partial(jax.jit, static_argnames=("cfg", "passes", "materialize", "slot_len"), donate_argnames=("pool",))
def load_slot(params: Params, cfg: ModelConfig, pool: KVCache, g: jax.Array, src: KVCache, n: jax.Array, passes: int,
              materialize: bool, slot_len: int) -> KVCache:
    """Pool slot g <- the first n positions of segment src (n <= slot_len; n = 0 empties it), its
    first `passes` passes; h modes rebuild K/V to float32 once here (`materialize`)."""
    if materialize:
        src = tf.materialize(params, cfg, src, passes)
    seg = copy_prefix(src, n, capacity=slot_len, passes=passes)  # slot p holds position p
    return put_slot(pool, g, seg, slot_len)


@partial(jax.jit, static_argnames=("cfg", "loops", "slot_len"), donate_argnames=("pool", "seen"))
def prefill_slot(params: Params, cfg: ModelConfig, pool: KVCache, seen: jax.Array, i: jax.Array, g: jax.Array,
                 tokens: jax.Array, n_valid: jax.Array, start: jax.Array, prompt_seen: jax.Array, req: Request,
                 loops: int, slot_len: int, exit: tf.Exit | None = None):
    """A chunk of row i's prompt written into pool slot g (which holds positions < start): a
    long prompt becomes a pooled prefix as it is prefilled, and the row's own segment holds
    only what it generates. Returns (first token [], logits [V], depth states, pool, seen)."""
    slot = pool_slot(pool, slot_len, g).replace(length=start)
    run = tf.run_layers(params, cfg, tf.embed(params, tokens, start), n_valid, start, (), slot, loops, 0,
                        keep_states=True, exit=exit)
    logits = tf.last_logits(params, cfg, run.exit_x, n_valid)
    tok = select_tokens(logits[None], prompt_seen[None], req, jnp.int32(0))[0]
    seen = jax.lax.dynamic_update_index_in_dim(seen, prompt_seen, i, axis=0)
    return tok, logits, run.states, put_slot(pool, g, run.own, slot_len), seen


@partial(jax.jit, static_argnames=("capacity", "slot_len"))
def slot_prefix(pool: KVCache, g: jax.Array, n: jax.Array, capacity: int, slot_len: int) -> KVCache:
    """Pool slot g's first n positions as a segment of its own, `capacity` slots (a copy, for
    the prefix store)."""
    return copy_prefix(pool_slot(pool, slot_len, g), n, capacity=capacity, passes=pool.passes)


@partial(jax.jit, donate_argnames=("own",))
def reset_row(own: KVCache, i: jax.Array, start: jax.Array) -> KVCache:
    """Row i's own segment emptied, its next position `start`."""
    return own.replace(pos=own.pos.at[i].set(-1), length=own.length.at[i].set(start))


def reslot(o: KVCache, capacity: int) -> KVCache:
    """One own segment moved to `capacity` slots (position p to slot p % capacity); its
    positions must span at most `capacity`."""
    tgt = jnp.where(o.pos >= 0, o.pos % capacity, capacity)  # empty slots: dropped

    def move(a):  # [..., C, w]
        out = jnp.zeros(a.shape[:-2] + (capacity, a.shape[-1]), a.dtype)
        return out.at[..., tgt, :].set(a, mode="drop")

    return KVCache(pre=tuple({k: move(a) for k, a in e.items()} for e in o.pre),
                   loop={k: move(a) for k, a in o.loop.items()},
                   pos=jnp.full((capacity,), -1, jnp.int32).at[tgt].set(o.pos, mode="drop"), length=o.length,
                   kv_mode=o.kv_mode, post=tuple({k: move(a) for k, a in e.items()} for e in o.post))


@partial(jax.jit, static_argnames=("capacity",))
def reshape_rows(own: KVCache, seen: jax.Array, idx: jax.Array, capacity: int):
    """The batch as rows idx [B'] (a batch grown or compacted; an index past the end gives a row
    that is reset before use), each moved to `capacity` slots."""
    own, seen = jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode="clip"), (own, seen))
    return jax.vmap(lambda o: reslot(o, capacity))(own), seen
