"""Depth is data, not program size: the loop's passes run under `fori_loop` over a stacked pass
axis, so programs do not grow with `loops`, very deep calls work and equal an independent
reference, and a depth whose cache cannot fit is refused before anything is built."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.model import cache as kvc
from tinyloop_jax.decoding import programs as engine
from tinyloop_jax.api import functional as F
from tinyloop_jax.decoding import paged_decode
from tinyloop_jax.decoding import step as St
from tinyloop_jax.decoding.compiled import SHARED
from tinyloop_jax.model import paged
from tinyloop_jax.model import page_pool
from conftest import prompt_of, tiny_config, tiny_model
from reference import forward as ref_forward


def hlo_size(lowered) -> int:
    """Instructions in a lowered program's StableHLO text (one `%x = op` per line)."""
    return sum(1 for line in lowered.as_text().splitlines() if re.match(r"\s*%\S+ = ", line))


def programs(model, loops: int) -> dict:
    """Every jitted program of a call at depth `loops`, lowered (not compiled) for a tiny model."""
    w = model.weights
    p, c = w.params, w.config
    own = kvc.empty(c.kv_mode, c.n_pre_blocks, loops, c.n_heads, 16, c.head_dim)
    pool = page_pool.empty(c, loops, 4)
    rows = paged.Rows.make([[0, 1], [2, 3]], [5, 5], [5, 5])
    tokens, n = jnp.zeros((16,), jnp.int32), jnp.int32(5)
    seen = jnp.zeros((2, c.vocab_size), bool)
    req = tl.Knobs.make(2, max_tokens=8)
    kw = dict(loops=loops, window=0)
    one = rows.replace(n_new=np.ones((2,), np.int32))
    state = jax.eval_shape(functools.partial(St.requests_of, d_model=c.d_model, dtype=c.compute_dtype), seen, req)
    chunks = St.Chunks(rows, np.zeros((2, 16), np.int32), None, np.ones((2,), bool))
    return {
        "prefill": engine.prefill.lower(p, c, tokens, n, jnp.int32(0), (), own, **kw),
        "prefill_prefix": engine.prefill.lower(p, c, tokens, n, jnp.int32(0), (), own, **kw, keep_states=True,
                                               keep_x=True),
        "prefill_rows": SHARED.step.lower(p, c, pool, state, chunks, None, loops=loops),
        "decode": paged_decode.lower_decode(p, c, pool, one, req, loops, 8),
        "speculative": paged_decode.lower_decode(p, c, pool, one, req, loops, 8, draft_loops=1, lookahead=2),
        "continue_depth": engine.prefill.lower(p, c, jnp.zeros((16, c.d_model)), n, jnp.int32(0), (),
                                               kvc.empty(c.kv_mode, 0, loops, c.n_heads, 16, c.head_dim), **kw,
                                               keep_states=True, keep_x=True),
    }


@pytest.mark.parametrize("mode", ["fp32", pytest.param("int8-h", marks=pytest.mark.slow)])
def test_program_size_does_not_grow_with_depth(models, mode):
    shallow, deep = programs(models[mode], 4), programs(models[mode], 32)
    for name in shallow:
        a, b = hlo_size(shallow[name]), hlo_size(deep[name])
        assert b <= 1.2 * a, (name, a, b)


def test_loops_256_generates_and_equals_numpy():
    model = tiny_model("fp32")
    prompt = prompt_of(12, seed=3)
    out = model.generate(prompt, max_tokens=6, loops=256)
    seq = list(prompt)
    for _ in range(6):  # an independent numpy forward at depth 256 for every next token
        logits = ref_forward(model.weights.params, model.config()["n_heads"], seq, loops=256)[-1]
        if len(seq) == len(prompt):
            np.testing.assert_allclose(model.next_token_logits(prompt, loops=256), logits, atol=1e-3, rtol=1e-2)
        seq.append(int(np.argmax(logits)))
    assert out == seq


def test_a_depth_that_cannot_fit_is_refused_before_anything_is_built():
    model = tiny_model("fp32")
    before = engine.prefill._cache_size() + SHARED.decode_steps._cache_size()
    for call in (lambda: model.generate(prompt_of(8), max_tokens=4, loops=10**9),
                 lambda: model.build_prefix_cache(prompt_of(8), loops=10**9),
                 lambda: model.generate_batch([prompt_of(8)] * 3, max_tokens=4, loops=10**9)):
        with pytest.raises(RuntimeError, match="out of memory.*loops=1000000000"):
            call()
    assert engine.prefill._cache_size() + SHARED.decode_steps._cache_size() == before  # nothing compiled


@pytest.mark.slow
def test_shallower_depths_are_views_of_one_stack():
    """A prefix's depths are slices of its pass axis: a shallower prefix shares the arrays, and
    decoding from it equals decoding from a prefix built at that depth."""
    model = tiny_model("fp32")
    prompt = prompt_of(20, seed=5)
    deep = model.build_prefix_cache(prompt, loops=6)
    for d in (1, 4):
        view = deep.at_depth(d)
        assert view.cache is deep.cache and view.loops == d
        built = model.build_prefix_cache(prompt, loops=d)
        assert (model.generate_from_prefix_cache(view, suffix=[3, 4], max_tokens=6)
                == model.generate_from_prefix_cache(built, suffix=[3, 4], max_tokens=6))
    # the first view goes back to a deeper depth that the shared arrays hold
    assert deep.at_depth(1).at_depth(5).cache is deep.cache


def test_functional_pipeline_runs_without_a_model():
    """build a prefix, take it to another depth, decode a batch: pure functions of the weights."""
    w = tl.Weights.create(tl.Model.random(tiny_config(kv_mode="fp32"), seed=0).weights.params,
                          tiny_config(kv_mode="fp32"))
    model = tiny_model("fp32")
    prompt = prompt_of(15, seed=1)
    prefix = F.build_prefix(w, prompt, loops=2, keep_state=True)
    deeper = F.prefix_at_depth(prefix, 4)
    req = tl.Knobs.make(2, max_tokens=5, seeds=[0, 1])
    state = F.decode(w, deeper, [np.array([7], np.int32), np.zeros((0,), np.int32)], req)
    got = [np.asarray(state.tokens)[i, : int(state.n[i])].tolist() for i in range(2)]
    assert got[0] == model.generate(np.concatenate([prompt, [7]]), max_tokens=5, loops=4)[16:]
    assert got[1] == model.generate(prompt, max_tokens=5, loops=4)[15:]
