"""Sampling without a full sort (`sampling.cut`): the kept set of the full-sort definition, found
from the top 64 logits, the top 1,024 or a sort, and the same Gumbel-max draw, token for token;
the draw's frequencies match the filtered softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.decoding import filtering as F
from tinyloop_jax.decoding import sampling as S


def sort_filter(logits, temperature, top_k, top_p):
    """The reference, one row: a stable full sort (equal logits in id order), the top k ranks
    (top_k 0 or >= V: all), the nucleus by the cumulative softmax of the sorted kept logits (the
    mass strictly above a token < top_p; top_p >= 1: all), the kept values scattered back by id."""
    scaled = logits / temperature
    V = scaled.shape[0]
    order = jnp.argsort(-scaled, stable=True)
    s = scaled[order]
    rank = jnp.arange(V)
    keep = (top_k <= 0) | (rank < top_k)
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf))
    keep &= (top_p >= 1) | (jnp.cumsum(p) - p < top_p) | (rank == 0)
    return jnp.full((V,), -jnp.inf).at[order].set(jnp.where(keep, s, -jnp.inf))


reference_filter = jax.jit(jax.vmap(sort_filter))
reference_draw = jax.jit(lambda keys, filt: jax.vmap(jax.random.categorical)(keys, filt).astype(jnp.int32))


def rows(rng, N, V, knobs, flat=0):
    """N random rows of logits and knobs: scales from flat to peaked, every third row rounded to
    one decimal (many equal logits), the first `flat` rows nearly uniform (their nucleus reaches
    past the candidates)."""
    scale = rng.choice([0.05, 0.5, 2.0, 6.0], N)
    logits = (rng.standard_t(3, (N, V)) * scale[:, None]).astype(np.float32)
    logits[::3] = np.round(logits[::3], 1)
    logits[:flat] = rng.normal(0, 0.01, (flat, V))
    t, k, p = (np.asarray(rng.choice(v, N), dt) for v, dt in zip(knobs, (np.float32, np.int32, np.float32)))
    return logits, t, k, p


@pytest.mark.parametrize("V", [96, 6000])
def test_the_kept_set_and_the_tokens_equal_the_full_sort_reference(V):
    """Random logits and knobs (top_k 0 / 1 / 40 / 200 / 2,000 / V, top_p 0.05 / 0.9 / 1,
    temperature 0.3 / 1 / 2, ties): the filtered logits equal the full-sort reference exactly,
    and the drawn tokens equal `jax.random.categorical` over the reference with the same keys,
    on every path: no filter, the top 64, 1,024, 4,096, the sort (V = 6,000 reaches all five; V =
    96, at most two candidate lists, sorts each filtered row whole)."""
    rng = np.random.default_rng(V)
    seen = set()
    for trial in range(4):
        N = 24
        logits, t, k, p = rows(rng, N, V, ([0.3, 1.0, 2.0], [0, 1, 40, 200, 2000, V], [0.05, 0.9, 1.0]),
                                 flat=4)
        args = tuple(map(jnp.asarray, (logits, t, k, p)))
        want = np.asarray(reference_filter(*args))
        np.testing.assert_array_equal(np.asarray(F.filtered_logits(*args)), want)
        keys = jax.vmap(jax.random.key)(jnp.arange(N, dtype=jnp.uint32) + 100 * trial)
        np.testing.assert_array_equal(np.asarray(F.sample(*args, keys)), np.asarray(reference_draw(keys, want)))
        seen |= set(np.asarray(F.cut(args[0] / args[1][:, None], args[2], args[3]).path).tolist())
    assert seen == ({0, 1, 2, 3, 4} if V > F.LADDER[-1] else {0, 4} if V <= F.WHOLE else {0, 1, 2})


def test_a_batch_mixing_greedy_and_sampled_rows():
    """Greedy rows take the argmax whatever their top_k / top_p (and cost the batch no wider
    path); sampled rows draw the reference's tokens with req.keys(step)."""
    rng = np.random.default_rng(5)
    N, V = 12, 500
    logits, _, k, p = rows(rng, N, V, ([1.0], [0, 3, 40], [0.5, 0.9, 1.0]))
    t = np.where(np.arange(N) % 3 == 0, 0.0, 0.8).astype(np.float32)
    req = tl.Knobs.from_params([tl.SamplingParams(temperature=float(t[i]), top_k=int(k[i]), top_p=float(p[i]),
                                                    seed=i) for i in range(N)])
    step = jnp.int32(7)
    got = np.asarray(S.select_tokens(jnp.asarray(logits), jnp.zeros((N, V), bool), req, step))
    greedy = t == 0
    np.testing.assert_array_equal(got[greedy], logits[greedy].argmax(-1))
    filt = reference_filter(jnp.asarray(logits), jnp.asarray(np.where(greedy, 1.0, t)), jnp.asarray(k), jnp.asarray(p))
    np.testing.assert_array_equal(got[~greedy], np.asarray(reference_draw(req.keys(step), filt))[~greedy])


