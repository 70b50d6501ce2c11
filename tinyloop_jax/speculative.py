"""Self-speculative decoding: the same weights at two depths.

The K/V of loop iteration i depend only on the stream entering iteration i, so the first
n_pre_blocks + d layers of a depth-L cache are exactly a depth-d cache. One round:

    draft   k tokens at depth d, reading the first layers of the same caches (cheap);
    verify  [y, d_1 .. d_k] as one chunk at depth L (one forward for k+1 positions);
    accept  the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023):
            d_j kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token
            is drawn from norm(max(0, p_j - q_j)); if all k are kept, a bonus token from p_k;
    rollback  the positions after the kept ones are dropped from the cache (`rollback`).

Greedy decoding is the same rule with one-hot distributions (argmax), so it emits exactly
the tokens of plain greedy decoding at depth L; with sampling the output distribution is that
of plain sampling at depth L.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from . import model
from .cache import KVCache
from .config import ModelConfig
from .params import Params
from .sampling import SamplingParams, StopSpec, apply_repetition_penalty, select_token, stop_hit


def distribution(logits: jax.Array, seen: jax.Array, sp: SamplingParams) -> jax.Array:
    """The distribution a token is drawn from, [V]: repetition penalty, then one-hot argmax
    (greedy) or temperature -> top-k -> top-p -> softmax — the same steps as `select_token`."""
    logits = apply_repetition_penalty(logits, seen, sp.repetition_penalty)

    def sampled():
        scaled = logits / sp.temperature
        order = jnp.argsort(-scaled)
        s = scaled[order]
        rank = jnp.arange(s.shape[0])
        keep = (sp.top_k <= 0) | (rank < sp.top_k)
        p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf))
        keep = keep & ((jnp.cumsum(p) - p < sp.top_p) | (rank == 0))
        p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf))
        return jnp.zeros_like(p).at[order].set(p)

    return jax.lax.cond(sp.temperature <= 0, lambda: jax.nn.one_hot(jnp.argmax(logits), logits.shape[0]), sampled)


def draw(key: jax.Array, p: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.log(p)).astype(jnp.int32)


def accept(key: jax.Array, p: jax.Array, q: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The acceptance rule. p [k+1, V]: target distributions after y, d_1 .. d_k; q [k, V]: the
    draft distributions d_j was drawn from; drafts [k]. Returns (a = drafts kept, the token
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


def rollback(own: KVCache, length: jax.Array) -> KVCache:
    """Forget every position >= length (a first-class cache operation: slots stay, masked)."""
    return own.replace(pos=jnp.where(own.pos < length, own.pos, -1), length=length.astype(jnp.int32))


def _layers(seg: KVCache, n: int) -> KVCache:
    return seg.replace(layers=seg.layers[:n])


@partial(jax.jit, static_argnames=("cfg", "loops", "window", "out_len", "draft_loops", "lookahead"),
         donate_argnames=("own",))
def decode(params: Params, cfg: ModelConfig, ro: tuple, own: KVCache, first_logits: jax.Array, seen: jax.Array,
           sp: SamplingParams, stop: StopSpec, max_tokens: jax.Array, loops: int, window: int, out_len: int,
           draft_loops: int, lookahead: int):
    """Like `engine.decode`, in rounds of `lookahead` drafts at depth `draft_loops`. `own` needs
    room for lookahead + 1 positions past the last emitted token. Returns (out [out_len],
    n_emitted, own, rounds, drafts accepted)."""
    k, nd = lookahead, cfg.n_cache_layers(draft_loops)
    ro_d = tuple(_layers(s, nd) for s in ro)
    out = jnp.full((out_len,), -1, jnp.int32)
    y = select_token(first_logits, seen, sp, jnp.int32(0))  # the first token exactly as engine.decode
    out = out.at[0].set(y)
    n = jnp.int32(1)
    done = stop_hit(out, n, stop) | (n >= max_tokens)

    def body(carry):
        n, own, y, seen, out, _, rounds, kept = carry
        key = jax.random.fold_in(sp.key, 1_000_000 + rounds)
        # draft k tokens at depth d on the first layers of the same caches
        own_d, tok, seen_d = _layers(own, nd), y, seen
        drafts, qs = [], []
        for j in range(k):
            seen_d = seen_d.at[tok].set(True)
            x, own_d = model.forward(params, cfg, tok[None], jnp.int32(1), own_d.length, ro_d, own_d, draft_loops,
                                     window)
            q = distribution(model.lm_head(params, x[0]), seen_d, sp)
            tok = draw(jax.random.fold_in(key, j), q)
            drafts.append(tok)
            qs.append(q)
        drafts = jnp.stack(drafts)
        # The draft wrote its K/V into the shallow layers' slots for positions start.. . Keep
        # those buffers (no copy of the cache per round) but not the draft's positions: the
        # slots are masked again, and the verify rewrites them (a window's ring has room for
        # lookahead + 1 extra slots, so no position the verify needs was overwritten).
        own = own.replace(layers=own_d.layers + own.layers[nd:])
        # verify all of them in one chunk at full depth
        chunk = jnp.concatenate([y[None], drafts])
        start = own.length
        x, own = model.forward(params, cfg, chunk, jnp.int32(k + 1), start, ro, own, loops, window)
        logits = model.lm_head(params, x)  # [k+1, V]
        seen_v = seen.at[y].set(True)
        ps = []
        for j in range(k + 1):
            ps.append(distribution(logits[j], seen_v, sp))
            if j < k:
                seen_v = seen_v.at[drafts[j]].set(True)
        a, nxt = accept(jax.random.fold_in(key, k), jnp.stack(ps), jnp.stack(qs), drafts)
        own = rollback(own, start + 1 + a)  # y and the kept drafts stay; the rest is dropped
        # emit d_1 .. d_a, then nxt, one by one so that stops and max_tokens cut exactly
        emit = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]).at[a].set(nxt)
        # `seen` holds the tokens fed so far (as in engine.decode): y and the kept drafts, not nxt
        seen = seen.at[y].set(True)
        seen = seen.at[jnp.where(jnp.arange(k) < a, drafts, y)].set(True)

        def put(j, c):
            n, out, done = c
            go = (j <= a) & ~done
            out = jnp.where(go, out.at[jnp.minimum(n, out_len - 1)].set(emit[j]), out)
            n = n + go.astype(jnp.int32)
            return n, out, done | (go & (stop_hit(out, n, stop) | (n >= max_tokens)))

        n, out, done = jax.lax.fori_loop(0, k + 1, put, (n, out, jnp.bool_(False)))
        return n, own, out[n - 1], seen, out, done, rounds + 1, kept + a

    start0 = own.length
    carry = (n, own, y, seen, out, done, jnp.int32(0), jnp.int32(0))
    n, own, _, _, out, _, rounds, kept = jax.lax.while_loop(lambda c: ~c[5], body, carry)
    # a stop or max_tokens may cut a round after drafts were kept: hold exactly what plain
    # decoding holds, every emitted token but the last
    return out, n, rollback(own, start0 + n - 1), rounds, kept
