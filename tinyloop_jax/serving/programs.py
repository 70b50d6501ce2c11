"""Device programs of continuous batching (`serving.Engine`): a batch of B rows that requests
join and leave between steps, over a pool of G shared prefixes — the engine API the driver
(`engine.Engine`) calls, over one opaque `BatchState` per depth.

    pool  = one read-only segment of G slots x Cp positions: [..., G * Cp, ..]  (store prefixes)
    own   = B rows' own segments, stacked:                   [B, ..., Co, ..]   (prompt rest + new)

Row i reads pool slot group[i], positions < limit[i] only (the first limit[i] tokens of a
cached prompt it shares), and its own segment, which starts at position limit[i]. The pool is
unbatched: one matmul of every row's query against all of it, each row's keys outside its slot
masked out, so a prefix is read once per step for all the rows that share it and rows with
different prefixes still share the step; a masked key contributes an exact zero. Static
arguments are shapes only: one program per (B, Co, G * Cp, chunk) bucket, whatever the
requests are. The steps take and return the whole `BatchState`, donated: the parts a step does
not change (the pool, the request rows) pass through in place, never copied.
"""

from __future__ import annotations

import functools

from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..model import adaptive as ad
from ..model import transformer as tf
from ..model.cache import KVCache, copy_prefix
from ..model.config import ModelConfig
from ..decoding.programs import rows_in_loop, rows_out_of_loop
from ..model.params import Params
from ..decoding.sampling import Request, select_tokens

__all__ = ["BatchState", "Chunk", "DecodeRows", "decode_step", "decode_step_adaptive", "prefill_chunk",
           "prefill_slot", "load_slot",
           "slot_prefix", "reshape_rows", "reset_row", "pool_slot"]


@struct.dataclass
class BatchState:
    """One lane's device state: its rows and the pool of prefixes they read. The row fields are
    None while the lane has no rows (its buffers released); the pool stays."""

    pool: KVCache  # [G * Cp] slots of shared prefixes, in the working mode
    own: KVCache | None = None  # [B, .., Co, ..] the rows' own segments (prompt rest + generated)
    seen: Annotated[jax.Array, "bool[B, V]"] | None = None  # tokens of each row's prompt and output
    counts: Annotated[jax.Array, "int32[B, V]"] | None = None  # each row's output, per token (fed so far)
    last: Annotated[jax.Array, "int32[B]"] | None = None  # each row's last token (the next step's input)
    req: Request | None = None  # [B] each row's sampling knobs (stops are checked on the host)
    pol: ad.Policy | None = None  # [B] each row's exit rule (adaptive depth; kind NONE: every pass)
    warm: Annotated[jax.Array, "[B, D]"] | None = None  # each row's last state (continuous compute)


@struct.dataclass
class Chunk:
    """One prefill step's inputs: a chunk of row `row`'s prompt. Made by `Chunk.make` (host
    numpy), so serving and warmup give the programs the same types."""

    row: Annotated[jax.Array, "int32[]"]
    tokens: Annotated[jax.Array, "int32[T]"]  # padded to a bucket
    n_valid: Annotated[jax.Array, "int32[]"]  # tokens[:n_valid] are the prompt's
    start: Annotated[jax.Array, "int32[]"]  # position of tokens[0]
    fresh: Annotated[jax.Array, "bool[]"]  # the row's first chunk: its segment is emptied first
    group: Annotated[jax.Array, "int32[]"]  # pool slot read (prefill_chunk) or written (prefill_slot); -1: none
    limit: Annotated[jax.Array, "int32[]"]  # slot positions below it are read
    prompt_seen: Annotated[jax.Array, "bool[V]"]  # the prompt's tokens
    req: Request  # [1] the row's knobs
    pol: ad.Policy  # [] the row's exit rule

    @classmethod
    def make(cls, row: int, tokens, n_valid: int, start: int, fresh: bool, group: int, limit: int, prompt_seen,
             req: Request, pol: ad.Policy | None = None) -> "Chunk":
        i32 = lambda v: np.asarray(v, np.int32)  # noqa: E731
        pol = ad.EVERY_PASS if pol is None else pol
        return cls(i32(row), i32(tokens), i32(n_valid), i32(start), np.asarray(fresh, bool), i32(group), i32(limit),
                   np.asarray(prompt_seen, bool), req, jax.tree.map(np.asarray, pol))