def test_gumbel_at_is_jax_gumbel_at_those_ids():
    key = jax.random.fold_in(jax.random.key(11), 4)
    ids = jnp.asarray([0, 5, 49151, 777, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(F.gumbel_at(key, ids, 49152)),
                                  np.asarray(jax.random.gumbel(key, (49152,))[ids]))


def test_only_the_rows_that_need_it_take_a_wider_path():
    """One flat row among peaked ones: that row alone is found again (top 1,024, 4,096, then the
    sort); the others keep their 64 candidates."""
    rng = np.random.default_rng(3)
    V = 6000
    logits = rng.normal(0, 8, (4, V)).astype(np.float32)
    logits[2] = rng.normal(0, 0.01, V)
    c = F.cut(jnp.asarray(logits), jnp.asarray([0, 0, 0, 0]), jnp.asarray([0.9, 0.9, 0.9, 0.9]))
    assert np.asarray(c.path).tolist() == [1, 1, 4, 1]
    c = F.cut(jnp.asarray(logits), jnp.asarray([0, 100, 2000, 0]), jnp.asarray([1.0, 1.0, 1.0, 0.9]))
    assert np.asarray(c.path).tolist() == [0, 2, 3, 1]  # no filter; top_k 100, 2,000; peaked


def test_top_k_one_keeps_the_argmax_of_a_flat_row_in_its_64_candidates():
    """top_k 1 keeps the argmax, ties or not: rows of equal logits (a padded row's zero logits, a
    greedy row in a sampled batch) and rows with more than 64 equal largest logits take no wider
    path, keep the lowest id and draw it, as the full-sort reference does."""
    V, N = 6000, 6
    logits = np.random.default_rng(4).normal(0, 3, (N, V)).astype(np.float32)
    logits[0] = 0
    logits[1, 100:300] = logits[1].max() + 1  # 200 ties at the top, the lowest id 100
    logits[2] = np.round(logits[2])
    args = (jnp.asarray(logits), jnp.full((N,), 0.8), jnp.asarray([1, 1, 1, 1, 0, 40]), jnp.full((N,), 0.9))
    c = F.cut(args[0] / args[1][:, None], args[2], args[3])
    assert np.asarray(c.path).tolist()[:4] == [1, 1, 1, 1]
    want = np.asarray(reference_filter(*args))
    np.testing.assert_array_equal(np.asarray(F.filtered_logits(*args)), want)
    keys = jax.vmap(jax.random.key)(jnp.arange(N, dtype=jnp.uint32))
    tok = np.asarray(F.sample(*args, keys))
    np.testing.assert_array_equal(tok, np.asarray(reference_draw(keys, want)))
    assert tok[:2].tolist() == [0, 100]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


def chi_square_bound(df: int, z: float = 3.29) -> float:
    """The chi-square distribution's upper quantile at z standard deviations (z = 3.29: p = 0.0005),
    by Wilson and Hilferty's cube-root approximation."""
    c = 2 / (9 * df)
    return df * (1 - c + z * np.sqrt(c)) ** 3


@pytest.mark.parametrize("top_k,top_p", [(8, 1.0), (0, 0.8), (20, 0.9), (0, 1.0)])
def test_sampled_frequencies_match_the_filtered_softmax(top_k, top_p):
    """40,000 draws (one row per seed, the same logits) against softmax(filtered logits / 0.7):
    no draw outside the kept set, and a chi-square within the p = 0.0005 bound, which the same
    draws exceed against the kept set one token short or one token long."""
    rng = np.random.default_rng(top_k)
    V, N, temp = 64, 40_000, 0.7
    row = np.sort(rng.normal(0, 1.2, V)).astype(np.float32)[::-1].copy()
    rng.shuffle(row)
    req = tl.Knobs.make(N, temperature=temp, top_k=top_k, top_p=top_p, seeds=np.arange(N))
    toks = np.asarray(S.select_tokens(jnp.asarray(np.broadcast_to(row, (N, V))), jnp.zeros((N, V), bool), req,
                                      jnp.int32(0)))
    counts = np.bincount(toks, minlength=V)
    scaled = row.astype(np.float64) / temp
    order = np.argsort(-scaled, kind="stable")
    kept = np.asarray(reference_filter(jnp.asarray(row[None]), jnp.float32([temp]), jnp.int32([top_k]),
                                       jnp.float32([top_p])))[0] > -np.inf
    n = int(kept.sum())
    assert counts[~kept].sum() == 0

    def probs(m):  # the softmax over the m most likely tokens
        e = np.zeros(V)
        e[order[:m]] = np.exp(scaled[order[:m]] - scaled.max())
        return e / e.sum()

    bound = chi_square_bound(n - 1)
    assert chi_square(counts[order[:n]], probs(n)[order[:n]]) < bound
    if n > 1:
        short = probs(n - 1)[order[:n]]  # a wrong set: its last token never drawn, so a count there is infinite
        with np.errstate(divide="ignore"):
            assert chi_square(counts[order[:n]], np.maximum(short, 1e-300)) > bound
    if n < V:
        long_ = probs(n + 1)[order[:n + 1]]
        assert chi_square(counts[order[:n + 1]], long_) > chi_square_bound(n)


def test_the_compiled_sampling_step_sorts_no_row_of_the_vocabulary():
    """XLA:CPU runs `lax.top_k` as a full sort when its output is sliced (130x slower at 16 rows
    of 49,152): the compiled step holds the TopK call, and a sort over a whole row only in the
    fallback branch (one row, [V], never the batch's [N, V])."""
    N, V = 4, 8192
    req = tl.Knobs.make(N, temperature=0.8, top_k=0, top_p=0.9)
    step = jax.jit(lambda lg, req: S.select_tokens(lg, jnp.zeros((N, V), bool), req, jnp.int32(0)))
    hlo = step.lower(jnp.zeros((N, V)), req).compile().as_text()
    sorts = [line for line in hlo.splitlines() if " sort(" in line]
    assert "TopK" in hlo
    assert not [line for line in sorts if f"[{N},{V}]" in line], sorts
    assert [line for line in sorts if f"[{V}]" in line]  # the fallback's (the test sees the program it means)


def test_a_masked_row_with_fewer_tokens_than_top_k_stays_in_its_64_candidates():
    """A grammar's mask leaves 3 tokens and top_k is 50: the cut is at -inf, settled by the 64
    candidates (the -inf tokens, never drawn, need no tie order), and the draws equal the
    full-sort reference's."""
    rng = np.random.default_rng(9)
    N, V = 4, 6000
    logits = np.full((N, V), -np.inf, np.float32)
    for i in range(N):
        logits[i, rng.choice(V, 3, replace=False)] = rng.normal(0, 1, 3)
    t, k, p = (jnp.asarray(np.full(N, v, dt)) for v, dt in ((0.8, np.float32), (50, np.int32), (1.0, np.float32)))
    assert np.asarray(F.cut(jnp.asarray(logits) / 0.8, k, p).path).tolist() == [1] * N
    want = reference_filter(jnp.asarray(logits), t, k, p)
    keys = jax.vmap(jax.random.key)(jnp.arange(N, dtype=jnp.uint32))
    np.testing.assert_array_equal(np.asarray(F.sample(jnp.asarray(logits), t, k, p, keys)),
                                  np.asarray(reference_draw(keys, want)))
