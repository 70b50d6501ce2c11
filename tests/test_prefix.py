"""Prefix caching: reuse == recompute, the position rule, immutability, threads, persistence."""

import threading

import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from tinyloop_jax.decoding import paged_decode
from tinyloop_jax.api.prefix import tree_equal
from conftest import HUGINN, TINY, prompt_of, tiny_config
from test_model_io import flip_a_byte

CLOSE = dict(atol=1e-3, rtol=1e-2)


def snapshot(prefix):
    """A host copy of every array of a prefix, to compare bit for bit later."""
    import jax
    return [np.array(x) for x in jax.tree.leaves(prefix.cache)], prefix.prompt.copy(), prefix.logits.copy()


def same_as(prefix, snap) -> bool:
    import jax
    leaves, prompt, logits = snap
    now = jax.tree.leaves(prefix.cache)
    return (len(now) == len(leaves) and all(np.array_equal(np.asarray(a), b) and np.asarray(a).dtype == b.dtype
                                            for a, b in zip(now, leaves))
            and np.array_equal(prefix.prompt, prompt) and np.array_equal(prefix.logits, logits))


# Pairwise over (mode, loops, window, suffix length): every pair of values meets in some case.
@pytest.mark.parametrize("mode,loops,window,n_suffix", [
    ("fp32", 1, 0, 1), ("fp16", 1, 9, 7), ("fp32", 4, 9, 7), ("fp16", 4, 0, 1), ("fp32", 8, 0, 7), ("fp16", 8, 9, 1)])
def test_reuse_matches_recompute(models, mode, loops, window, n_suffix):
    model = models[mode]
    prompt = prompt_of(30 + n_suffix, seed=loops * 10 + n_suffix)
    prefix = model.build_prefix_cache(prompt[:30], loops=loops, cache_window=window)
    reused = model.next_token_logits_from_prefix(prefix, prompt[30:])
    recomputed = model.next_token_logits(prompt, loops=loops, cache_window=window)
    np.testing.assert_allclose(reused, recomputed, **CLOSE)
    assert len(prefix) == 30 and prefix.loops == loops and prefix.cache_window == window
    assert prefix.kv_mode == mode


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_seed_000_pair_and_position_reset_is_detected(models, mode):
    """The seed's functional pair reproduces recompute; the same path with the suffix's
    positions reset to 0 must fail the comparison (the position rule is enforced)."""
    model = models[mode]
    w = model.weights
    prefix_ids, suffix_ids = prompt_of(24, seed=1), prompt_of(5, seed=2)
    saved = F.save_prefix_cache(prefix_ids, w)
    before = [np.array(x) for x in __import__("jax").tree.leaves(saved)]
    full = model.next_token_logits(np.concatenate([prefix_ids, suffix_ids]))
    good = F.generate_with_prefix(saved, len(prefix_ids), suffix_ids, w)
    np.testing.assert_allclose(good, full, **CLOSE)
    bad = F.generate_with_prefix(saved, 0, suffix_ids, w)
    assert not np.allclose(bad, full, **CLOSE)
    after = __import__("jax").tree.leaves(saved)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))
    assert int(saved.length) == len(prefix_ids)


def test_prefix_unchanged_after_serial_and_threaded_reuse(models):
    model = models["fp16"]
    prefix = model.build_prefix_cache(prompt_of(40, seed=3), loops=3)
    snap = snapshot(prefix)
    suffixes = [prompt_of(1 + i, seed=100 + i) for i in range(8)]
    kw = dict(max_tokens=12, temperature=0.9, top_k=20)
    serial = [model.generate_from_prefix_cache(prefix, suffix=s, seed=i, **kw) for i, s in enumerate(suffixes)]
    assert same_as(prefix, snap) and len(prefix) == 40
    results = [None] * 8

    def work(i):
        results[i] = model.generate_from_prefix_cache(prefix, suffix=suffixes[i], seed=i, **kw)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == serial
    assert same_as(prefix, snap) and len(prefix) == 40


