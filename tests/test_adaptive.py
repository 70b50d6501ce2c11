"""Adaptive depth (`model.adaptive`): per-token exits identical to Huginn's own adaptive-compute
generator (goldens from scripts/make_huginn_golden.py --adaptive, which runs the reference's
`generate_with_adaptive_compute` with the latest-m4 lookup), Ouro's gate with skipping, and the
runtime's paths (prefix, batch) under exits."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.model import transformer as tf
from tinyloop_jax.model import exits
from conftest import prompt_of

DATA = os.path.join(os.path.dirname(__file__), "data")
_MODELS: dict = {}


def huginn(kv_mode: str = "fp32") -> tl.Model:
    """The 2/4/2 tiny Huginn with the zero initial state (the goldens' init_scale=0)."""
    if ("huginn", kv_mode) not in _MODELS:
        w = tl.Model.from_pretrained(os.path.join(DATA, "huginn-tiny-242"), kv_mode=kv_mode).weights
        _MODELS["huginn", kv_mode] = tl.Model(w.params, w.config.replace(state_init_scale=0.0))
    return _MODELS["huginn", kv_mode]


def ouro(kv_mode: str = "fp32") -> tl.Model:
    if ("ouro", kv_mode) not in _MODELS:
        _MODELS["ouro", kv_mode] = tl.Model.from_pretrained(os.path.join(DATA, "ouro-tiny"), kv_mode=kv_mode)
    return _MODELS["ouro", kv_mode]


def adaptive_golden():
    g = dict(np.load(os.path.join(DATA, "huginn-tiny-242", "adaptive.npz")))
    prompts = dict(np.load(os.path.join(DATA, "huginn-tiny-242", "golden.npz")))
    return g, json.loads(str(g["cases"])), prompts


@pytest.mark.parametrize("criterion", ["kl", "entropy-diff", "latent-diff", "cosine", "argmax-stability"])
def test_tokens_and_passes_match_the_reference_adaptive_generator(criterion):
    """Every case of the criterion (two thresholds, two prompts, exit in the prompt or not,
    continuous compute or not, a later and sparser check schedule): the same greedy tokens
    and the same passes run for every token as the reference."""
    g, cases, prompts = adaptive_golden()
    m, steps, checked = huginn(), int(g["steps"]), 0
    for c in (c for c in cases if c["criterion"] == criterion):
        prompt = prompts[f"prompt_{c['prompt']}"]
        out = m.generate(prompt, max_tokens=len(g[c["key"] + "_tokens"]), loops=steps, exit_criterion=criterion,
                         exit_threshold=c["threshold"], min_steps=c["min_steps"], check_every=c["check_every"],
                         exit_in_prefill=c["exit_in_prefill"], continuous_compute=c["continuous_compute"])
        assert out[len(prompt):] == g[c["key"] + "_tokens"].tolist(), c
        assert m.last_passes == g[c["key"] + "_passes"].tolist(), c
        checked += 1
    assert checked == 20
    # the goldens exercise real exits, not only full depth
    passes = np.concatenate([g[c["key"] + "_passes"] for c in cases if c["criterion"] == criterion])
    assert passes.min() < steps - 1 and (passes == steps).any()


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_min_steps_equal_to_loops_is_full_depth(family):
    m = huginn() if family == "huginn" else ouro()
    loops = m.weights.config.default_loops + 1
    p = prompt_of(7, seed=3)
    full = m.generate(p, max_tokens=8, loops=loops)
    for crit in ("kl", "latent-diff") + (("gate",) if family == "ouro" else ()):
        assert m.generate(p, max_tokens=8, loops=loops, exit_criterion=crit, min_steps=loops) == full
        assert m.last_passes == [loops] * 8
    m.generate(p, max_tokens=3, loops=loops)
    assert m.last_passes is None  # a call without a criterion reports none


@pytest.mark.parametrize("family,mode", [("huginn", "fp32"), ("huginn", "int8"), ("ouro", "fp32"), ("ouro", "int8-h")])
def test_prefix_reuse_equals_recompute_under_exits(family, mode):
    """A prefix built once (at full depth) then decoded with exits == the whole prompt decoded
    with exits: the same tokens and the same passes per token."""
    m = huginn(mode) if family == "huginn" else ouro(mode)
    crit, thr = ("entropy-diff", 1e-2) if family == "huginn" else ("gate", 0.4)
    prompt, suffix, loops = prompt_of(11, seed=5), prompt_of(4, seed=6), 6
    kw = dict(max_tokens=10, loops=loops, exit_criterion=crit, exit_threshold=thr)
    whole = m.generate(np.concatenate([prompt, suffix]), **kw)
    whole_depths = m.last_passes
    prefix = m.build_prefix_cache(prompt, loops=loops)
    assert m.generate_from_prefix_cache(prefix, suffix=suffix, **kw) == whole
    assert m.last_passes == whole_depths and min(whole_depths) < loops
    # no suffix: the first token comes from the prefix's own logits
    assert m.generate_from_prefix_cache(prefix, **kw) == m.generate(prompt, **kw)


def test_batched_rows_equal_single_requests():
    m, loops = huginn(), 6
    prompts = [prompt_of(n, seed=20 + n) for n in (3, 9, 6)]
    for kw in (dict(exit_criterion="latent-diff", exit_threshold=0.3),
               dict(exit_criterion="kl", exit_threshold=1e-2, continuous_compute=True, exit_in_prefill=True),
               dict(exit_criterion="argmax-stability", exit_threshold=2, min_steps=1, check_every=2)):
        rows = m.generate_batch(prompts, max_tokens=9, loops=loops, **kw)
        depths = m.last_passes
        for p, row, d in zip(prompts, rows, depths):
            assert m.generate(p, max_tokens=9, loops=loops, **kw) == row, kw
            assert m.last_passes == d, kw
    prefix = m.build_prefix_cache(prompts[1], loops=loops)
    suffixes = [prompt_of(n, seed=40 + n) for n in (0, 2, 5)]
    kw = dict(max_tokens=7, exit_criterion="cosine", exit_threshold=5e-2)
    rows, depths = m.generate_batch_from_prefix_cache(prefix, suffixes, **kw), m.last_passes
    for s, row, d in zip(suffixes, rows, depths):
        assert m.generate_from_prefix_cache(prefix, suffix=s, **kw) == row
        assert m.last_passes == d


def test_gate_exit_follows_the_exit_distribution():
    """Ouro's gate with skipping: the first decoded token's depth is the first pass whose
    cumulative exit probability (Ouro's exit distribution over a full-depth run of the same
    positions) reaches the threshold, and the token is that pass's argmax."""
    m, loops, thr = ouro(), 4, 0.3
    p = prompt_of(9, seed=8)
    out = m.generate(p, max_tokens=2, loops=loops, exit_criterion="gate", exit_threshold=thr)
    depth = m.last_passes[1]
    seq = np.asarray(out[:len(p) + 1], np.int32)
    w = m.weights
    states = m.build_prefix_cache(seq, loops=loops).depth_states[w.config.n_pre_blocks:]  # [loops, D]
    cdf = np.cumsum(np.asarray(exits.exit_distribution(w.params, states[:, None]))[:, 0])
    expected = int(np.argmax(cdf >= thr)) + 1
    assert depth == expected and m.last_passes[0] == loops
    logits = tf.lm_head(w.params, w.config, states[expected - 1])
    assert out[-1] == int(jnp.argmax(logits))


def test_bad_adaptive_arguments():
    m, p = huginn(), prompt_of(5)
    bad = [(dict(exit_criterion="entropy"), "entropy"),
           (dict(exit_criterion="kl", exit_threshold=float("nan")), "nan"),
           (dict(exit_criterion="kl", exit_threshold=-0.1), "-0.1"),
           (dict(exit_criterion="kl", min_steps=9, loops=8), "min_steps=9"),
           (dict(exit_criterion="kl", check_every=0), "check_every"),
           (dict(exit_criterion="kl", min_steps=-1), "min_steps"),
           (dict(exit_criterion="argmax-stability", exit_threshold=2.5), "2.5"),
           (dict(exit_criterion="gate"), "gate"),
           (dict(min_steps=2), "exit_criterion"),
           (dict(exit_in_prefill=True), "exit_criterion"),
           (dict(exit_criterion="kl", draft_loops=1), "draft_loops"),
           (dict(exit_criterion="kl", exit_in_prefill="yes"), "yes")]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name.replace("[", r"\[")):
            m.generate(p, max_tokens=2, **kw)
    with pytest.raises(ValueError, match="continuous_compute"):
        ouro().generate(p, max_tokens=2, exit_criterion="kl", continuous_compute=True)
    with pytest.raises(ValueError, match="exit_in_prefill"):
        m.generate_from_prefix_cache(m.build_prefix_cache(p), max_tokens=2, exit_criterion="kl",
                                     exit_in_prefill=True)


