"""Incremental decode == recompute, sampling semantics, compile counts, in-place decode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.decoding import paged_decode
from tinyloop_jax.decoding.compiled import SHARED
from tinyloop_jax.model import paged
from tinyloop_jax.model import page_pool
from tinyloop_jax.api import functional as F
from conftest import cache_layers, prompt_of, tiny_config


def greedy_reference(model, prompt, n, loops, window=0, penalty=1.0, stops=()):
    """Independent loop: a from-scratch forward per token, argmax in numpy."""
    seq, emitted = list(prompt), []
    for _ in range(n):
        logits = model.next_token_logits(seq, loops=loops, cache_window=window).astype(np.float64)
        if penalty != 1.0:
            seen = np.zeros_like(logits, bool)
            seen[seq] = True
            logits = np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)
        tok = int(np.argmax(logits))
        seq.append(tok)
        emitted.append(tok)
        if any(len(emitted) >= len(s) and emitted[-len(s):] == list(s) for s in stops):
            break
    return seq


# Pairwise over (mode, loops, window): every pair of values meets in some case; the storage
# mode, the depth and the window act on different parts of the program (codec, pass loop, mask).
@pytest.mark.parametrize("mode,loops,window", [("fp32", 1, 0), ("fp16", 1, 6), ("fp32", 3, 6), ("fp16", 3, 0),
                                               ("fp32", 8, 0), ("fp16", 8, 6)])
def test_incremental_decode_matches_recompute(models, mode, loops, window):
    model = models[mode]
    prompt = prompt_of(20, seed=loops + window)
    n = 14  # with window 6 the own segment (capacity 16) and prompt segment both wrap
    out = model.generate(prompt, max_tokens=n, loops=loops, cache_window=window)
    ref = greedy_reference(model, prompt, n, loops, window)
    assert out == ref
    # the cached path's logits, step by step, against a from-scratch forward of each prefix
    w = model.weights
    cache = F.empty_cache(w, len(out), loops=loops, cache_window=window)
    logits, cache = F.prefill(w, prompt, cache, loops=loops, cache_window=window)
    for i in range(len(prompt), len(out)):
        fresh = model.next_token_logits(out[:i], loops=loops, cache_window=window)
        np.testing.assert_allclose(np.asarray(logits), fresh, atol=1e-3, rtol=1e-2)
        logits, cache = F.decode_step(w, out[i], cache, loops=loops, cache_window=window)
    assert int(cache.length) == len(out)


def test_chunked_prefill_equals_token_by_token(models):
    """A prompt prefilled in uneven chunks gives the same logits and cache as one chunk."""
    model = models["fp16"]
    w, prompt = model.weights, prompt_of(29, seed=5)
    one = F.empty_cache(w, 29)
    l1, one = F.prefill(w, prompt, one)
    many = F.empty_cache(w, 29)
    for a, b in [(0, 1), (1, 9), (9, 10), (10, 29)]:
        l2, many = F.prefill(w, prompt[a:b], many)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=1e-4, rtol=1e-4)
    for a, b in zip(cache_layers(one), cache_layers(many)):
        np.testing.assert_allclose(np.asarray(a["k"], np.float32), np.asarray(b["k"], np.float32), atol=2e-3)


def test_top_k_1_is_greedy(models):
    model, p = models["fp32"], prompt_of(12, seed=7)
    greedy = model.generate(p, max_tokens=16)
    assert model.generate(p, max_tokens=16, temperature=1.7, top_k=1, seed=3) == greedy
    assert model.generate(p, max_tokens=16, temperature=1.0, top_k=0, top_p=1e-6, seed=4) == greedy


def test_seed_determinism(models):
    model, p = models["fp32"], prompt_of(12, seed=8)
    kw = dict(max_tokens=24, temperature=2.0, top_k=0)
    a = model.generate(p, seed=11, **kw)
    assert model.generate(p, seed=11, **kw) == a
    assert model.generate(p, seed=12, **kw) != a


def test_sampled_tokens_respect_top_k_and_top_p(models):
    """Over many seeds, the first sampled token always lies in the numpy-computed top-k set /
    top-p nucleus of the first step's distribution."""
    model, p = models["fp32"], prompt_of(12, seed=9)
    logits = model.next_token_logits(p).astype(np.float64)
    order = np.argsort(-logits)
    top5 = set(order[:5].tolist())
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[before < 0.6].tolist())
    firsts_k = {model.generate(p, max_tokens=1, temperature=1.0, top_k=5, seed=s)[-1] for s in range(40)}
    firsts_p = {model.generate(p, max_tokens=1, temperature=1.0, top_k=0, top_p=0.6, seed=s)[-1] for s in range(40)}
    assert firsts_k <= top5 and len(firsts_k) > 1
    assert firsts_p <= nucleus