@pytest.mark.parametrize("mode,window", [("fp32", 0), ("fp16", 9)])
def test_long_prompts_are_prefilled_in_chunks(models, monkeypatch, mode, window):
    """Past `PREFILL_CHUNK` tokens a prefix is prefilled a chunk at a time (8 here): the same
    logits as one forward of the whole prompt, under a window too; so are a kept stream's
    deeper passes (`at_depth` past the prefix's loops), read alone and with a suffix."""
    monkeypatch.setattr(paged_decode, "PREFILL_CHUNK", 8)
    model, p = models[mode], prompt_of(29, seed=8)
    prefix = model.build_prefix_cache(p[:27], loops=2, cache_window=window)
    np.testing.assert_allclose(np.asarray(prefix.logits), model.next_token_logits(p[:27], loops=2,
                                                                                 cache_window=window), **CLOSE)
    np.testing.assert_allclose(model.next_token_logits_from_prefix(prefix, p[27:]),
                               model.next_token_logits(p, loops=2, cache_window=window), **CLOSE)
    deep = model.build_prefix_cache(p[:27], loops=2, cache_window=window, keep_state=True).at_depth(4)
    np.testing.assert_allclose(np.asarray(deep.logits), model.next_token_logits(p[:27], loops=4, cache_window=window),
                               **CLOSE)
    np.testing.assert_allclose(model.next_token_logits_from_prefix(deep, p[27:]),
                               model.next_token_logits(p, loops=4, cache_window=window), **CLOSE)


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("loops", [1, 4])
def test_greedy_from_prefix_equals_greedy_from_full_prompt(models, loops, window):
    model = models["fp32"]
    p, s = prompt_of(25, seed=5), prompt_of(6, seed=6)
    prefix = model.build_prefix_cache(p, loops=loops, cache_window=window)
    a = model.generate_from_prefix_cache(prefix, suffix=s, max_tokens=16)
    b = model.generate(np.concatenate([p, s]), max_tokens=16, loops=loops, cache_window=window)
    assert a == b
    no_suffix = model.generate_from_prefix_cache(prefix, max_tokens=16)
    assert no_suffix[len(p)] == int(np.argmax(prefix.logits))
    assert no_suffix == model.generate(p, max_tokens=16, loops=loops, cache_window=window)


def test_prefix_owns_a_copy_of_its_prompt(models):
    model = models["fp32"]
    p = prompt_of(10)
    prefix = model.build_prefix_cache(p)
    p[:] = 0
    assert prefix.prompt.tolist() != p.tolist()
    with pytest.raises(ValueError):
        prefix.prompt[0] = 1  # read-only


def test_nbytes_reports_the_buffers(models):
    model = models["fp16"]
    prefix = model.build_prefix_cache(prompt_of(30), loops=4)
    cfg = model.config()
    layers = cfg["n_pre_blocks"] + 4
    kv = layers * 2 * 32 * cfg["d_model"] * 2  # capacity bucket 32, fp16
    assert prefix.nbytes == kv + 32 * 4 + 4
    assert model.cache_nbytes(30, loops=4) == layers * 2 * 30 * cfg["d_model"] * 2 + 30 * 4 + 4


def test_loops_mismatch_is_runtime_error(models):
    model = models["fp32"]
    prefix = model.build_prefix_cache(prompt_of(10), loops=4)
    for call in (lambda: model.generate_from_prefix_cache(prefix, loops=8),
                 lambda: model.next_token_logits_from_prefix(prefix, [1], loops=3)):
        with pytest.raises(RuntimeError, match="loops=.*loops=4"):
            call()
    with pytest.raises(RuntimeError, match="cache_window"):
        model.generate_from_prefix_cache(prefix, cache_window=4)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_tokens=0), "max_tokens"), (dict(loops=0), "loops"), (dict(cache_window=-2), "cache_window"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=2.0), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(stop_sequences=[[1], []]), "stop_sequences"),
    (dict(suffix=[1, 500]), "suffix"), (dict(suffix=np.zeros((2, 2), np.int32)), "suffix"),
    (dict(suffix=[0.5]), "suffix"),
])
def test_bad_arguments_from_prefix_are_value_errors(models, kwargs, msg):
    model = models["fp32"]
    prefix = model.build_prefix_cache(prompt_of(10), loops=3)
    snap = snapshot(prefix)
    with pytest.raises(ValueError, match=msg):
        model.generate_from_prefix_cache(prefix, **kwargs)
    assert same_as(prefix, snap)


def test_prefix_from_another_model_is_value_error(models):
    other = tl.Model.random(tiny_config(kv_mode="fp32"), seed=99)
    prefix = other.build_prefix_cache(prompt_of(10))
    with pytest.raises(ValueError, match="another model"):
        models["fp32"].generate_from_prefix_cache(prefix)
    with pytest.raises(ValueError, match="PrefixCache"):
        models["fp32"].generate_from_prefix_cache("not a prefix")


def test_prefix_too_long_is_runtime_error(models):
    model = models["fp32"]
    prefix = model.build_prefix_cache(prompt_of(100))
    with pytest.raises(RuntimeError, match="max_seq_len"):
        model.generate_from_prefix_cache(prefix, suffix=prompt_of(20), max_tokens=9)


def test_save_load_round_trip(models, tmp_path):
    model = models["fp16"]
    prefix = model.build_prefix_cache(prompt_of(33, seed=4), loops=4, cache_window=12)
    prefix.save(tmp_path / "p")
    loaded = tl.PrefixCache.load(tmp_path / "p", model)
    assert tree_equal(loaded.cache, prefix.cache)
    assert np.array_equal(loaded.prompt, prefix.prompt) and np.array_equal(loaded.logits, prefix.logits)
    assert (loaded.loops, loaded.cache_window, loaded.kv_mode, len(loaded)) == (4, 12, "fp16", 33)
    s = prompt_of(5, seed=8)
    kw = dict(max_tokens=10, suffix=s, temperature=0.8, seed=3)
    assert model.generate_from_prefix_cache(loaded, **kw) == model.generate_from_prefix_cache(prefix, **kw)
    # a reloaded model (same weights) accepts it too, by fingerprint
    model.save(tmp_path / "m")
    again = tl.Model.load(tmp_path / "m")
    assert again.generate_from_prefix_cache(tl.PrefixCache.load(tmp_path / "p", again), **kw) == \
        model.generate_from_prefix_cache(prefix, **kw)


