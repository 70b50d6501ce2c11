"""Depth-flexible prefixes: `at_depth` shallower (layer subset), deeper (kept loop state), and
`Model.resume`; each equals a prefix built at that depth from scratch."""

import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.decoding import paged_decode
from conftest import prompt_of, tiny_model

CLOSE = dict(atol=1e-3, rtol=1e-2)


@pytest.fixture(scope="module")
def model():
    return tiny_model("fp32")


def assert_same_prefix(model, got, want):
    """got serves depth want.loops exactly as want does (got's cache may hold deeper passes)."""
    assert got.loops == want.loops and got.cache.n_layers >= want.cache.n_layers
    np.testing.assert_allclose(got.logits, want.logits, **CLOSE)
    assert np.array_equal(np.asarray(got.cache.pos), np.asarray(want.cache.pos))
    for a, b in ((got.cache.layer(i), want.cache.layer(i)) for i in range(want.cache.n_layers)):
        for name in a:
            np.testing.assert_allclose(np.asarray(a[name], np.float32), np.asarray(b[name], np.float32), **CLOSE)
    suffix = prompt_of(3, seed=9)
    assert (model.generate_from_prefix_cache(got, suffix=suffix, max_tokens=8)
            == model.generate_from_prefix_cache(want, suffix=suffix, max_tokens=8))


@pytest.mark.parametrize("window", [0, pytest.param(9, marks=pytest.mark.slow)])
def test_shallower_is_a_layer_subset_with_its_own_logits(model, window):
    prompt = prompt_of(30, seed=1)
    deep = model.build_prefix_cache(prompt, loops=6, cache_window=window)
    for d in (1, 3, 6):
        got = deep.at_depth(d)
        assert_same_prefix(model, got, model.build_prefix_cache(prompt, loops=d, cache_window=window))
        assert got.cache is deep.cache  # a view: the same arrays, nothing recomputed or copied


@pytest.mark.parametrize("window", [0, 9])
def test_deeper_from_kept_state_runs_only_new_iterations(model, window, monkeypatch):
    prompt = prompt_of(30, seed=2)
    shallow = model.build_prefix_cache(prompt, loops=2, cache_window=window, keep_state=True)
    assert shallow.keeps_state and shallow.nbytes > shallow.cache.nbytes
    ran = []
    run = paged_decode.fill_prefix  # streams in (no embedding): the passes past the kept depth, from its state
    monkeypatch.setattr(paged_decode, "fill_prefix",
                        lambda *a, **kw: (ran.append(a[6]) if np.ndim(a[5]) == 2 else None) or run(*a, **kw))
    for d in (3, 5):
        got = shallow.at_depth(d)
        assert ran[-1] == d - 2  # only the passes past the kept depth ran
        assert_same_prefix(model, got, model.build_prefix_cache(prompt, loops=d, cache_window=window))
        for i in range(shallow.cache.n_layers):  # the first layers are kept as they were, bit for bit
            for name, a in shallow.cache.layer(i).items():
                assert np.array_equal(np.asarray(got.cache.layer(i)[name]), np.asarray(a))
    chained = shallow.at_depth(3).at_depth(6)  # a deepened prefix keeps its state too
    assert_same_prefix(model, chained, model.build_prefix_cache(prompt, loops=6, cache_window=window))


def test_deeper_without_state_and_strict_loops_rule(model):
    prefix = model.build_prefix_cache(prompt_of(12), loops=2)
    with pytest.raises(RuntimeError, match="keep_state=True"):
        prefix.at_depth(4)
    with pytest.raises(RuntimeError, match="loops mismatch"):
        model.generate_from_prefix_cache(prefix, loops=1)
    with pytest.raises(ValueError, match="loops must be >= 1"):
        prefix.at_depth(0)
    with pytest.raises(ValueError, match="keep_state must be True or False"):
        model.build_prefix_cache(prompt_of(4), keep_state="yes")


def test_resume_handle(model):
    prompt = prompt_of(25, seed=3)
    h = model.resume(prompt, loops=1)
    np.testing.assert_allclose(h.logits, model.next_token_logits(prompt, loops=1), **CLOSE)
    h4 = h.deeper(4)
    assert h4.loops == 4 and h.loops == 1
    np.testing.assert_allclose(h4.logits, model.next_token_logits(prompt, loops=4), **CLOSE)
    assert h4.generate(max_tokens=10) == model.generate(prompt, max_tokens=10, loops=4)
    with pytest.raises(ValueError, match="shallower"):
        h4.deeper(2)


def test_kept_state_survives_save_and_load(model, tmp_path):
    prompt = prompt_of(20, seed=4)
    prefix = model.build_prefix_cache(prompt, loops=2, keep_state=True)
    prefix.save(tmp_path / "p")
    back = tl.PrefixCache.load(tmp_path / "p", model)
    assert back.keeps_state
    assert_same_prefix(model, back.at_depth(4), model.build_prefix_cache(prompt, loops=4))
    assert_same_prefix(model, back.at_depth(1), model.build_prefix_cache(prompt, loops=1))
