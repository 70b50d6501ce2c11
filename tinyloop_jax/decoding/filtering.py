"""Top-k and top-p without a full sort, and the Gumbel-max draw from what they keep.

The definition (`filtered_logits`): a row's logits over its temperature in the order of a stable
descending sort (equal logits lowest id first); its first top_k ranks kept (0, or >= V: all),
then of those the smallest prefix whose softmax mass reaches top_p (the mass strictly above each
kept token < top_p; top_p 1 keeps all); -inf elsewhere. A token is drawn from its softmax by
Gumbel-max, argmax(filtered + gumbel(key, (V,))): `jax.random.categorical`'s draw.

How it runs (issue 58: a full sort of every sampled row, every step, cost more than the model's
matmuls at 16 rows):

    no filter (top_k off, top_p 1)   nothing to find; the draw hashes the V noises
    its 64 largest (`candidates`)    a top_k <= 64, or a nucleus reached within them, ends here,
                                     and the draw hashes those 64 noises alone (`gumbel_at`)
    its 1,024, then 4,096 largest    a row the 64 do not settle (a flat distribution, or
    then a sort of the row           64 < top_k < V), alone, in a loop over such rows; its
                                     draw hashes the row's V noises
    a vocabulary of <= 128 (`WHOLE`)  a filtered batch's rows sorted whole (`_settle_whole`): the
                                     ladder would reach the row at its first rung, and one sort
                                     compiles to a fraction of its regions; each row drawn over
                                     its row

The rows drawn over their whole row (those keeping every token; every row of a small vocabulary)
share one draw (`_draw_rows`), and a row past its 64 candidates is drawn over its row in the
loop, whichever rung found its cut: one copy of the draw a rung made SmolLM2's step programs
15-17% larger (docs/benchmarks.md, "A smaller sampler"). (Drawn by the batch's draw instead,
a row past 64 made every row of its batch hash V noises: a nucleus alone 12% slower.)

A batch runs batch-level conds and a loop over its unsettled rows, never a vmapped cond (which
would run every branch for every row). `Cut.path` says which way each row went: how often each
is taken on a real model is in docs/benchmarks.md (scripts/bench_sampling.py).
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import struct

CANDIDATES = 64  # the largest logits every filtered row looks at first
LADDER = (1024, 4096)  # then, for a row they do not settle, these many, then a sort
PATHS = ("none", "top 64", "top 1,024", "top 4,096", "sort")
# a vocabulary of at most this many sorts a filtered row whole (`_settle_whole`): XLA:CPU's sort
# runs ~150 ns an element, so a wider row is cheaper through the 64 candidates first
WHOLE = 2 * CANDIDATES


@struct.dataclass
class Cut:
    """Where each row's kept set ends in its stable descending order: the tokens above `value`
    are kept, and those equal to it with ids up to `last`. value -inf: every token kept."""

    value: Annotated[jax.Array, "float32[N]"]  # the smallest kept logit (over the temperature)
    last: Annotated[jax.Array, "int32[N]"]  # of the logits equal to it, the highest id kept
    path: Annotated[jax.Array, "int32[N]"]  # how it was found: an index into PATHS


def argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value; of the first NaN if
    any) -> int32, as two plain reductions: XLA:CPU's argmax (a reduce over (value, index)
    pairs) took 1.2 ms over Gemma's 262,144 logits, a max and then a min of the matching indices
    0.23 ms (docs/benchmarks.md, profile_decode)."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == m) | (jnp.isnan(logits) & jnp.isnan(m))
    return jnp.min(jnp.where(hit, iota, logits.shape[-1]), axis=-1)


def candidates(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest of x [..., V] in the order of a stable descending sort: values [..., k]
    descending, equal values lowest id first, and their ids [..., k] int32.

    `lax.top_k` is a partial selection on XLA:CPU only while nothing slices its outputs: it is
    lowered as a full sort and a slice, and rewritten back into its TopK call only where the
    slice is the sort's one reader (a read of the largest value alone made the whole sort run,
    130x slower at 16 x 49,152). Sorting the k candidates straight away (by value, then id: TopK
    leaves equal values in no set order) makes that small sort its one reader.
    tests/test_sampling.py checks the compiled step holds no sort over the vocabulary."""
    vals, ids = jax.lax.top_k(x, k)
    neg, ids = jax.lax.sort((-vals, ids), dimension=-1, num_keys=2)
    return -neg, ids


