"""Self-speculative decoding: the same weights at two depths.

The K/V of loop pass t depend only on the stream entering pass t, so the first d passes of a
depth-L cache are exactly a depth-d cache. One round, for every row:

    draft   k tokens at depth d, running passes 0..d-1 of the same caches (cheap);
    verify  [y, d_1 .. d_k] as one chunk at depth L (one forward for k+1 positions);
    accept  the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023):
            d_j kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token
            is drawn from norm(max(0, p_j - q_j)); if all k are kept, a bonus token from p_k;
    rollback  the positions after the kept ones are left to be written again (the row's length
              is the host's, or the loop's count of emitted tokens).

Greedy decoding is the same rule with one-hot distributions (argmax), so it emits exactly
the tokens of plain greedy decoding at depth L; with sampling the output distribution is that
of plain sampling at depth L. One round over a page pool is `round_paged`: the `Model` path's
step (`step.step_speculative`) runs it, in the engine and in `generate`'s loop.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..model import transformer as tf
from ..model import exits
from ..model.config import ModelConfig
from ..model.params import Params
from .sampling import Knobs, distribution

# The stream of keys the rounds draw from: round r's drafts and acceptance use
# fold_in(req.keys(r), DRAFT_STREAM), apart from the keys of plain decoding's token steps.
DRAFT_STREAM = 1


class Speculation(NamedTuple):
    """Self-speculative decoding: draft `lookahead` tokens at depth `draft_loops`."""
    draft_loops: int
    lookahead: int


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


def round_paged(params: Params, cfg: ModelConfig, pool, rows, last: jax.Array, seen: jax.Array, counts: jax.Array,
                req: Knobs, keys: jax.Array, loops: int, draft_loops: int, lookahead: int, window: int = 0,
                exit: exits.Exit | None = None, grammar: tuple | None = None):
    """One round for N rows over a page pool (`model.paged`): rows (`paged.Rows`: start = where
    each row's last token is fed, n_new 1, or 0 for a row that only idles) and their last
    tokens [N], seen / counts [N, V] before it, keys [N] the round's. k = lookahead drafts at
    depth `draft_loops` (passes 0..d-1 of the same pages), [last, d_1 .. d_k] verified as one
    chunk at `loops`, the acceptance rule. Rollback is the caller's length: positions past the
    kept tokens are written again by the next round. Returns (tokens [N, k + 1]: d_1 .. d_a
    then the next token, a [N], seen and counts with last and the kept drafts fed, pool).

    grammar (call, mask [N, W], live [N]): structured output. Draft j is drawn under the mask
    of what may follow the tokens before it and the host's matchers take it for now
    (`grammar.draft_masks`); position j of the verify chunk is chosen under the same mask, so
    greedy rounds emit plain masked greedy decoding's tokens; then the host keeps the kept
    drafts (`grammar.commit`: fewer where a kept draft completes the grammar, that draft
    becoming the round's last token) and rolls back the rest."""
    from ..model import paged
    from . import grammar as G

    k, N, V = lookahead, last.shape[0], seen.shape[-1]
    idx = jnp.arange(N)
    masks = None if grammar is None else jnp.zeros((N, k + 1) + grammar[1].shape[1:], jnp.int32).at[:, 0].set(
        grammar[1])
    under = lambda r, m: r if m is None else r.replace(allowed=m)  # noqa: E731

    def draft(j, c):  # one token at depth d, at position start + j
        pool, tok, seen_d, counts_d, drafts, qs, masks = c
        seen_d = seen_d.at[idx, tok].set(True)
        counts_d = counts_d + jax.nn.one_hot(tok, V, dtype=jnp.int32)
        x, pool = paged.forward(params, cfg, pool, rows.replace(start=rows.start + j), tok[:, None], draft_loops,
                                window, seeds=req.seed)
        q = distribution(tf.lm_head(params, cfg, x[:, 0]), seen_d, under(req, None if masks is None else masks[:, j]),
                         counts_d)
        tok = jax.vmap(draw)(fold_in(keys, j), q)
        if masks is not None:
            masks = masks.at[:, j + 1].set(G.device_draft_masks(grammar[0], tok, grammar[2], V))
        return pool, tok, seen_d, counts_d, drafts.at[:, j].set(tok), qs.at[:, j].set(q), masks

    pool, _, _, _, drafts, qs, masks = jax.lax.fori_loop(0, k, draft, (
        pool, last, seen, counts, jnp.zeros((N, k), jnp.int32), jnp.zeros((N, k, V), jnp.float32), masks))
    chunk = jnp.concatenate([last[:, None], drafts], axis=1)  # [N, k + 1] at start .. start + k
    x, pool = paged.forward(params, cfg, pool, rows.replace(n_new=rows.n_new * (k + 1)), chunk, loops, window, exit,
                            req.seed)
    fed = jnp.cumsum(jax.nn.one_hot(chunk, V, dtype=jnp.int32), axis=1)  # seen / counts after each chunk prefix
    per_pos = jax.tree.map(lambda a: jnp.repeat(a, k + 1, axis=0), req)
    flat = lambda a: a.reshape((N * (k + 1),) + a.shape[2:])  # noqa: E731
    ps = distribution(flat(tf.lm_head(params, cfg, x)), flat(seen[:, None] | (fed > 0)),
                      under(per_pos, None if masks is None else flat(masks)),
                      flat(counts[:, None] + fed)).reshape(N, k + 1, V)
    a, nxt = jax.vmap(accept)(fold_in(keys, k), ps, qs, drafts)
    if grammar is not None:  # a kept draft that completes the grammar ends the round (and the row)
        cut = G.device_commit(grammar[0], a, grammar[2])
        nxt = jnp.where(cut < a, jnp.take_along_axis(drafts, jnp.minimum(cut, k - 1)[:, None], axis=1)[:, 0], nxt)
        a = cut
    kept = jnp.arange(k)[None] < a[:, None]  # last and the kept drafts were fed; nxt is the next input
    hot = jax.nn.one_hot(drafts, V, dtype=jnp.int32) * kept[..., None]
    seen = seen | (jax.nn.one_hot(last, V) > 0) | (jnp.sum(hot, axis=1) > 0)
    counts = counts + jax.nn.one_hot(last, V, dtype=jnp.int32) + jnp.sum(hot, axis=1)
    tokens = jnp.concatenate([drafts, jnp.zeros((N, 1), jnp.int32)], axis=1).at[idx, a].set(nxt)
    return tokens, a, seen, counts, pool
