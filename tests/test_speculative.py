"""Self-speculative decoding: greedy output and final cache equal plain decoding; the
acceptance rule preserves the target distribution (statistical test on a tiny vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.decoding import step as St
from tinyloop_jax.decoding import paged_decode, speculative
from tinyloop_jax.model import paged
from conftest import prompt_of


@pytest.mark.parametrize("d,k", [(1, 1), (1, 3), (2, 4), (3, 2), (4, 5)])
def test_greedy_equals_plain(models, d, k):
    model = models["fp32"]
    p = prompt_of(20, seed=d + k)
    assert model.generate(p, max_tokens=24, loops=4, draft_loops=d, lookahead=k) == model.generate(
        p, max_tokens=24, loops=4)
    s = model.last_speculation
    assert s["rounds"] > 0 and 0 <= s["accepted"] <= s["drafted"]
    if d == 4:
        assert s["accepted"] == s["drafted"]  # drafting at full depth: everything is kept


@pytest.mark.parametrize("mode,window", [("fp32", 0), pytest.param("fp32", 6, marks=pytest.mark.slow),
                                         pytest.param("int8-h", 0, marks=pytest.mark.slow)])
def test_greedy_from_prefix_with_stops_and_windows(models, mode, window):
    model = models[mode]
    prefix = model.build_prefix_cache(prompt_of(18, seed=2), loops=3, cache_window=window)
    suffix = prompt_of(4, seed=3)
    plain = model.generate_from_prefix_cache(prefix, suffix=suffix, max_tokens=20)
    assert model.generate_from_prefix_cache(prefix, suffix=suffix, max_tokens=20, draft_loops=1,
                                            lookahead=3) == plain
    stop = [plain[len(prefix) + len(suffix) + 5: len(prefix) + len(suffix) + 7]]  # emitted tokens 6-7
    want = model.generate_from_prefix_cache(prefix, suffix=suffix, max_tokens=20, stop_sequences=stop)
    assert len(want) < len(plain)
    assert model.generate_from_prefix_cache(prefix, suffix=suffix, max_tokens=20, stop_sequences=stop,
                                            draft_loops=2, lookahead=4) == want


def test_pages_after_run_equal_plain_decoding_pages(models):
    """After a speculative run the row's pages hold, at every position it fed, what plain
    decoding's hold: rejected drafts' K/V were written again by the next round's verify."""
    model = models["fp32"]
    w, cfg = model.weights, model.weights.config
    prefix = model.build_prefix_cache(prompt_of(16, seed=5), loops=3)
    lay = paged_decode.layout(16, 15 + 4, 1)
    outs = {}
    for name in ("plain", "spec"):
        pool = paged_decode.load_prefix(w.params, cfg, paged_decode.empty_pool(cfg, 3, lay.n_pages), prefix.cache,
                                        16, lay)
        req = tl.Knobs.make(1, max_tokens=15)
        state = St.requests_of(prefix.seen[None], req, d_model=cfg.d_model, dtype=cfg.compute_dtype)
        fill = paged_decode.prefill(w.params, cfg, pool, state, lay.tables, 16, [np.zeros((0,), np.int32)],
                                    prefix.logits, 3, 0)
        kw = dict(draft_loops=1, lookahead=3) if name == "spec" else {}
        outs[name] = paged_decode.decode(w.params, cfg, paged.Rows(lay.tables, np.int32([16]), np.int32([1])), fill,
                                         req, 3, 0, 16, **kw)
    s1, s2 = outs["plain"], outs["spec"]
    assert int(s1.n[0]) == int(s2.n[0]) == 15 and np.array_equal(np.asarray(s1.tokens), np.asarray(s2.tokens))
    assert int(s2.accepted[0]) > 0  # drafts were kept (and some rejected: the pages were written twice)
    pos = np.arange(16 + 14)  # the prefix and every emitted token but the last
    page, off = lay.tables[0][pos // 16], pos % 16
    for a, b in zip(jax.tree.leaves(s1.pool), jax.tree.leaves(s2.pool)):
        np.testing.assert_allclose(np.asarray(a)[..., page, off, :], np.asarray(b)[..., page, off, :], atol=1e-4,
                                   rtol=1e-4)


def test_acceptance_rule_preserves_the_target_distribution():
    """Tiny vocabulary, synthetic target p and draft q: over many trials the emitted tokens
    follow p (first token, and the second one given the first draft was kept), not q."""
    V, k, trials = 6, 3, 40_000
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.dirichlet(np.ones(V), k + 1), jnp.float32)
    q = jnp.asarray(rng.dirichlet(np.ones(V) * 0.5, k), jnp.float32)

    def trial(key):
        kd, ka = jax.random.split(key)
        drafts = jax.vmap(speculative.draw)(jax.random.split(kd, k), q)
        a, nxt = speculative.accept(ka, p, q, drafts)
        emitted = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]).at[a].set(nxt)
        return emitted[0], emitted[1], a

    first, second, a = jax.vmap(trial)(jax.random.split(jax.random.key(1), trials))
    first, second, a = np.asarray(first), np.asarray(second), np.asarray(a)

    def chi2(samples, probs):
        counts = np.bincount(samples, minlength=V)
        expected = len(samples) * np.asarray(probs, np.float64)
        return float(np.sum((counts - expected) ** 2 / expected))

    # 5 degrees of freedom: the 0.999 quantile is 20.5
    assert chi2(first, p[0]) < 20.5
    assert chi2(second[a >= 1], p[1]) < 20.5
    assert chi2(first, q[0]) > 200  # the test can tell the draft distribution apart
    assert 0 < np.mean(a == k) < 1


def test_greedy_rule_is_argmax_agreement():
    p = jax.nn.one_hot(jnp.array([2, 4, 1]), 5)
    q = jax.nn.one_hot(jnp.array([2, 3]), 5)
    a, nxt = speculative.accept(jax.random.key(0), p, q, jnp.array([2, 3]))
    assert (int(a), int(nxt)) == (1, 4)
    a, nxt = speculative.accept(jax.random.key(0), p, jax.nn.one_hot(jnp.array([2, 4]), 5), jnp.array([2, 4]))
    assert (int(a), int(nxt)) == (2, 1)  # all kept: the bonus token


def test_sampled_speculation_runs_and_respects_top_k(models):
    model = models["fp32"]
    p = prompt_of(12, seed=7)
    out = model.generate(p, max_tokens=16, loops=4, temperature=1.0, top_k=1, draft_loops=1, lookahead=3, seed=3)
    assert out == model.generate(p, max_tokens=16, loops=4)  # top_k=1 sampling is greedy
    out = model.generate(p, max_tokens=16, loops=4, temperature=0.8, top_k=5, draft_loops=2, lookahead=2, seed=4)
    assert len(out) == len(p) + 16 and all(0 <= t < 128 for t in out)


def test_bad_speculation_args(models):
    model = models["fp32"]
    with pytest.raises(ValueError, match="draft_loops=5 must not exceed loops=4"):
        model.generate(prompt_of(4), loops=4, draft_loops=5)
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        model.generate(prompt_of(4), loops=4, draft_loops=1, lookahead=0)
