"""Self-speculative decoding: the same weights at two depths.

The K/V of loop pass t depend only on the stream entering pass t, so the first d passes of a
depth-L cache are exactly a depth-d cache. One round, for every row:

    draft   k tokens at depth d, running passes 0..d-1 of the same caches (cheap);
    verify  [y, d_1 .. d_k] as one chunk at depth L (one forward for k+1 positions);
    accept  the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023):
            d_j kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token
            is drawn from norm(max(0, p_j - q_j)); if all k are kept, a bonus token from p_k;
    rollback  the positions after the kept ones are dropped from the cache (`cache.rollback`).

Greedy decoding is the same rule with one-hot distributions (argmax), so it emits exactly
the tokens of plain greedy decoding at depth L; with sampling the output distribution is that
of plain sampling at depth L. The loop carries the same `DecodeState` as plain decoding.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, NamedTuple

import jax
import jax.numpy as jnp

from ..model import transformer as tf
from ..model.cache import KVCache
from ..model.config import ModelConfig
from .programs import (DecodeState, emit, feed, forward_rows, is_done, rollback_rows, row_lengths, rows_in_loop,
                     rows_out_of_loop, start)
from ..model.params import Params
from .sampling import Request, distribution

# The stream of keys the rounds draw from: round r's drafts and acceptance use
# fold_in(req.keys(r), DRAFT_STREAM), apart from the keys of plain decoding's token steps.
DRAFT_STREAM = 1


class Speculation(NamedTuple):
    """Self-speculative decoding: draft `lookahead` tokens at depth `draft_loops`."""
    draft_loops: int
    lookahead: int


class Drafting(NamedTuple):
    """The carry of one round's draft loop (N rows, k drafts, vocabulary V)."""
    own: KVCache  # the rows' segments, the drafts written at depth d
    tok: Annotated[jax.Array, "int32[N]"]  # the token fed next (the last draft)
    seen: Annotated[jax.Array, "bool[N, V]"]  # tokens fed so far
    counts: Annotated[jax.Array, "int32[N, V]"]  # emitted tokens fed so far, per token
    drafts: Annotated[jax.Array, "int32[N, k]"]  # the drafts so far
    qs: Annotated[jax.Array, "float32[N, k, V]"]  # the distribution each draft was drawn from


def fold_in(keys: jax.Array, data) -> jax.Array:
    """keys [N] -> [N] keys, each folded with the same `data` (an int or an int32 [])."""
    return jax.vmap(jax.random.fold_in, (0, None))(keys, data)


def draw(key: jax.Array, p: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.log(p)).astype(jnp.int32)