def test_repetition_penalty_matches_reference(models):
    model, p = models["fp32"], prompt_of(15, seed=10)
    out = model.generate(p, max_tokens=20, repetition_penalty=1.8, loops=3)
    assert out == greedy_reference(model, p, 20, 3, penalty=1.8)
    assert out != model.generate(p, max_tokens=20, loops=3)  # the penalty changed something


def test_stop_sequences_match_reference(models):
    model, p = models["fp32"], prompt_of(15, seed=4)
    free = model.generate(p, max_tokens=24, loops=1)
    emitted = free[len(p):]
    stop = emitted[5:7]  # a pair the free run emits: generation must end right after it
    first = next(i for i in range(len(emitted) - 1) if emitted[i:i + 2] == stop)
    out = model.generate(p, max_tokens=24, loops=1, stop_sequences=[[127, 126, 125], stop])
    assert out == greedy_reference(model, p, 24, 1, stops=[[127, 126, 125], stop])
    assert out == free[: len(p) + first + 2]


def test_output_length_contract(models):
    model, p = models["fp32"], prompt_of(9, seed=1)
    for n in (1, 2, 7, 33):
        out = model.generate(p, max_tokens=n, temperature=1.0, seed=n)
        assert len(out) == len(p) + n and out[: len(p)] == p.tolist()
        assert all(0 <= t < 128 for t in out)


@pytest.mark.slow
def test_compiles_a_handful_of_programs_for_20_prompt_lengths():
    model = tl.Model.random(tiny_config(kv_mode="fp32", max_seq_len=128, d_model=16), seed=3)
    programs = (SHARED.step, SHARED.decode_steps)
    before = sum(p._cache_size() for p in programs)
    lengths = np.random.default_rng(0).choice(np.arange(1, 100), 20, replace=False)
    for n in lengths:
        model.generate(prompt_of(int(n), seed=int(n)), max_tokens=8)
    compiled = sum(p._cache_size() for p in programs) - before
    # buckets 16/32/64/128 of the prompt (the prefill's chunk) beside those of prompt + max_tokens
    # (the page table): at most 7 prefills, and one decode per table bucket
    assert compiled <= 11, compiled


def test_decode_updates_cache_in_place():
    """The decode program aliases the donated page pool to its outputs, and its scratch memory
    is far below one copy of the pool (no per-step copy of the pages)."""
    cfg = tiny_config(kv_mode="fp32", max_seq_len=1024)
    model = tl.Model.random(cfg, seed=0)
    pool = page_pool.empty(cfg, 3, 64)
    compiled = paged_decode.lower_decode(model.weights.params, cfg, pool, paged.Rows.make([list(range(64))], [16], [1]),
                                         tl.Knobs.make(1, max_tokens=8), 3, 16).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= pool.nbytes - 8
    assert mem.temp_size_in_bytes < pool.nbytes / 4, (mem.temp_size_in_bytes, pool.nbytes)


def test_request_rows_are_the_sampling_params():
    """`Knobs.from_params`: row i holds the i-th SamplingParams (the stops padded and
    left-aligned, or left out for callers that check them on the host); `Knobs.make` is the
    same rows from keywords."""
    a = tl.SamplingParams(max_tokens=5, temperature=0.7, top_k=3, top_p=0.9, repetition_penalty=1.2, seed=9,
                          stop_sequences=((1, 2, 3), (4,)))
    req = tl.Knobs.from_params([a, tl.SamplingParams()])
    assert req.max_tokens.tolist() == [5, 32] and req.top_k.tolist() == [3, 50] and req.seed.tolist() == [9, 0]
    np.testing.assert_array_equal(req.temperature, np.float32([0.7, 0.0]))
    np.testing.assert_array_equal(req.top_p, np.float32([0.9, 1.0]))
    np.testing.assert_array_equal(req.repetition_penalty, np.float32([1.2, 1.0]))
    assert req.stop.tokens.shape == (2, 2, 4) and req.stop.lengths.tolist() == [[3, 1], [0, 0]]
    assert req.stop.tokens[0, 0].tolist() == [1, 2, 3, -1] and req.stop.tokens[0, 1].tolist() == [4, -1, -1, -1]
    assert tl.Knobs.from_params([a], stops=False).stop.lengths.tolist() == [[0]]
    made = tl.Knobs.make(2, temperature=0.7, top_k=3, top_p=0.9, repetition_penalty=1.2, seeds=[9, 0],
                           max_tokens=[5, 5], stop_sequences=[[[1, 2, 3], [4]], []])
    want = tl.Knobs.from_params([a, dataclasses.replace(a, seed=0, stop_sequences=())])
    assert jax.tree.all(jax.tree.map(np.array_equal, made, want))