def test_engine_requests_with_mixed_criteria_equal_generate():
    """Requests with different exit rules (and none) batched together in the engine: each one's
    tokens and passes per token equal `generate`'s; the engine counts the passes it skipped."""
    m, loops = huginn(), 6
    work = [(prompt_of(9, seed=60), dict(exit_criterion="kl", exit_threshold=1e-2)),
            (prompt_of(5, seed=61), dict()),
            (prompt_of(12, seed=62), dict(exit_criterion="latent-diff", exit_threshold=0.3)),
            (prompt_of(7, seed=63), dict(exit_criterion="entropy-diff", exit_threshold=1e-2, continuous_compute=True)),
            (prompt_of(9, seed=60), dict(exit_criterion="argmax-stability", exit_threshold=2, min_steps=1))]
    with tl.Engine(m, max_batch=4, prefill_chunk=16) as eng:
        handles = [eng.submit(p, max_tokens=8, loops=loops, **kw) for p, kw in work]
        got = [(h.result(), h.passes) for h in handles]
        stats = eng.stats()
    skipped = 0
    for (p, kw), (tokens, depths) in zip(work, got):
        assert tokens == m.generate(p, max_tokens=8, loops=loops, **kw), kw
        assert depths == (m.last_passes or []), kw
        skipped += sum(loops - d for d in depths)
    assert skipped > 0 and stats["depths"][loops]["passes_skipped"] == skipped
    with tl.Engine(m) as eng, pytest.raises(ValueError, match="check_every"):
        eng.submit(prompt_of(3), exit_criterion="kl", check_every=0)