@struct.dataclass
class DecodeRows:
    """One decode step's inputs (host numpy, made by `lane.decode_rows`)."""

    slot_ids: Annotated[jax.Array, "int32[S]"]  # the pool slots the step reads (S = G: all, in place)
    group: Annotated[jax.Array, "int32[B]"]  # row i reads slot_ids[group[i]]; -1: no slot
    limit: Annotated[jax.Array, "int32[B]"]  # of which the positions below limit[i]
    active: Annotated[jax.Array, "bool[B]"]  # rows past their prompt (others keep their state)
    steps: Annotated[jax.Array, "int32[B]"]  # each row's token index (its sampling key)


def program(static_argnames=(), donate_argnames=()):
    """`jax.jit` with these options, kept on the function so `copy_of` can make another."""
    def deco(fn):
        f = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
        f.jit_options = dict(static_argnames=static_argnames, donate_argnames=donate_argnames)
        return f
    return deco


def copy_of(f):
    """A new jit of program f over a new function object: JAX keeps a program's trace, lowering
    and executable in caches keyed (weakly) by the function, so the programs a copy compiled are
    freed with the copy (megabytes each) — a serving lane holds its own. Anything else (a test's
    stand-in) is returned as it is."""
    opts = getattr(f, "jit_options", None)
    if opts is None:
        return f
    fn = f.__wrapped__

    @functools.wraps(fn)
    def fresh(*args, **kwargs):
        return fn(*args, **kwargs)
    return jax.jit(fresh, **opts)


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


@program(static_argnames=("slot_len",))
def slot_of(pool: KVCache, group: jax.Array, slot_len: int) -> KVCache:
    """`pool_slot` as a program of its own (a copy of the slot)."""
    return pool_slot(pool, slot_len, group)


def pool_slots(pool: KVCache, slot_len: int, ids: jax.Array) -> KVCache:
    """The pool's slots ids [S] side by side, as one segment of S * slot_len positions."""
    parts = [pool_slot(pool, slot_len, ids[j]) for j in range(ids.shape[0])]
    if len(parts) == 1:
        return parts[0]
    cat = lambda *a: jnp.concatenate(a, axis=a[0].ndim - 2)  # noqa: E731
    out = jax.tree.map(cat, *[p.replace(pos=p.pos[:, None], length=None) for p in parts])
    return out.replace(pos=out.pos[:, 0], length=parts[0].length)


def step_inputs(state: BatchState, rows: DecodeRows, slot_len: int):
    """What every decode step starts from: the pool it reads (the slots rows.slot_ids only,
    when a few: their copy is cheaper than the rest), and seen / counts with each active row's
    last token fed."""
    pool, last, active = state.pool, state.last, rows.active
    if rows.slot_ids.shape[0] < pool.capacity // slot_len:
        pool = pool_slots(pool, slot_len, rows.slot_ids)
    b = jnp.arange(last.shape[0])
    seen = jnp.where(active[:, None], state.seen.at[b, last].set(True), state.seen)
    return pool, seen, state.counts.at[b, last].add(active.astype(jnp.int32))


def keep_inactive(new: KVCache, own: KVCache, active: jax.Array) -> KVCache:
    """Rows that did not step (active [B] False) keep their positions and length (their write
    went to a slot their positions do not reach)."""
    return new.replace(pos=jnp.where(active[:, None], new.pos, own.pos), length=jnp.where(active, new.length,
                                                                                           own.length))


@program(static_argnames=("cfg", "loops", "slot_len"), donate_argnames=("state",))
def decode_step(params: Params, cfg: ModelConfig, state: BatchState, rows: DecodeRows, loops: int, slot_len: int,
                exit: tf.Exit | None = None) -> tuple[jax.Array, BatchState]:
    """One token for every active row: feed state.last [B] at each row's next position, choose
    the next token (row i's key index rows.steps[i]). The step reads the pool slots
    rows.slot_ids [S] (S = all G slots reads the pool in place). Inactive rows (free, or still
    prefilling) keep their segment: their write goes to an empty slot and their positions are
    restored. Returns (tokens [B], state with own, seen and last advanced)."""
    pool, seen, counts = step_inputs(state, rows, slot_len)
    last, own, active = state.last, state.own, rows.active

    def one(tok, g, k, o):
        ro = (visible_pool(pool, slot_len, g, k),)  # the K/V are shared by all rows: read once
        x, o = tf.forward(params, cfg, tok[None], jnp.int32(1), o.length, ro, o, loops, 0, exit)
        return x[0], o

    carried = rows_in_loop(own)  # one row unbatched: in-place cache writes (see decoding.programs.rows_in_loop)
    if carried.length.ndim == 0:
        x, new = one(last[0], rows.group[0], rows.limit[0], carried)
        x, new = x[None], rows_out_of_loop(new)
    else:
        x, new = jax.vmap(one)(last, rows.group, rows.limit, own)
    new = keep_inactive(new, own, active)
    tok = select_tokens(tf.lm_head(params, cfg, x), seen, state.req, rows.steps, counts)
    return tok, state.replace(own=new, seen=seen, counts=counts, last=jnp.where(active, tok, last))


