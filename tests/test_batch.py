"""Shared-prefix batching: N requests decoded together equal N separate calls; the prefix is
read, not replicated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.decoding import paged_decode
from tinyloop_jax.model import page_pool, paged
from conftest import prompt_of

CLOSE = dict(atol=1e-3, rtol=1e-2)


def ragged(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, n).astype(np.int32) for n in (5, 0, 1, 12, 3)]


# the inner loop (-m "not slow") keeps fp32 and one windowed h mode; the rest of the modes are slow
@pytest.mark.parametrize("mode,window", [
    (m, w) if (m, w) in (("fp32", 0), ("fp32", 7), ("int8-h", 7)) else pytest.param(m, w, marks=pytest.mark.slow)
    for m, w in [(m, 0) for m in tl.KV_MODES] + [("fp32", 7), ("int8-h", 7), ("int4", 7)]])
def test_batched_greedy_equals_separate_calls(mode_models, mode, window):
    model = mode_models[mode]
    prefix = model.build_prefix_cache(prompt_of(20, seed=1), loops=2, cache_window=window)
    suffixes = ragged()
    got = model.generate_batch_from_prefix_cache(prefix, suffixes, max_tokens=9)
    want = [model.generate_from_prefix_cache(prefix, suffix=s, max_tokens=9) for s in suffixes]
    assert got == want


@pytest.mark.parametrize("mode", tl.KV_MODES)
def test_batched_logits_match_separate_prefills(mode_models, mode):
    """The batched prefill over the call's pages (the prefix's loaded once, its partial page
    copied per row): per-request next-token logits == one request at a time over the dense
    prefix (`next_token_logits_from_prefix`)."""
    model = mode_models[mode]
    w, cfg = model.weights, model.weights.config
    prefix = model.build_prefix_cache(prompt_of(20, seed=1), loops=2)
    suffixes = [s for s in ragged() if len(s)]
    lens = np.array([len(s) for s in suffixes], np.int32)
    tokens = np.zeros((len(suffixes), 16), np.int32)
    for i, s in enumerate(suffixes):
        tokens[i, :len(s)] = s
    lay = paged_decode.layout(20, 16, len(suffixes))
    pool = paged_decode.load_prefix(w.params, cfg, paged_decode.empty_pool(cfg, 2, lay.n_pages), prefix.cache,
                                    20, lay)
    if prefix.cache.kv_mode != pool.kv_mode:  # an h mode's streams: the load rebuilds K/V, so it needs the model
        with pytest.raises(ValueError, match=f"a {mode} segment into a .* pool is rebuilt: pass params and cfg"):
            page_pool.load_segment(paged_decode.empty_pool(cfg, 2, lay.n_pages), prefix.cache,
                                   jnp.asarray(lay.tables[0]), jnp.int32(0), jnp.int32(20))
    rows = paged.Rows(lay.tables, np.full(len(lens), 20, np.int32), lens)
    forward = jax.jit(lambda p, pool, t: paged.last_logits(p, cfg, paged.forward(p, cfg, pool, rows, t, 2, 0)[0], rows))
    logits = forward(w.params, pool, jnp.asarray(tokens))  # the step's chunk group, as `paged_decode.prefill` runs it
    for i, s in enumerate(suffixes):
        np.testing.assert_allclose(np.asarray(logits[i]), model.next_token_logits_from_prefix(prefix, s), **CLOSE)


def test_sampling_seeds_and_mixed_stops(mode_models):
    model = mode_models["fp32"]
    prefix = model.build_prefix_cache(prompt_of(16, seed=2), loops=3)
    suffixes = ragged(3)
    greedy = [model.generate_from_prefix_cache(prefix, suffix=s, max_tokens=12)[len(prefix) + len(s):]
              for s in suffixes]
    # per-request stop lists: stop request i after its 3rd greedy token (none for request 1)
    stops = [[[int(g[2])]] if i != 1 else [] for i, g in enumerate(greedy)]
    got = model.generate_batch_from_prefix_cache(prefix, suffixes, max_tokens=12, stop_sequences=stops)
    want = [model.generate_from_prefix_cache(prefix, suffix=s, max_tokens=12, stop_sequences=st)
            for s, st in zip(suffixes, stops)]
    assert got == want and len(got[1]) == len(prefix) + len(suffixes[1]) + 12
    assert all(len(g) < len(prefix) + len(s) + 12 for i, (g, s) in enumerate(zip(got, suffixes)) if i != 1)
    # sampling: each request with its own seed equals the same call made alone
    kw = dict(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9)
    seeds = [3, 1, 4, 1, 5]
    got = model.generate_batch_from_prefix_cache(prefix, suffixes, seeds=seeds, **kw)
    assert got == [model.generate_from_prefix_cache(prefix, suffix=s, seed=sd, **kw) for s, sd in zip(suffixes, seeds)]
    shared = model.generate_batch_from_prefix_cache(prefix, suffixes[:2], max_tokens=12,
                                                    stop_sequences=[[int(greedy[0][2])]])
    assert shared[0] == model.generate_from_prefix_cache(prefix, suffix=suffixes[0], max_tokens=12,
                                                         stop_sequences=[[int(greedy[0][2])]])


@pytest.mark.parametrize("mode,window", [("fp32", 0), pytest.param("int8", 5, marks=pytest.mark.slow),
                                         pytest.param("fp16-h", 0, marks=pytest.mark.slow)])
def test_generate_batch_of_unrelated_prompts(mode_models, mode, window):
    model = mode_models[mode]
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 1, 9)]
    got = model.generate_batch(prompts, max_tokens=8, loops=2, cache_window=window)
    assert got == [model.generate(p, max_tokens=8, loops=2, cache_window=window) for p in prompts]


def test_prefix_is_not_copied_per_request(mode_models):
    """A call's pool holds the prefix's full pages once, shared by every row's table, and the
    batched decode program's scratch stays far below one copy of the prefix (XLA's memory
    analysis)."""
    model = mode_models["fp32"]
    w, cfg = model.weights, model.weights.config
    prefix = model.build_prefix_cache(prompt_of(120, seed=0), loops=3)
    N = 8
    lay = paged_decode.layout(120, 24, N)
    assert lay.shared == 7 and (lay.tables[:, :7] == np.arange(7)).all() and lay.n_pages < N * 7
    pool = paged_decode.empty_pool(cfg, 3, lay.n_pages)
    rows = paged.Rows(lay.tables, np.full(N, 120, np.int32), np.ones(N, np.int32))
    compiled = paged_decode.lower_decode(w.params, cfg, pool, rows, tl.Knobs.make(N, top_k=0, seeds=list(range(N)),
                                                                                max_tokens=16), 3, 16).compile()
    mem = compiled.memory_analysis()
    assert mem.temp_size_in_bytes < prefix.nbytes, (mem.temp_size_in_bytes, prefix.nbytes)
    assert mem.argument_size_in_bytes < pool.nbytes + sum(x.nbytes for x in jax.tree.leaves(w.params)) + 2**20


def test_prefix_unchanged_and_bad_batches(mode_models):
    model = mode_models["fp32"]
    prefix = model.build_prefix_cache(prompt_of(10), loops=2)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(prefix.cache)]
    model.generate_batch_from_prefix_cache(prefix, ragged(), max_tokens=4)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(prefix.cache)))
    with pytest.raises(ValueError, match="suffixes is empty"):
        model.generate_batch_from_prefix_cache(prefix, [])
    with pytest.raises(ValueError, match=r"suffixes\[1\]\[0\] = 999"):
        model.generate_batch_from_prefix_cache(prefix, [[1], [999]])
    with pytest.raises(ValueError, match="seeds must be a list with one seed per request"):
        model.generate_batch_from_prefix_cache(prefix, [[1], [2]], seeds=[1])
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        model.generate_batch([[]])
    with pytest.raises(RuntimeError, match="loops mismatch"):
        model.generate_batch_from_prefix_cache(prefix, [[1]], loops=3)
