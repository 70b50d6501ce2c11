"""Adaptive depth on pages: b rows, a prompt chunk or one decode token each, whose passes stop
at their exits (`adaptive`'s criteria and rules, on `paged`'s pool). A chunk exits as a whole
at one depth: latent criteria average over its real positions, logit criteria and the gate look
at its last one.

The pass loop is a `lax.while_loop` whose trip count is data: rows that exited keep their
state (masked) until the last row exits; the coda runs at checks that need logits (its K/V
written only for the rows that needed it); at the end the passes a row skipped take, in its
page, the K/V of its last computed pass of the same loop block — what a token that exited
offers the later tokens that run deeper (the reference's rule, as `adaptive.fill_skipped`).
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
            loops: int, pol: ad.Policy, seeds: jax.Array, warm: jax.Array | None = None) -> Out:
    """Rows' chunks tokens [b, T] (row i's first rows.n_new[i] real, at rows.start[i]; 0: a
    filler row) with adaptive depth: pol [b] each row's exit rule (kind NONE: every pass), seeds
    [b] uint32 (initial states), warm [b, D]: the state a continuous-compute row starts from.
    Logits and states are each row's last real token's."""
    b, T = tokens.shape
    V = cfg.vocab_size
    g = paged.Group.of(rows, T, pool)
    groups, pos = (g,), g.pos.reshape(-1)
    per_row = lambda a: a.reshape((b, T) + a.shape[1:])  # noqa: E731 - [b T, ..] -> [b, T, ..]
    by_token = lambda a: jnp.repeat(a, T, axis=0)  # noqa: E731 - [b, ..] -> [b T, ..]
    last = jnp.maximum(rows.n_new - 1, 0)
    at_last = lambda a: per_row(a)[jnp.arange(b), last]  # noqa: E731 - [b T, ..] -> [b, ..]
    valid = jnp.arange(T)[None] < jnp.maximum(rows.n_new, 1)[:, None]  # [b, T]
    x = paged.embed(params, tokens.reshape(-1), pos, cfg)
    inject = rec.injected(cfg)
    if inject and cfg.embed_scale != 1.0:
        x = x * cfg.embed_scale
    x, pool = paged.run_pre(params, cfg, x, groups, pool, 0)
    e, s = None, x
    if inject:
        e, s = x, jax.vmap(lambda sd, p: rec.initial_state(cfg, sd, p))(seeds, g.pos).reshape(b * T, -1)
        if warm is not None:
            s = jnp.where(by_token(pol.warm)[:, None], by_token(warm).astype(s.dtype), s)
    judge = jax.vmap(lambda a: ad.Judge.start(a, V))(per_row(s))
    vm = jax.vmap

    def coda_logits(x, post, need):
        """The coda (its K/V kept only where `need`) and the logits [b, V]."""
        old = [{n: a[:, g.page, g.off] for n, a in store.items()} for store in post]
        y, new = tf.coda(params, cfg, x, post, lambda y, blk, store, j: paged.block(y, blk, cfg, groups, store, None,
                                                                                     0, pool.kv_mode))
        keep = lambda n, o: jnp.where(by_token(need)[None, :, None], n, o)  # noqa: E731
        new = [page_pool.write(store, {n: keep(store[n][:, g.page, g.off], o[n]) for n in store}, g.page, g.off)
               for store, o in zip(new, old)]
        return tf.lm_head(params, cfg, at_last(y)), tuple(new)

    def gate_prob(x):
        return exits.gate(params, at_last(x)) if cfg.early_exit_gate else jnp.zeros((b,), jnp.float32)

    def loop_block(x, blk, stack, index):
        return paged.block(x, blk, cfg, groups, stack, index, 0, pool.kv_mode, pool.loop_of)

    share, k = pool.share, len(params.loop)

    def now(stack, i):  # [k] the K/V pass i wrote for the step's tokens (a compact pool)
        return [kv_share.take_at(stack, j, g.page, g.off, share.slot(i)) for j in range(k)]

    def remember(x, stack, i, active):
        """A compact pool's carry after pass i: each token's last pass's K/V (kept), avg's sums
        of its passes' K/V, first's pass 0."""
        kept, acc, first = x
        got, on = now(stack, i), active[None, :, None]
        kept = [{n: jnp.where(on, a, o[n]) for n, a in d.items()} for d, o in zip(got, kept)]
        if share.kind == "avg":
            acc = [tuple(t + jnp.where(on, u, 0) for t, u in zip(a, pool.kv_mode.unpack(d, None)))
                   for a, d in zip(acc, got)]
        if share.kind == "first":
            first = jax.lax.cond(i == 0, lambda: got, lambda: first)
        return kept, acc, first

    def body(carry):
        c, x = carry
        s_new, stack = tf.one_pass(params, cfg, c.i, c.s, e, c.stack, loop_block, share.slot)
        if not share.full:
            x = remember(x, stack, c.i, by_token(c.active))
        last_pass = c.i == loops - 1
        check = c.active & vm(lambda p: ad.is_check(p, c.i))(pol)
        gp = gate_prob(s_new)
        quick = vm(lambda p, j, a, v, q, k: ad.quick_exit(p, j, last_pass, a, v, q, k))(pol, c.judge, per_row(s_new),
                                                                                       valid, gp, check)
        need = check & (jnp.isin(pol.kind, jnp.array(ad.LOGIT_KINDS)) | quick)
        logits, post = jax.lax.cond(jnp.any(need), lambda p: coda_logits(s_new, p, need), lambda p: (c.logits, p),
                                    c.post)
        leave, judge = vm(lambda p, j, a, v, q, lg, k: ad.judge_pass(p, j, c.i, last_pass, a, v, q, lg, k))(
            pol, c.judge, per_row(s_new), valid, gp, logits, check)
        judge = jax.tree.map(lambda n, o: jnp.where(c.active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o), judge,
                             c.judge)
        return ad.Carry(c.i + 1, jnp.where(by_token(c.active)[:, None], s_new, c.s), stack, post, c.active & ~leave,
                        jnp.where(c.active, c.i + 1, c.depth), judge, jnp.where(need[:, None], logits, c.logits),
                        c.have | need), x

    c = ad.Carry(jnp.int32(0), s, pool.loop, pool.post, rows.n_new > 0, jnp.zeros((b,), jnp.int32), judge,
                 jnp.zeros((b, V), jnp.float32), jnp.zeros((b,), bool))
    x = None
    if not share.full:
        start = now(pool.loop, 0)
        x = (start, [tuple(jnp.zeros_like(u) for u in pool.kv_mode.unpack(d, None)) for d in start]
             if share.kind == "avg" else None, start if share.kind == "first" else None)
    c, x = jax.lax.while_loop(lambda cx: (cx[0].i < loops) & jnp.any(cx[0].active), body, (c, x))
    final = ~c.have  # rows that never computed logits: the last pass's
    logits, post = jax.lax.cond(jnp.any(final), lambda p: coda_logits(c.s, p, final), lambda p: (c.logits, p),
                                c.post)
    logits = jnp.where(final[:, None], logits, c.logits)
    if share.full:
        at = page_pool.local_map(pool.loop_of, g.page, page_pool.layer_slots(c.stack), write=True)  # (pass slots)
        stack = fill_skipped(c.stack, at, g.off, by_token(c.depth), loops)
    else:
        stack = settle_exits(c.stack, share, x, by_token(c.depth), loops, g, pool.kv_mode)
    return Out(logits, pool.replace(loop=stack, post=post), c.depth, at_last(c.s))


def forward_decode(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, rows: paged.Rows, tokens: jax.Array,
                   loops: int, pol: ad.Policy, seeds: jax.Array, warm: jax.Array | None = None) -> Out:
    """`forward` for decode rows: tokens [b], one each (n_new 1; 0: a filler row)."""
    return forward(params, cfg, pool, rows, tokens[:, None], loops, pol, seeds, warm)