def _k(top_k: jax.Array, V: int) -> jax.Array:
    """top_k [N] -> the ranks it keeps: V when it is off (0) or covers the vocabulary."""
    return jnp.where((top_k <= 0) | (top_k >= V), V, top_k)


def _nucleus(s: jax.Array, k: jax.Array, top_p: jax.Array, total: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One row's kept ranks among its largest logits s [K] (descending): the top k, and of those
    the smallest prefix whose softmax mass (over the top k; `total` the normaliser when they
    reach past K) reaches top_p. The softmax is jax.nn.softmax's, exp(s - max) / sum.
    -> (kept [K], the mass of all K)."""
    rank = jnp.arange(s.shape[0])
    keep = rank < k
    e = jnp.exp(jnp.where(keep, s - s[0], -jnp.inf))
    p = e / jnp.where(k <= s.shape[0], jnp.sum(e), total)
    cum = jnp.cumsum(p)
    return keep & ((top_p >= 1) | (cum - p < top_p) | (rank == 0)), cum[-1]


def _candidate_cut(vals: jax.Array, ids: jax.Array, k: jax.Array, top_p: jax.Array, total: jax.Array, V: int):
    """One row's cut from its K largest logits vals [K] (`candidates` order) and their ids [K] ->
    (value, last, found: the kept set ends inside them). It does when k <= K, or when top-k is
    off and the candidates' mass already reaches top_p < 1 (the next token's mass above is the
    candidates', >= top_p); a top_k between K and V never does."""
    keep, mass = _nucleus(vals, k, top_p, total)
    n = jnp.sum(keep)
    found = (k <= vals.shape[0]) | ((k >= V) & (top_p < 1) & (mass >= top_p))
    return vals[n - 1], ids[n - 1], found


def _whole_ties(scaled: jax.Array, vals: jax.Array, value: jax.Array) -> jax.Array:
    """Do the candidates vals [..., K] of scaled [..., V] hold every token equal to the cut
    value [...]? Not always where it is their smallest: TopK picks among equal values at its
    edge in no set order, and the kept ones must be the lowest ids. A cut at -inf (a grammar's
    mask left fewer tokens than top_k) needs none of them: a -inf token is never drawn."""
    return ((value > vals[..., -1]) | (value == -jnp.inf)
            | (jnp.sum(scaled == value[..., None], -1) == jnp.sum(vals == value[..., None], -1)))


def _sorted_cut(scaled: jax.Array, k: jax.Array, top_p: jax.Array):
    """One row's cut by a stable full sort of scaled [V]: the definition itself."""
    order = jnp.argsort(-scaled)
    s = scaled[order]
    keep, _ = _nucleus(s, k, top_p, jnp.ones((), s.dtype))
    n = jnp.sum(keep)
    return s[n - 1], order[n - 1].astype(jnp.int32)


def _kept(x: jax.Array, ids: jax.Array, value: jax.Array, last: jax.Array) -> jax.Array:
    """Which of x (logits over the temperature at token ids, the same shape) the cut (value,
    last, broadcast against them) keeps."""
    return (x > value) | ((x == value) & (ids <= last))


def gumbel_at(key: jax.Array, ids: jax.Array, V: int) -> jax.Array:
    """jax.random.gumbel(key, (V,))[ids], without drawing the other tokens' noise: with
    partitionable threefry (JAX's default) token i's bits hash the counter i alone, so K of
    them cost K hashes, not V. The float steps of `jax.random.gumbel`'s "low" mode
    (tests/test_sampling.py checks the numbers against it)."""
    if not (jax.config.jax_threefry_partitionable
            and jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0))):
        return jax.random.gumbel(key, (V,))[ids]
    from jax.extend.random import threefry2x32_p

    k1, k2 = jax.random.key_data(key)
    lo = ids.astype(jnp.uint32)
    b1, b2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(lo), lo)
    mantissa = jax.lax.shift_right_logical(b1 ^ b2, jnp.uint32(9)) | jnp.uint32(0x3F800000)
    tiny = jnp.float32(jnp.finfo(jnp.float32).tiny)
    u = jnp.maximum(tiny, (jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0) * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def _draw_among(vals: jax.Array, ids: jax.Array, value: jax.Array, last: jax.Array, key: jax.Array, V: int):
    """One row's token when its kept set lies among its candidates vals, ids [K]: Gumbel-max over
    them alone, equal scores to the lowest id (as argmax over V)."""
    score = jnp.where(_kept(vals, ids, value, last), vals + gumbel_at(key, ids, V), -jnp.inf)
    return jnp.min(jnp.where(score == jnp.max(score), ids, V))


def _settle_row(scaled: jax.Array, k: jax.Array, top_p: jax.Array, total: jax.Array, step: int = 0):
    """One row its 64 candidates did not settle: its cut from its LADDER[step] largest, else the
    next rung, else a sort. -> (value, last, path)."""
    V = scaled.shape[0]
    if step == len(LADDER):
        return *_sorted_cut(scaled, k, top_p), jnp.int32(2 + step)
    W = min(LADDER[step], V)
    vals, ids = candidates(scaled, W)
    v, l, ok = _candidate_cut(vals, ids, k, top_p, total, V)
    if W == V:  # every token a candidate: settled
        return v, l, jnp.int32(2 + step)
    return jax.lax.cond(ok & _whole_ties(scaled, vals, v), lambda: (v, l, jnp.int32(2 + step)),
                        lambda: _settle_row(scaled, k, top_p, total, step + 1))


def _draw_rows(scaled: jax.Array, keys: jax.Array, value: jax.Array | None = None,
               last: jax.Array | None = None) -> jax.Array:
    """Each row's token by Gumbel-max over its whole row of scaled [N, V]: the definition's draw,
    outside the rows' cut (value, last [N]) -inf if given (else every token kept: the mask over
    the batch's N x V would cost a fifth of the draw). Equal scores go to the lowest id."""
    N, V = scaled.shape
    if value is not None:
        iota = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
        scaled = jnp.where(_kept(scaled, iota, value[:, None], last[:, None]), scaled, -jnp.inf)
    return argmax(scaled + jax.vmap(lambda key: jax.random.gumbel(key, (V,)))(keys))


def _settle_whole(scaled: jax.Array, k: jax.Array, top_p: jax.Array):
    """`_settle`'s cut for a vocabulary of at most two candidate lists (`WHOLE`): a filtered batch
    sorts its rows whole, with no ladder and no row loop (whose regions were half a small model's
    step program: 0.74 -> 0.53-0.59 s to compile its pair under the suite's flags); each row's
    draw is then one over its row (`_draw_rows`). -> (value, last, path)."""
    N, V = scaled.shape
    none = (k >= V) & (top_p >= 1)

    def filtered():
        iota = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
        neg, ids = jax.lax.sort((-scaled, iota), dimension=-1, num_keys=2)
        value, last, _ = jax.vmap(_candidate_cut, (0, 0, 0, 0, None, None))(-neg, ids, k, top_p, jnp.ones(()), V)
        return jnp.where(none, -jnp.inf, value), jnp.where(none, V - 1, last)

    value, last = jax.lax.cond(jnp.all(none), lambda: (jnp.full((N,), -jnp.inf, scaled.dtype),
                                                      jnp.full((N,), V - 1, jnp.int32)), filtered)
    return value, last, jnp.where(none, 0, len(PATHS) - 1).astype(jnp.int32)


def _settle_ladder(scaled: jax.Array, k: jax.Array, top_p: jax.Array, keys: jax.Array | None):
    """`_settle`'s cut for a larger vocabulary, by the ladder, with the token of every filtered
    row (among its 64 candidates, or over its row in the loop past them). -> (value, last, path,
    token, the rows still to draw over the row: those keeping every token)."""
    N, V = scaled.shape
    none = (k >= V) & (top_p >= 1)

    def unfiltered():
        return (jnp.full((N,), -jnp.inf, scaled.dtype), jnp.full((N,), V - 1, jnp.int32), jnp.zeros((N,), jnp.int32),
                jnp.zeros((N,), jnp.int32))

    def filtered():
        K = min(CANDIDATES, V)
        vals, ids = candidates(scaled, K)
        # the normaliser over every token, for a nucleus without top-k (skipped when no row has one)
        total = jax.lax.cond(jnp.any((k >= V) & (top_p < 1)), lambda: jnp.sum(jnp.exp(scaled - vals[:, :1]), -1),
                             lambda: jnp.ones((N,), scaled.dtype))
        value, last, found = jax.vmap(_candidate_cut, (0, 0, 0, 0, 0, None))(vals, ids, k, top_p, total, V)
        # top_k 1 keeps the argmax, ties or not: a row of equal logits (a padded row's zero logits)
        # never takes the ladder; only where the 64 candidates are all equal may they miss its
        # lowest id, looked for unless top_p is 0 (a row whose token is dropped: a greedy or filler
        # row of a sampled batch, `sampling._sampled_knobs`)
        one = k == 1
        found &= jax.lax.cond(jnp.any((value == vals[:, -1]) & ~one), lambda: _whole_ties(scaled, vals, value),
                              lambda: jnp.ones((N,), bool))
        flat = one & (top_p > 0) & (vals[:, 0] == vals[:, -1])
        last = jax.lax.cond(jnp.any(flat), lambda: jnp.where(flat, argmax(scaled), last), lambda: last)
        found |= one
        path = jnp.where(none, 0, jnp.where(found, 1, 2)).astype(jnp.int32)
        value, last = jnp.where(none, -jnp.inf, value), jnp.where(none, V - 1, last)
        tok = jnp.zeros((N,), jnp.int32)
        if keys is not None:
            tok = jnp.where(one, last, jax.vmap(_draw_among, (0, 0, 0, 0, 0, None))(vals, ids, value, last, keys, V))

        def again(c):
            def row(i, c):
                def settle():  # (its draw over its row: one copy of the draw for every rung)
                    v, l, p = _settle_row(scaled[i], k[i], top_p[i], total[i])
                    return v, l, p, (jnp.int32(0) if keys is None
                                     else _draw_rows(scaled[i][None], keys[i][None], v[None], l[None])[0])

                got = jax.lax.cond(c[2][i] == 2, settle, lambda: tuple(a[i] for a in c))
                return tuple(a.at[i].set(g) for a, g in zip(c, got))

            return jax.lax.fori_loop(0, N, row, c)

        c = (value, last, path, tok)
        return jax.lax.cond(jnp.any(path == 2), again, lambda c: c, c)

    value, last, path, tok = jax.lax.cond(jnp.all(none), unfiltered, filtered)
    return value, last, path, tok, none


def _settle(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array | None):
    """Every row's cut, and its token when keys [N] are given (else zeros). scaled [N, V]. The
    rows keeping every token (every row of a small vocabulary) share one draw over the row."""
    N, V = scaled.shape
    k, top_p = _k(jnp.asarray(top_k), V), jnp.asarray(top_p)
    if V <= WHOLE:
        value, last, path = _settle_whole(scaled, k, top_p)
        tok = jnp.zeros((N,), jnp.int32) if keys is None else _draw_rows(scaled, keys, value, last)
        return Cut(value, last, path), tok
    value, last, path, tok, full = _settle_ladder(scaled, k, top_p, keys)
    if keys is not None:
        tok = jax.lax.cond(jnp.any(full), lambda: jnp.where(full, _draw_rows(scaled, keys), tok),
                           lambda: tok)
    return Cut(value, last, path), tok


def cut(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> Cut:
    """Each row's kept set: scaled [N, V] (logits over the temperature), top_k [N] (0 = off),
    top_p [N] (1 = off)."""
    return _settle(scaled, top_k, top_p, None)[0]


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [N, V] -> logits over the temperature, -inf outside each row's top-k and top-p
    nucleus (the definition above). temperature (> 0), top_k, top_p [N]."""
    scaled = logits / temperature[:, None]
    c = cut(scaled, top_k, top_p)
    iota = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    return jnp.where(_kept(scaled, iota, c.value[:, None], c.last[:, None]), scaled, -jnp.inf)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array) -> jax.Array:
    """A token per row [N] int32 drawn from softmax(filtered_logits(logits [N, V], temperature,
    top_k, top_p)) with keys [N]: `jax.random.categorical(keys[i], filtered[i])`, token for
    token."""
    return _settle(logits / temperature[:, None], top_k, top_p, keys)[1]