@program(static_argnames=("cfg", "loops", "slot_len"), donate_argnames=("state",))
def decode_step_adaptive(params: Params, cfg: ModelConfig, state: BatchState, rows: DecodeRows, loops: int,
                         slot_len: int) -> tuple[jax.Array, jax.Array, BatchState]:
    """`decode_step` with adaptive depth: each row's passes stop at its exit (state.pol; rows
    without a rule run every pass), the step ends when the last row exits. Initial loop states
    are drawn from seed 0, as the engine's other programs draw them. Returns (tokens [B],
    passes run [B], state)."""
    pool, seen, counts = step_inputs(state, rows, slot_len)
    last, own, active = state.last, state.own, rows.active
    out = ad.forward_rows(params, cfg, last[:, None], jnp.ones_like(last), jnp.atleast_1d(own.length), (),
                          rows_in_loop(own), loops, 0, state.pol, jnp.zeros_like(state.req.seed), state.warm,
                          ro_fn=lambda g, k: (visible_pool(pool, slot_len, g, k),), ro_args=(rows.group, rows.limit))
    new = keep_inactive(rows_out_of_loop(out.own), own, active)
    tok = select_tokens(out.logits, seen, state.req, rows.steps, counts)
    warm = jnp.where(active[:, None], out.state.astype(state.warm.dtype), state.warm)
    return tok, out.depth, state.replace(own=new, seen=seen, counts=counts, last=jnp.where(active, tok, last),
                                         warm=warm)


def _first_token(state: BatchState, c: Chunk, tok: jax.Array, states: jax.Array) -> BatchState:
    """Row c.row after a prompt chunk: its seen set to the prompt's tokens, no output counted,
    its knobs, exit rule, last state (states [n_pre + loops, D]: the chunk's last token's) and
    its (first) token in place; the host uses the token after the prompt's last chunk only."""
    i = c.row
    return state.replace(seen=jax.lax.dynamic_update_index_in_dim(state.seen, c.prompt_seen, i, axis=0),
                         counts=state.counts.at[i].set(0), last=state.last.at[i].set(tok),
                         req=set_row(state.req, i, row(c.req, 0)), pol=set_row(state.pol, i, c.pol),
                         warm=state.warm.at[i].set(states[-1].astype(state.warm.dtype)))


@program(static_argnames=("cfg", "loops", "slot_len"), donate_argnames=("state",))
def prefill_chunk(params: Params, cfg: ModelConfig, state: BatchState, c: Chunk, loops: int, slot_len: int,
                  exit: tf.Exit | None = None):
    """Append c.tokens[:c.n_valid] ([T]) of row c.row's prompt at positions c.start + j into its
    own segment, reading pool slot c.group below c.limit (group < 0: no prefix); c.fresh: the
    row's first chunk (its segment is emptied first). Picks the row's first token from the
    chunk's last logits (meaningful after the prompt's last chunk). Returns (first token [],
    logits [V], depth states [n_pre + loops, D], state)."""
    i = c.row
    o = row(state.own, i)
    o = o.replace(pos=jnp.where(c.fresh, -1, o.pos), length=jnp.where(c.fresh, c.start, o.length))
    slot = pool_slot(state.pool, slot_len, jnp.maximum(c.group, 0))
    slot = slot.replace(pos=jnp.where((c.group >= 0) & (slot.pos < c.limit), slot.pos, -1))
    run = tf.run_layers(params, cfg, tf.embed(params, c.tokens, c.start), c.n_valid, c.start, (slot,), o, loops, 0,
                        keep_states=True, exit=exit)
    logits = tf.last_logits(params, cfg, run.exit_x, c.n_valid)
    tok = select_tokens(logits[None], c.prompt_seen[None], c.req, jnp.int32(0))[0]
    state = _first_token(state.replace(own=set_row(state.own, i, run.own)), c, tok, run.states)
    return tok, logits, run.states, state


