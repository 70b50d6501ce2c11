"""Adaptive depth on pages: b rows, a prompt chunk or one decode token each, whose passes stop
at their exits (`adaptive`'s criteria and rules, on `paged`'s pool). A chunk exits as a whole
at one depth: latent criteria average over its real positions, logit criteria and the gate look
at its last one.

The pass loop is a `lax.while_loop` whose trip count is data: rows that exited keep their
state (masked) until the last row exits; the coda runs at checks that need logits (its K/V
written only for the rows that needed it); at the end the passes a row skipped take, in its
page, the K/V of its last computed pass of the same loop block — what a token that exited
offers the later tokens that run deeper (the reference's rule, as `adaptive.fill_skipped`).

A long chunk (a prompt exiting in prefill) may run each pass a block of positions at a time
(`forward(block=...)`), over as many blocks as its rows fill: pass i of a block reads pass i of
the blocks before it from the pages, so it gives what the chunk run whole gives, and one
program serves every length up to its buffer's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import adaptive as ad
from . import paged
from . import page_pool
from . import recurrence as rec
from . import transformer as tf
from . import exits
from . import kv_share
from .precision import exact
from .config import ModelConfig
from .params import Params


class Out(NamedTuple):
    logits: jax.Array  # [b, V] next-token logits
    pool: page_pool.PagedKV
    depth: jax.Array  # [b] int32 passes run
    state: jax.Array  # [b, D] the state where each row stopped (continuous compute)


def fill_skipped(stack: dict, page: jax.Array, off: jax.Array, depth: jax.Array, loops: int) -> dict:
    """Passes depth[i]..loops-1 of row i's token (at page[i], off[i]) take pass depth[i]-1's K/V."""
    def one(a):  # [L, k, lead, NP, P, w]
        col = a[:, :, :, page, off]  # [L, k, lead, b, w]
        last = jnp.take_along_axis(col, jnp.maximum(depth - 1, 0)[None, None, None, :, None], axis=0)
        p = jnp.arange(a.shape[0])[:, None, None, None, None]
        col = jnp.where((p >= depth[None, None, None, :, None]) & (p < loops), last, col)
        return a.at[:, :, :, page, off].set(col, mode="drop")
    return {n: one(a) for n, a in stack.items()}


def settle_exits(stack: dict, share, x: tuple, depth: jax.Array, loops: int, g: paged.Group, mode) -> dict:
    """A compact pool after an adaptive step: what later tokens read of each token that ran
    `depth` [N] passes, as if its skipped passes had been filled with its last one and the
    token then collapsed (`fill_skipped`, then `kv_share.collapse`): ring: the slots some
    skipped pass writes take its last pass's K/V (the others keep the latest pass run there);
    avg: the mean over `loops` passes, the skipped ones its last; first: pass 0."""
    kept, acc, first = x
    k = len(kept)
    if share.kind == "ring":
        for sl in range(share.m):
            f = kv_share.filled(share, sl, depth, loops)[None, :, None]
            for j in range(k):
                cur = kv_share.take_at(stack, j, g.page, g.off, sl)
                stack = kv_share.put_at(stack, j, g.page, g.off, {n: jnp.where(f, kept[j][n], a)
                                                                  for n, a in cur.items()}, sl)
        return stack
    for j in range(k):
        if share.kind == "avg":
            rest = (loops - depth).astype(jnp.float32)[None, :, None]
            (sk, sv), (lk, lv) = acc[j], mode.unpack(kept[j], None)
            value = mode.pack(None, (sk + rest * lk) / loops, (sv + rest * lv) / loops)
        else:
            value = first[j]
        stack = kv_share.put_at(stack, j, g.page, g.off, value)
    return stack


@exact
def forward(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, rows: paged.Rows, tokens: jax.Array,
            loops: int, pol: ad.Policy, seeds: jax.Array, warm: jax.Array | None = None,
            block: int | None = None) -> Out:
    """Rows' chunks tokens [b, T] (row i's first rows.n_new[i] real, at rows.start[i]; 0: a
    filler row) with adaptive depth: pol [b] each row's exit rule (kind NONE: every pass), seeds
    [b] uint32 (initial states), warm [b, D]: the state a continuous-compute row starts from.
    Logits and states are each row's last real token's. block (static; T a multiple of it): each
    pass runs over the chunk a block of positions at a time, as many blocks as the longest row
    fills (a `while_loop`), so one program serves every length up to T: pass i of block k reads
    pass i of the blocks before it from the pages, as the whole chunk would (a prompt exiting
    in prefill, `step.step(in_prefill=True)`); the pages must hold every pass (not a compact
    kv_share store). None: the chunk as one block."""
    b, T = tokens.shape
    T0 = T if block is None else block
    n_blocks = T // T0  # (static: the most a row may fill)
    if T % T0 or (n_blocks > 1 and not pool.share.full):
        raise ValueError(f"a chunk of {T} positions in blocks of {block} (on pages that hold every pass)")
    V = cfg.vocab_size
    n = rows.n_new
    last = jnp.maximum(n - 1, 0)
    count = jnp.maximum(n, 1).astype(jnp.float32)  # positions a latent criterion averages over
    inject = rec.injected(cfg)
    vm = jax.vmap

    def part(k):  # block k's rows: the Group its tokens make
        if n_blocks == 1:
            return paged.Group.of(rows, T, pool)
        return paged.Group.of(rows.replace(start=rows.start + k * T0, n_new=jnp.clip(n - k * T0, 0, T0)), T0, pool)

    def blk(a, k):  # [b, T, ...] -> block k, [b, T0, ...]
        return a if n_blocks == 1 else jax.lax.dynamic_slice_in_dim(a, k * T0, T0, axis=1)

    def put(a, k, v):  # block k of a [b, T, ...] set to v [b, T0, ...]
        return v if n_blocks == 1 else jax.lax.dynamic_update_slice_in_dim(a, v.astype(a.dtype), k * T0, axis=1)

    nb = jnp.maximum(1, (jnp.max(n) + T0 - 1) // T0)

    def blocks(fn, carry, first: int = 0):  # fn(k, carry) over the blocks the rows fill
        return fn(0, carry) if n_blocks == 1 else jax.lax.fori_loop(first, nb, fn, carry)

    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731 - [b, T0, ..] -> [b T0, ..]
    rowwise = lambda a: a.reshape((b, T0) + a.shape[1:])  # noqa: E731 - [b T0, ..] -> [b, T0, ..]
    at_last = lambda a: a[jnp.arange(b), last]  # noqa: E731 - [b, T, ..] -> [b, ..]

    def pre(k, pool):  # block k's tokens through the pre blocks: (stream, initial state) [b, T0, D]
        g = part(k)
        x = paged.embed(params, flat(blk(tokens, k)), g.pos.reshape(-1), cfg)
        if inject and cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        x, pool = paged.run_pre(params, cfg, paged.unreal_zeroed(x, (g,)), (g,), pool, 0)
        s0 = vm(lambda sd, p: rec.initial_state(cfg, sd, p))(seeds, g.pos) if inject else None
        return rowwise(x), s0, pool

    x, s0, pool = pre(0, pool)
    if n_blocks > 1:  # (the buffers of every position; block 0 in place, then the rest)
        full = lambda a: None if a is None else jnp.zeros((b, T) + a.shape[2:], a.dtype).at[:, :T0].set(a)  # noqa: E731

        def more(k, carry):
            xs, ss, pool = carry
            x, s0, pool = pre(k, pool)
            return put(xs, k, x), None if ss is None else put(ss, k, s0), pool
        x, s0, pool = blocks(more, (full(x), full(s0), pool), first=1)
    e, s = (x, s0) if inject else (None, x)
    if inject and warm is not None:
        s = jnp.where(pol.warm[:, None, None], warm[:, None].astype(s.dtype), s)
    judge = vm(lambda a: ad.Judge.start(a, V))(s)

    def coda_logits(s, post, need):
        """The coda over every block (its K/V kept only where `need`) and the logits [b, V]."""
        def one(k, carry):
            post, y_last = carry
            g = part(k)
            old = [{n: a[:, g.page, g.off] for n, a in store.items()} for store in post]
            y, new = tf.coda(params, cfg, flat(blk(s, k)), post, lambda y, bk, store, j: paged.block(
                y, bk, cfg, (g,), store, None, 0, pool.kv_mode))
            keep = lambda n, o: jnp.where(jnp.repeat(need, T0)[None, :, None], n, o)  # noqa: E731
            new = tuple(page_pool.write(store, {n: keep(store[n][:, g.page, g.off], o[n]) for n in store}, g.page,
                                        g.off) for store, o in zip(new, old))
            mine = last // T0 == k  # rows whose last real position is in this block
            return new, jnp.where(mine[:, None], rowwise(y)[jnp.arange(b), last % T0], y_last)
        post, y = blocks(one, (tuple(post), jnp.zeros((b, s.shape[-1]), s.dtype)))
        return tf.lm_head(params, cfg, y), post

    def gate_prob(s):
        return exits.gate(params, at_last(s)) if cfg.early_exit_gate else jnp.zeros((b,), jnp.float32)

    share, k_loop = pool.share, len(params.loop)

    def now(stack, i, g):  # [k] the K/V pass i wrote for the step's tokens (a compact pool)
        return [kv_share.take_at(stack, j, g.page, g.off, share.slot(i)) for j in range(k_loop)]

    def remember(x, stack, i, active, g):
        """A compact pool's carry after pass i: each token's last pass's K/V (kept), avg's sums
        of its passes' K/V, first's pass 0."""
        kept, acc, first = x
        got, on = now(stack, i, g), active[None, :, None]
        kept = [{n: jnp.where(on, a, o[n]) for n, a in d.items()} for d, o in zip(got, kept)]
        if share.kind == "avg":
            acc = [tuple(t + jnp.where(on, u, 0) for t, u in zip(a, pool.kv_mode.unpack(d, None)))
                   for a, d in zip(acc, got)]
        if share.kind == "first":
            first = jax.lax.cond(i == 0, lambda: got, lambda: first)
        return kept, acc, first

    def body(carry):
        c, x = carry
        check = c.active & vm(lambda p: ad.is_check(p, c.i))(pol)

        def one(k, carry):  # pass c.i over block k: its stream, the latent sums, the state a check keeps
            s, stack, latent, sums, x = carry
            g = part(k)
            y, stack = tf.one_pass(params, cfg, c.i, flat(blk(s, k)), None if e is None else flat(blk(e, k)), stack,
                                   lambda z, bk, st, index: paged.block(z, bk, cfg, (g,), st, index, 0, pool.kv_mode,
                                                                        pool.loop_of), share.slot)
            if not share.full:
                x = remember(x, stack, c.i, jnp.repeat(c.active, T0), g)
            y, prev = rowwise(y), blk(latent, k)
            valid = (k * T0 + jnp.arange(T0))[None] < count[:, None]
            sums = sums + vm(ad.latent_sums)(y, prev, valid)
            return (put(s, k, jnp.where(c.active[:, None, None], y, blk(s, k))), stack,
                    put(latent, k, jnp.where(check[:, None, None], y, prev)), sums, x)

        s, stack, latent, sums, x = blocks(one, (c.s, c.stack, c.judge.latent, jnp.zeros((b, 2), jnp.float32), x))
        lat = vm(ad.latent_value)(pol, sums, count)
        last_pass = c.i == loops - 1
        gp = gate_prob(s)
        quick = vm(lambda p, j, a, q, k: ad.quick_exit(p, j, last_pass, a, q, k))(pol, c.judge, lat, gp, check)
        need = check & (jnp.isin(pol.kind, jnp.array(ad.LOGIT_KINDS)) | quick)
        logits, post = jax.lax.cond(jnp.any(need), lambda p: coda_logits(s, p, need), lambda p: (c.logits, p),
                                    c.post)
        leave, judge = vm(lambda p, j, a, q, lg, k: ad.judge_pass(p, j, c.i, last_pass, a, q, lg, k))(
            pol, c.judge, lat, gp, logits, check)
        judge = jax.tree.map(lambda n, o: jnp.where(c.active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
                             judge._replace(latent=None), c.judge._replace(latent=None))._replace(latent=latent)
        return ad.Carry(c.i + 1, s, stack, post, c.active & ~leave, jnp.where(c.active, c.i + 1, c.depth), judge,
                        jnp.where(need[:, None], logits, c.logits), c.have | need), x

    c = ad.Carry(jnp.int32(0), s, pool.loop, tuple(pool.post), n > 0, jnp.zeros((b,), jnp.int32), judge,
                 jnp.zeros((b, V), jnp.float32), jnp.zeros((b,), bool))
    x = None
    if not share.full:
        start = now(pool.loop, 0, part(0))
        x = (start, [tuple(jnp.zeros_like(u) for u in pool.kv_mode.unpack(d, None)) for d in start]
             if share.kind == "avg" else None, start if share.kind == "first" else None)
    c, x = jax.lax.while_loop(lambda cx: (cx[0].i < loops) & jnp.any(cx[0].active), body, (c, x))
    final = ~c.have  # rows that never computed logits: the last pass's
    logits, post = jax.lax.cond(jnp.any(final), lambda p: coda_logits(c.s, p, final), lambda p: (c.logits, p),
                                c.post)
    logits = jnp.where(final[:, None], logits, c.logits)
    if share.full:
        def fill(k, stack):
            g = part(k)
            at = page_pool.local_map(pool.loop_of, g.page, page_pool.layer_slots(stack), write=True)  # (pass slots)
            return fill_skipped(stack, at, g.off, jnp.repeat(c.depth, T0), loops)
        stack = blocks(fill, c.stack)
    else:
        stack = settle_exits(c.stack, share, x, jnp.repeat(c.depth, T0), loops, part(0), pool.kv_mode)
    return Out(logits, pool.replace(loop=stack, post=post), c.depth, at_last(c.s))


def forward_decode(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, rows: paged.Rows, tokens: jax.Array,
                   loops: int, pol: ad.Policy, seeds: jax.Array, warm: jax.Array | None = None) -> Out:
    """`forward` for decode rows: tokens [b], one each (n_new 1; 0: a filler row)."""
    return forward(params, cfg, pool, rows, tokens[:, None], loops, pol, seeds, warm)
