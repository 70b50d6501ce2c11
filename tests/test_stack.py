"""Layers kept as one stack (`model.stack`) and run in a layer loop: a stack's layer multiplied in
place by the native kernel and by XLA's path equals the layer alone; a model's pre blocks are
stacked only when they share one structure; a stacked model saves, fingerprints and answers as
the same model unstacked; a step over a stacked pool runs its pre blocks in one loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax import native
from tinyloop_jax.model import page_pool, paged, qarray, stack
from tinyloop_jax.model.params import fingerprint

from quant_blocks import packed, width
from conftest import forward_seq


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("fmt,rows", [("q4_1", 1), ("q8_0", 16), ("q6_k", 40), ("q4_k", 3)])
@pytest.mark.parametrize("path", ["native", "xla"])
def test_a_stacks_layer_equals_the_layer_alone(fmt, rows, path, monkeypatch):
    """Layer i of a stack of three (tiled: the kernel's layout), picked by a traced index under a
    fori_loop as a step picks it, equals the product with that layer's own weight; XLA's path
    (no kernel) slices the layer out."""
    if path == "native" and not native.available():
        pytest.skip("the native kernel is not built on this machine (no compiler or another backend)")
    if path == "xla":
        monkeypatch.setattr(native, "available", lambda: False)
    k = width(fmt, 96)
    ws = [packed(fmt, k, 130, seed=s) for s in range(3)]
    st = stack.stack(tuple({"w": qarray.tile(w)} for w, _ in ws))
    assert stack.is_stacked(st) and len(st) == 3
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)

    def run(x):  # every layer's product, each through the loop's traced index
        def body(i, out):
            return out.at[i].set(qarray.matmul(x, st.at(i)["w"]))
        return jax.lax.fori_loop(0, 3, body, jnp.zeros((3, rows, 130), jnp.float32))
    got = jax.jit(run)(x)
    for i, (_, dense) in enumerate(ws):
        close(got[i], x @ dense)
        close(jax.jit(qarray.matmul)(x, st[i]["w"]), x @ dense)  # a static index: the same
    own = stack.unstacked(st)[1]["w"]
    assert own.layer is None and own.q.shape == qarray.tile(ws[1][0]).q.shape


def test_blocks_that_differ_stay_a_tuple():
    """One block's packed format (or window, or shape) differing keeps the tuple."""
    a, b = packed("q4_1", 64, 64)[0], packed("q8_0", 64, 64)[0]
    assert not stack.is_stacked(stack.stack(({"w": a}, {"w": b})))
    assert not stack.is_stacked(stack.stack(({"w": a},)))
    assert stack.is_stacked(stack.stack(({"w": a}, {"w": a})))


def needs_native():
    if not native.available():
        pytest.skip("the native kernel is not built on this machine (no compiler or another backend): "
                    "a model stacks only what the kernel reads in place")


def test_a_stacked_model_is_the_same_model():
    """A llama with several packed pre blocks holds them stacked (float ones stay a tuple: a loop
    would copy each layer's matrices out of the stack); its fingerprint, its saved tensors and
    its tokens are those of the same weights unstacked (a model built from its tuple of views);
    a step over a pool of stacked pre layers equals the per-layer pool's step."""
    needs_native()
    cfg = tl.ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, block="llama", n_pre_blocks=3,
                         loop_blocks=1, default_loops=2, max_seq_len=128)
    assert not stack.is_stacked(tl.Model.random(cfg, seed=3).weights.params.pre)
    model = tl.Model.random(cfg, seed=3, quantize_weights="int4")
    p = model.weights.params
    assert stack.is_stacked(p.pre) and len(p.pre) == 3 and qarray.is_quant(p.pre[0].w_down)
    flat = p.replace(pre=stack.unstacked(p.pre))
    assert fingerprint(flat, cfg) == model.weights.fingerprint
    again = tl.Model(p.replace(pre=tuple(p.pre)), cfg)  # views in, stacked again
    assert stack.is_stacked(again.weights.params.pre) and again.weights.fingerprint == model.weights.fingerprint
    prompt = [5, 9, 2, 7, 1]
    assert model.generate(prompt, max_tokens=6) == again.generate(prompt, max_tokens=6)

    pool = page_pool.empty(cfg, 2, 8, page_size=4)
    assert stack.is_stacked(pool.pre)
    per_layer = pool.replace(pre=tuple(pool.pre))
    rows = paged.Rows.make([[0, 1, 2]], [0], [5])
    tokens = jnp.asarray([prompt], jnp.int32)
    step = jax.jit(lambda prm, pl: paged.forward(prm, cfg, pl, rows, tokens, 2, 0))
    (x1, pool1), (x2, pool2) = step(p, pool), step(flat, per_layer)
    x3, _ = step(flat, pool)  # blocks apart over a stacked pool (mixed packed formats): unrolled
    np.testing.assert_allclose(np.asarray(x3), np.asarray(x2), atol=1e-3, rtol=1e-2)
    # the same products through two programs whose other ops XLA may fuse apart: the project's
    # equivalence bound, not bit equality (another CPU may round a fusion differently)
    np.testing.assert_allclose(np.asarray(x1), np.asarray(x2), atol=1e-3, rtol=1e-2)
    for j in range(3):
        for n in pool1.pre.tree:
            np.testing.assert_allclose(np.asarray(pool1.pre[j][n]), np.asarray(pool2.pre[j][n]), atol=1e-3, rtol=1e-2)
    assert np.abs(np.asarray(pool1.pre[2]["k"])).max() > 0  # the last layer's K/V were written
    hlo = step.lower(p, pool).as_text()
    assert hlo.count("stablehlo.while") >= 2  # the layer loop beside the passes' loop


def test_the_dense_path_runs_stacked_blocks_in_a_loop():
    """On dense segments too (a prefix, `score`, the cache-free `forward_seq`), stacked pre blocks
    run in one layer loop and answer as the unstacked blocks unrolled: logits, scores and the
    tokens from a prefix, within the equivalence bound."""
    from tinyloop_jax.decoding import programs

    needs_native()
    cfg = tl.ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, block="llama", n_pre_blocks=3,
                         loop_blocks=1, default_loops=2, max_seq_len=128)
    model = tl.Model.random(cfg, seed=3, quantize_weights="int4")
    p = model.weights.params
    flat = p.replace(pre=stack.unstacked(p.pre))
    prompt = [5, 9, 2, 7, 1, 3, 3, 8]
    want = np.asarray(forward_seq(flat, cfg, jnp.asarray(prompt), 2))  # unrolled: the reference
    bound = dict(atol=1e-3, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(forward_seq(p, cfg, jnp.asarray(prompt), 2)), want, **bound)
    np.testing.assert_allclose(model.next_token_logits(prompt), want[-1], **bound)
    lp = np.asarray(jax.nn.log_softmax(want, axis=-1))[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(model.score(prompt).logprobs[1:], lp, **bound)
    prefix = model.build_prefix_cache(prompt[:5])
    assert stack.is_stacked(model.weights.params.pre)
    assert model.generate_from_prefix_cache(prefix, 6, suffix=prompt[5:]) == model.generate(prompt, max_tokens=6)

    own = tl.functional.empty_cache(model.weights, 16)
    args = (cfg, jnp.zeros(16, jnp.int32), jnp.int32(5), jnp.int32(0), (), own, 2, 0)
    loops = [programs.prefill.lower(prm, *args).as_text().count("stablehlo.while") for prm in (p, flat)]
    assert loops[0] == loops[1] + 1, loops  # the layer loop beside the passes' loop