def test_a_request_as_two_values_equals_the_keywords():
    """`generate` and `generate_from_prefix_cache` take the request as two values — params (a
    `SamplingParams`) and plan (a `DepthPlan`) — and the keywords are sugar over them: the same
    tokens either way; a field given both ways is a ValueError naming it."""
    model = tl.Model.random(tiny_config(kv_mode="fp32"), seed=0)
    p = prompt_of(12, seed=2)
    kw = dict(max_tokens=7, temperature=0.8, top_k=20, seed=5, stop_sequences=[[3, 4]], logit_bias={7: 2.0})
    params = tl.SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=5, stop_sequences=((3, 4),),
                               logit_bias=((7, 2.0),))
    assert model.generate(p, params=params, plan=tl.Speculative(loops=2, draft_loops=1, lookahead=2)) == \
        model.generate(p, loops=2, draft_loops=1, lookahead=2, **kw)
    prefix = model.build_prefix_cache(p[:8])
    plan = tl.Adaptive(criterion="latent-diff", threshold=0.5)
    assert model.generate_from_prefix_cache(prefix, suffix=p[8:], params=params, plan=plan) == \
        model.generate_from_prefix_cache(prefix, suffix=p[8:], exit_criterion="latent-diff", exit_threshold=0.5, **kw)
    with pytest.raises(ValueError, match="pass max_tokens inside the SamplingParams or as keywords"):
        model.generate(p, max_tokens=3, params=params)
    with pytest.raises(ValueError, match="pass loops inside the DepthPlan"):
        model.generate(p, loops=3, plan=tl.Fixed(loops=2))
    with pytest.raises(ValueError, match="expected a DepthPlan"):
        model.generate(p, plan=dict(loops=2))


def test_batch_calls_take_the_request_as_values():
    """The batch calls take params (one `SamplingParams` for every row, or a list of one per
    row) and plan (a `DepthPlan`): the same tokens as the keywords (`seeds`, per-row stops)."""
    model = tl.Model.random(tiny_config(kv_mode="fp32"), seed=0)
    prompts = [prompt_of(9, seed=3), prompt_of(5, seed=4)]
    rows = [tl.SamplingParams(max_tokens=6, temperature=0.8, seed=s, stop_sequences=st)
            for s, st in ((1, ((3, 4),)), (7, ()))]
    plan = tl.DepthPlan.of(loops=3, exit_criterion="latent-diff", exit_threshold=0.5)
    kw = dict(max_tokens=6, temperature=0.8, seeds=[1, 7], stop_sequences=[[[3, 4]], []], loops=3,
              exit_criterion="latent-diff", exit_threshold=0.5)
    assert model.generate_batch(prompts, params=rows, plan=plan) == model.generate_batch(prompts, **kw)
    prefix = model.build_prefix_cache(prompts[0][:6], loops=3)
    suffixes = [prompts[0][6:], []]
    assert model.generate_batch_from_prefix_cache(prefix, suffixes, params=rows, plan=plan) == \
        model.generate_batch_from_prefix_cache(prefix, suffixes, **kw)
    one = tl.SamplingParams(max_tokens=4, temperature=0.5, seed=2)
    assert model.generate_batch(prompts, params=one) == \
        model.generate_batch(prompts, max_tokens=4, temperature=0.5, seeds=[2, 2])
    with pytest.raises(ValueError, match="pass seeds inside the SamplingParams or as keywords"):
        model.generate_batch(prompts, params=rows, seeds=[1, 2])
    with pytest.raises(ValueError, match="params has 1 SamplingParams for 2 requests"):
        model.generate_batch(prompts, params=rows[:1])
    with pytest.raises(ValueError, match="draft_loops=1: a batch call does not speculate"):
        model.generate_batch(prompts, plan=tl.Speculative(loops=2, draft_loops=1))


def test_argmax_is_jnp_argmax_with_ties_and_nans():
    """The greedy pick's two-reduction argmax (`sampling.argmax`) against jnp.argmax: the first
    of tied maxima, the first NaN, rows of a batch, -inf rows."""
    from tinyloop_jax.decoding import sampling
    rng = np.random.default_rng(0)
    rows = rng.integers(-3, 4, (64, 50)).astype(np.float32)  # many ties
    rows[3, 7] = rows[3, 20] = np.nan
    rows[5] = -np.inf
    rows[6, :] = 2.0
    np.testing.assert_array_equal(np.asarray(sampling.argmax(jnp.asarray(rows))), np.argmax(rows, axis=-1))
    one = rng.normal(size=262144).astype(np.float32)
    assert int(sampling.argmax(jnp.asarray(one))) == int(np.argmax(one))