def put_slot(pool: KVCache, g: jax.Array, seg: KVCache, slot_len: int) -> KVCache:
    """The pool with slot g replaced by seg (slot_len slots)."""
    put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), g * slot_len,  # noqa: E731
                                                           axis=a.ndim - 2)
    return KVCache(pre=tuple({k: put(a[k], b[k]) for k in a} for a, b in zip(pool.pre, seg.pre)),
                   loop={k: put(pool.loop[k], seg.loop[k]) for k in pool.loop},
                   pos=jax.lax.dynamic_update_slice_in_dim(pool.pos, seg.pos, g * slot_len, axis=0),
                   length=pool.length, kv_mode=pool.kv_mode,
                   post=tuple({k: put(a[k], b[k]) for k in a} for a, b in zip(pool.post, seg.post)))


@program(static_argnames=("cfg", "passes", "materialize", "slot_len"), donate_argnames=("pool",))
def load_slot(params: Params, cfg: ModelConfig, pool: KVCache, g: jax.Array, src: KVCache, n: jax.Array, passes: int,
              materialize: bool, slot_len: int) -> KVCache:
    """Pool slot g <- the first n positions of segment src (n <= slot_len; n = 0 empties it), its
    first `passes` passes; h modes rebuild K/V to float32 once here (`materialize`)."""
    if materialize:
        src = tf.materialize(params, cfg, src, passes)
    seg = copy_prefix(src, n, capacity=slot_len, passes=passes)  # slot p holds position p
    return put_slot(pool, g, seg, slot_len)


@program(static_argnames=("cfg", "loops", "slot_len"), donate_argnames=("state",))
def prefill_slot(params: Params, cfg: ModelConfig, state: BatchState, c: Chunk, loops: int, slot_len: int,
                 exit: tf.Exit | None = None):
    """A chunk of row c.row's prompt written into pool slot c.group (which holds positions <
    c.start): a long prompt becomes a pooled prefix as it is prefilled, and the row's own
    segment holds only what it generates. Returns (first token [], logits [V], depth states,
    state)."""
    slot = pool_slot(state.pool, slot_len, c.group).replace(length=c.start)
    run = tf.run_layers(params, cfg, tf.embed(params, c.tokens, c.start), c.n_valid, c.start, (), slot, loops, 0,
                        keep_states=True, exit=exit)
    logits = tf.last_logits(params, cfg, run.exit_x, c.n_valid)
    tok = select_tokens(logits[None], c.prompt_seen[None], c.req, jnp.int32(0))[0]
    state = _first_token(state.replace(pool=put_slot(state.pool, c.group, run.own, slot_len)), c, tok, run.states)
    return tok, logits, run.states, state


@program(static_argnames=("capacity", "slot_len"))
def slot_prefix(pool: KVCache, g: jax.Array, n: jax.Array, capacity: int, slot_len: int) -> KVCache:
    """Pool slot g's first n positions as a segment of its own, `capacity` slots (a copy, for
    the prefix store)."""
    return copy_prefix(pool_slot(pool, slot_len, g), n, capacity=capacity, passes=pool.passes)


@program(donate_argnames=("state",))
def reset_row(state: BatchState, i: jax.Array, start: jax.Array) -> BatchState:
    """Row i's own segment emptied, its next position `start`."""
    own = state.own
    return state.replace(own=own.replace(pos=own.pos.at[i].set(-1), length=own.length.at[i].set(start)))


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


@program(static_argnames=("capacity",))
def take_rows(rows: tuple, idx: jax.Array, capacity: int) -> tuple:
    own, *rest = jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode="clip"), rows)
    return (jax.vmap(lambda o: reslot(o, capacity))(own), *rest)


def reshape_rows(state: BatchState, idx: jax.Array, capacity: int, take=take_rows) -> BatchState:
    """The batch as rows idx [B'] (a batch grown or compacted; an index past the end gives a
    row that is reset before use), each moved to `capacity` slots (by `take`: `take_rows` or a
    copy of it). The pool is left as it is (rows change shape, so nothing is donated)."""
    own, seen, counts, last, req, pol, warm = take((state.own, state.seen, state.counts, state.last, state.req,
                                                    state.pol, state.warm), idx, capacity=capacity)
    return state.replace(own=own, seen=seen, counts=counts, last=last, req=req, pol=pol, warm=warm)
