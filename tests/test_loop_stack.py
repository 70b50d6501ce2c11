"""Loop shapes: a stack of k loop blocks and a coda after the loop. A looped model at a fixed
depth is a plain stack of its blocks in run order, so each shape is checked against the same
weights unrolled into pre blocks (the k = 1, loops = 1 path checked elsewhere against numpy,
transformers and Ouro's reference)."""

import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.model.init import random_params
from conftest import forward_seq, prompt_of

EXACT = dict(atol=1e-5, rtol=1e-5)
CLOSE = dict(atol=1e-3, rtol=1e-2)
SHAPE = dict(vocab_size=128, d_model=32, n_heads=4, max_seq_len=128, kv_mode="fp32")
LLAMA = dict(block="llama", n_kv_heads=2, intermediate_size=48, tie_embeddings=False)


def unrolled(model: tl.Model, loops: int) -> tl.Model:
    """The same weights as a plain stack: pre blocks, then the loop stack `loops` times, then the
    coda, with the last block as a loop block run once."""
    c, p = model.weights.config, model.weights.params
    blocks = list(p.pre) + list(p.loop) * loops + list(p.post)
    cfg = c.replace(n_pre_blocks=len(blocks) - 1, loop_blocks=1, n_post_blocks=0, default_loops=1)
    return tl.Model(p.replace(pre=tuple(blocks[:-1]), loop=(blocks[-1],), post=()), cfg)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stack_and_coda_equal_the_unrolled_stack(family):
    cfg = tl.ModelConfig(**SHAPE, **(LLAMA if family == "llama" else {}), n_pre_blocks=1, loop_blocks=2,
                         n_post_blocks=1, default_loops=3)
    model = tl.Model.random(cfg, seed=1)
    assert cfg.n_cache_layers(3) == 1 + 3 * 2 + 1
    flat = unrolled(model, 3)
    p = prompt_of(21, seed=2)
    w, fw = model.weights, flat.weights
    np.testing.assert_allclose(np.asarray(forward_seq(w.params, w.config, jnp.asarray(p), loops=3)),
                               np.asarray(forward_seq(fw.params, fw.config, jnp.asarray(p), loops=1)), **EXACT)
    np.testing.assert_allclose(model.next_token_logits(p), flat.next_token_logits(p), **EXACT)
    assert model.generate(p, max_tokens=10) == flat.generate(p, max_tokens=10)
    prefix = model.build_prefix_cache(p[:15])
    assert prefix.cache.n_layers == 8 and len(prefix.cache.post) == 1
    np.testing.assert_allclose(model.next_token_logits_from_prefix(prefix, p[15:]), flat.next_token_logits(p),
                               **CLOSE)
    assert model.generate_from_prefix_cache(prefix, suffix=p[15:], max_tokens=8) == flat.generate(p, max_tokens=8)


def test_coda_model_features():
    cfg = tl.ModelConfig(**SHAPE, **LLAMA, n_pre_blocks=1, loop_blocks=2, n_post_blocks=1, default_loops=2)
    model = tl.Model.random(cfg, seed=3)
    p = prompt_of(18, seed=4)
    prefix = model.build_prefix_cache(p, keep_state=True)
    with pytest.raises(RuntimeError, match="coda"):
        prefix.at_depth(1)  # the coda's cache was computed at depth 2
    deeper = prefix.at_depth(3)  # the missing pass, then the coda again at depth 3
    np.testing.assert_allclose(np.asarray(deeper.logits), unrolled(model, 3).next_token_logits(p), **CLOSE)
    assert model.generate_from_prefix_cache(deeper, max_tokens=6) == model.generate(p, loops=3, max_tokens=6)
    plain = model.generate(p, max_tokens=10)
    assert model.generate(p, max_tokens=10, draft_loops=1, lookahead=3) == plain
    batch = model.generate_batch_from_prefix_cache(prefix, [[1, 2], [], [3]], max_tokens=5)
    assert batch == [model.generate_from_prefix_cache(prefix, suffix=s, max_tokens=5) for s in ([1, 2], [], [3])]


def test_loop_shape_errors():
    with pytest.raises(ValueError, match="loop_blocks"):
        tl.ModelConfig(**SHAPE, loop_blocks=0)
    with pytest.raises(ValueError, match="n_post_blocks=1 with pass_norm"):
        tl.ModelConfig(**SHAPE, **LLAMA, n_post_blocks=1, pass_norm=True)
    with pytest.raises(ValueError, match="expected 2 loop blocks"):
        c = tl.ModelConfig(**SHAPE, loop_blocks=2)
        tl.Model(random_params(c.replace(loop_blocks=1)), c)
    with pytest.raises(ValueError, match="n_kv_heads=2 is not supported with block='gpt2'"):
        tl.ModelConfig(**SHAPE, n_kv_heads=2)