def test_engine_prompts_that_exit_in_prefill_equal_generate():
    """exit_in_prefill in the engine: each such prompt is one chunk exiting as a whole (40 tokens
    against the engine's chunks of 16; 130 tokens, three of its blocks of 64), beside a request
    with the same prompt at full depth (no pages shared between them) and others: tokens and
    passes per token equal `generate`'s, and some prompt exits before the last pass."""
    m, loops = huginn(), 6
    p = prompt_of(40, seed=70)
    work = [(p, dict(exit_criterion="kl", exit_threshold=1e-2, exit_in_prefill=True)),
            (p, dict(exit_criterion="kl", exit_threshold=1e-2)),
            (prompt_of(9, seed=71), dict(exit_criterion="latent-diff", exit_threshold=0.3, exit_in_prefill=True,
                                         continuous_compute=True)),
            (prompt_of(12, seed=72), dict()),
            (prompt_of(130, seed=73), dict(exit_criterion="kl", exit_threshold=1e-2, exit_in_prefill=True))]
    with tl.Engine(m, max_batch=5, prefill_chunk=16) as eng:
        handles = [eng.submit(q, max_tokens=8, loops=loops, **kw) for q, kw in work]
        got = [(h.result(), h.passes) for h in handles]
        with pytest.raises(ValueError, match="exit_in_prefill needs an exit_criterion"):
            eng.submit(p, exit_in_prefill=True)
    for (q, kw), (tokens, depths) in zip(work, got):
        assert tokens == m.generate(q, max_tokens=8, loops=loops, **kw), kw
        assert depths == (m.last_passes or []), kw
    assert min(got[0][1][0], got[2][1][0]) < loops and got[4][1][0] < loops


@pytest.mark.parametrize("family, criterion, threshold, warm", [("huginn", "kl", 1e-2, False),
                                                                ("huginn", "latent-diff", 0.5, True),
                                                                ("ouro", "gate", 0.5, False)])
def test_a_prompt_exiting_in_prefill_runs_in_blocks_as_it_would_whole(family, criterion, threshold, warm):
    """A prompt exiting in prefill runs each pass a block of positions at a time
    (`paged_adaptive.forward(block=...)`: one program for every length) and gives what the
    same chunk run whole gives: two rows of 150 and 37 tokens in a chunk of 192 (3 blocks of
    64 and 1), against the chunk as one block: the same passes, and within the equivalence
    bound the logits, the last states and every page the pool holds, under a logit criterion
    (the coda run over every block), a latent one (its mean summed over blocks, continuous
    compute) and Ouro's gate; a row exits before the last pass."""
    import jax

    from tinyloop_jax.decoding import paged_decode
    from tinyloop_jax.model import adaptive as ad
    from tinyloop_jax.model import paged
    from tinyloop_jax.model import paged_adaptive as pa

    m, loops, lens, T = (huginn() if family == "huginn" else ouro()), 6, [150, 37], 192
    c = m.weights.config
    lay = paged_decode.layout(0, T, len(lens))
    pool = paged_decode.empty_pool(c, loops, lay.n_pages, lay)
    tokens = np.zeros((len(lens), T), np.int32)
    for i, n in enumerate(lens):
        tokens[i, :n] = prompt_of(n, seed=80 + i)
    rows = paged.Rows(lay.tables, np.zeros(len(lens), np.int32), np.array(lens, np.int32))
    pol = ad.Policy.stack([ad.make_policy(c, loops, criterion, threshold, continuous_compute=warm)] * len(lens))
    state = jnp.asarray(np.random.default_rng(3).normal(size=(len(lens), c.d_model)), c.compute_dtype)
    run = jax.jit(pa.forward, static_argnames=("cfg", "loops", "block"))
    blocked, whole = (run(m.weights.params, c, pool, rows, jnp.asarray(tokens), loops, pol,
                          jnp.zeros(len(lens), jnp.uint32), state if warm else None, block=k) for k in (64, None))
    assert np.array_equal(blocked.depth, whole.depth) and int(np.min(whole.depth)) < loops, whole.depth
    np.testing.assert_allclose(blocked.logits, whole.logits, atol=1e-3, rtol=1e-2)
    np.testing.assert_allclose(blocked.state, whole.state, atol=1e-3, rtol=1e-2)
    for x, y in zip(jax.tree.leaves(blocked.pool), jax.tree.leaves(whole.pool)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=1e-3, rtol=1e-2)
