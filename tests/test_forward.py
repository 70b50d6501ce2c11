"""The forward pass against an independent numpy implementation."""

import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from tinyloop_jax.decoding import programs as engine
from conftest import prompt_of, tiny_config
from reference import forward as ref_forward


@pytest.mark.parametrize("n_pre", [0, 2])
def test_loops_1_is_a_plain_stack(n_pre):
    """loops=1 with n_pre_blocks=k is a plain (k+1)-layer GPT-2 stack."""
    cfg = tiny_config(n_pre_blocks=n_pre, kv_mode="fp32")
    model = tl.Model.random(cfg, seed=1)
    prompt = prompt_of(23, seed=1)
    ours = model.next_token_logits(prompt, loops=1)
    ref = ref_forward(model.weights.params, cfg.n_heads, prompt, loops=1)[-1]
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("loops,window,mode", [(3, 0, "fp32"), (8, 0, "fp32"), (3, 7, "fp32"), (3, 7, "fp16")])
def test_looped_forward_matches_numpy(models, loops, window, mode):
    model = models[mode]
    prompt = prompt_of(37, seed=2)
    ours = model.next_token_logits(prompt, loops=loops, cache_window=window)
    kv_dtype = np.float16 if mode == "fp16" else np.float32
    ref = ref_forward(model.weights.params, model.config()["n_heads"], prompt, loops, window, kv_dtype)[-1]
    np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=1e-2)


def test_positions_matter(models):
    """The position embedding is live: the same tokens shifted differ (what makes position
    bugs in prefix reuse detectable)."""
    model = models["fp32"]
    p = prompt_of(10, seed=3)
    a = model.next_token_logits(p)
    b = model.next_token_logits(np.concatenate([[p[0]], p]))  # same last tokens, shifted by one
    assert not np.allclose(a, b, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_prefill_updates_its_segment_in_place(models, mode):
    """Without a window a prefill writes the chunk into its own segment, then attends to that
    buffer. The compiled program copies no cache layer: reading the old buffer beside the write
    (the chunk attending to the old buffer and, apart, to itself) made XLA copy every layer."""
    w = models[mode].weights
    own = F.empty_cache(w, 20, 3)
    layers = {f"[{','.join(map(str, a.shape))}]" for seg in (*own.pre, own.loop) for a in seg.values()}
    text = engine.prefill.lower(w.params, w.config, jnp.asarray(F.pad(prompt_of(20))), jnp.int32(20), jnp.int32(0),
                                (), own, loops=3, window=0, keep_states=True).compile().as_text()
    copies = [line.strip() for line in text.splitlines() if " copy(" in line and any(s in line for s in layers)]
    assert not copies, copies[:4]