def accept(key: jax.Array, p: jax.Array, q: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The acceptance rule, one row. p [k+1, V]: target distributions after y, d_1 .. d_k; q [k, V]:
    the draft distributions d_j was drawn from; drafts [k]. Returns (a = drafts kept, the token
    that follows them: a residual draw at the first rejection, or a bonus draw from p_k)."""
    k = drafts.shape[0]
    ku, kr = jax.random.split(key)
    j = jnp.arange(k)
    pd, qd = p[j, drafts], q[j, drafts]
    ok = jax.random.uniform(ku, (k,)) * qd < pd  # u < p/q, with q(d) > 0 since d was drawn from q
    a = jnp.argmin(jnp.concatenate([ok, jnp.zeros((1,), bool)]))  # first rejection (k if none)
    resid = jnp.maximum(p[a] - jnp.concatenate([q, jnp.zeros_like(q[:1])])[a], 0.0)
    resid = jnp.where(jnp.sum(resid) > 0, resid, p[a])  # a == k: q row is 0, so this is p_k
    return a.astype(jnp.int32), draw(kr, resid / jnp.sum(resid))


@partial(jax.jit, static_argnames=("cfg", "loops", "window", "out_len", "draft_loops", "lookahead"),
         donate_argnames=("own",))
def decode(params: Params, cfg: ModelConfig, ro: tuple, own: KVCache, first: jax.Array, seen: jax.Array,
           req: Request, loops: int, window: int, out_len: int, draft_loops: int, lookahead: int,
           exit: tf.Exit | None = None) -> DecodeState:
    """Like `programs.decode` (`first` as there), in rounds of `lookahead` drafts at depth
    `draft_loops`. `own` needs room for lookahead + 1 positions past the last emitted token.
    `state.step` counts rounds and `state.accepted` the drafts kept per row."""
    k = lookahead
    N = first.shape[0]
    rows, ones = jnp.arange(N), jnp.ones((N,), jnp.int32)

    def round_(state: DecodeState) -> DecodeState:
        keys = fold_in(req.keys(state.step), DRAFT_STREAM)
        V = state.seen.shape[-1]

        def draft(j, c: Drafting) -> Drafting:  # one token at depth d: passes 0..d-1 of the same caches, in place
            seen, counts = c.seen.at[rows, c.tok].set(True), c.counts + jax.nn.one_hot(c.tok, V, dtype=jnp.int32)
            x, own = forward_rows(params, cfg, c.tok[:, None], ones, row_lengths(c.own), ro, c.own, draft_loops,
                                  window, seeds=req.seed)
            q = distribution(tf.lm_head(params, cfg, x[:, 0]), seen, req, counts)
            tok = jax.vmap(draw)(fold_in(keys, j), q)
            return Drafting(own, tok, seen, counts, c.drafts.at[:, j].set(tok), c.qs.at[:, j].set(q))

        d = jax.lax.fori_loop(0, k, draft, Drafting(state.own, state.last, state.seen, state.counts,
                                                    jnp.zeros((N, k), jnp.int32), jnp.zeros((N, k, V), jnp.float32)))
        drafts, qs = d.drafts, d.qs
        # Keep the buffers the draft wrote (no copy of the cache per round) but not its positions:
        # those slots are masked again and the verify rewrites them (a window's ring has room for
        # lookahead + 1 extra slots, so no position the verify needs was overwritten).
        own = d.own.replace(pos=state.own.pos, length=state.own.length)
        # verify all of them in one chunk at full depth
        chunk = jnp.concatenate([state.last[:, None], drafts], axis=1)  # [N, k+1]
        at = row_lengths(own)
        x, own = forward_rows(params, cfg, chunk, ones * (k + 1), at, ro, own, loops, window, exit, req.seed)
        # the target distribution after each prefix of the chunk: seen and counts grow by one chunk token a position
        fed = jnp.cumsum(jax.nn.one_hot(chunk, V, dtype=jnp.int32), axis=1)  # [N, k+1, V]
        seen_v, counts_v = state.seen[:, None] | (fed > 0), state.counts[:, None] + fed
        per_pos = jax.tree.map(lambda a: jnp.repeat(a, k + 1, axis=0), req)
        ps = distribution(tf.lm_head(params, cfg, x).reshape(N * (k + 1), V), seen_v.reshape(N * (k + 1), V),
                          per_pos, counts_v.reshape(N * (k + 1), V)).reshape(N, k + 1, V)
        a, nxt = jax.vmap(accept)(fold_in(keys, k), ps, qs, drafts)
        own = rollback_rows(own, at + 1 + a)  # y and the kept drafts stay; the rest is dropped
        # `seen` and `counts` hold the tokens fed so far (as in plain decoding): y and the kept drafts, not nxt
        kept = jnp.arange(k) < a[:, None]  # [N, k]
        seen, counts = feed(state, state.last)
        seen = seen.at[rows[:, None], jnp.where(kept, drafts, state.last[:, None])].set(True)
        counts = counts + jnp.sum(jax.nn.one_hot(drafts, V, dtype=jnp.int32) * kept[..., None], axis=1)
        state = state.replace(seen=seen, counts=counts, own=own, step=state.step + 1,
                              accepted=state.accepted + jnp.where(state.done, 0, a))
        # emit d_1 .. d_a, then nxt, one at a time so that stops and max_tokens cut exactly
        emitted = jnp.concatenate([drafts, jnp.zeros((N, 1), jnp.int32)], axis=1).at[rows, a].set(nxt)
        return jax.lax.fori_loop(0, k + 1, lambda j, s: emit(s, emitted[:, j], req, hold=j > a), state)

    start_at = own.length
    state = jax.lax.while_loop(lambda s: ~is_done(s), round_, start(first, seen, rows_in_loop(own), req,
                                                                    out_len))
    # a stop or max_tokens may cut a round after drafts were kept: hold exactly what plain
    # decoding holds, every emitted token but the last
    return state.replace(own=rows_out_of_loop(rollback_rows(state.own, start_at + state.n - 1)))