def test_bad_prefix_checkpoints_raise(models, tmp_path):
    model = models["fp16"]
    prefix = model.build_prefix_cache(prompt_of(20))
    prefix.save(tmp_path / "p")
    with pytest.raises(ValueError, match="already exists"):
        prefix.save(tmp_path / "p")
    with pytest.raises(ValueError, match="different model"):
        tl.PrefixCache.load(tmp_path / "p", models["fp32"])  # same weights, other kv_mode
    with pytest.raises(ValueError, match="different model"):
        tl.PrefixCache.load(tmp_path / "p", tl.Model.random(tiny_config(kv_mode="fp16"), seed=5))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a tinyloop"):
        tl.PrefixCache.load(tmp_path / "empty", model)
    model.save(tmp_path / "model")
    with pytest.raises(ValueError, match="'model' checkpoint"):
        tl.PrefixCache.load(tmp_path / "model", model)
    flip_a_byte(tmp_path / "p" / "arrays")
    with pytest.raises(RuntimeError, match="corrupted|truncated"):
        tl.PrefixCache.load(tmp_path / "p", model)
    prefix.save(tmp_path / "q")
    import shutil
    shutil.rmtree(tmp_path / "q" / "arrays")
    with pytest.raises(RuntimeError, match="truncated|corrupted"):
        tl.PrefixCache.load(tmp_path / "q", model)


# A model of local layers (windows of their own: the dense segment keeps them in rings)
LOCAL = dict(block="llama", vocab_size=96, d_model=64, n_heads=4, n_kv_heads=1, head_dim=32, intermediate_size=96,
             n_pre_blocks=3, loop_blocks=1, default_loops=2, max_seq_len=256, qk_norm=True, layer_windows=(6, 0, 6, 0),
             rope_theta=1e6, rope_local_theta=1e4)


@pytest.mark.parametrize("cfg,window,rings", [(dict(TINY, kv_mode="fp32"), 16, False),
                                              (dict(LOCAL, kv_mode="fp32"), 0, True),
                                              (dict(LOCAL, kv_mode="int8-h"), 24, True),
                                              (dict(HUGINN), 0, False)],
                         ids=["window", "rings", "rings-h-window", "injection"])
def test_a_prefix_built_on_pages_equals_the_dense_prefill(cfg, window, rings):
    """A prefix is built by the paged step and gathered from its pages (`page_pool.to_segment`);
    the dense prefill (`programs.prefill`, which runs no page) is the reference: the same
    positions in the same slots (a window's ring, the local layers' rings), stored values within
    the equivalence bound (a quantized one within a step), logits, depth states and the stream
    `keep_state` keeps (an injection model's (state | e) carry) too. The dense segment loaded
    into pages and gathered back is itself, bit for bit."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp
    from tinyloop_jax.decoding import programs
    from tinyloop_jax.decoding.compiled import SHARED

    w = tl.Model.random(tl.ModelConfig(**cfg), seed=2).weights
    prompt = prompt_of(70, seed=5, vocab=cfg["vocab_size"])
    paged = F.build_prefix(w, prompt, cache_window=window, keep_state=True)
    loops, n = w.config.default_loops, len(prompt)
    out = programs.prefill(w.params, w.config, jnp.asarray(F.pad(prompt)), jnp.int32(n), jnp.int32(0), (),
                           F.empty_cache(w, n, loops, window), loops=loops, window=window, keep_states=True,
                           keep_x=True)
    dense = SimpleNamespace(cache=out.own, logits=out.logits, depth_states=out.depth_states, loops=loops)
    assert paged.state.shape == out.x.shape
    np.testing.assert_allclose(np.asarray(paged.state)[:n], np.asarray(out.x)[:n], **CLOSE)
    assert paged.cache.rings == dense.cache.rings and bool(dense.cache.rings) == rings
    for a, b in zip(jax.tree.leaves(paged.cache), jax.tree.leaves(dense.cache)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == np.int32:  # the positions each slot holds
            assert np.array_equal(a, b)
        elif np.issubdtype(a.dtype, np.integer):  # quantized values
            assert np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 1
        else:
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), **CLOSE)
    np.testing.assert_allclose(np.asarray(paged.logits), np.asarray(dense.logits), **CLOSE)
    np.testing.assert_allclose(np.asarray(paged.depth_states), np.asarray(dense.depth_states), **CLOSE)
    pool, pages = F.prefix_pool(w, len(prompt), dense.loops)
    pool = SHARED.load_segment(pool, dense.cache, jnp.asarray(pages), jnp.int32(0), jnp.int32(len(prompt)))
    back = SHARED.to_segment(pool, jnp.asarray(pages), jnp.int32(len(prompt)), capacity=dense.cache.capacity,
                             rings=dense.cache.rings, ring_capacity=dense.cache.ring_capacity if rings else 0)
    assert tree_equal(back, dense.cache)
