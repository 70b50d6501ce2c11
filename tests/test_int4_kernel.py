"""The int4 decode-attention kernel: Pallas (interpret mode on CPU) == the jnp reference, its
CUDA lowering, and the model's int4 decode through the kernel == through the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import tinyloop_jax as tl
from tinyloop_jax.model import config as tlc
from tinyloop_jax.api import functional as F
from tinyloop_jax.model import int4_attention as ia
from tinyloop_jax.model import quant
from tinyloop_jax.model import transformer as tf
from conftest import OURO, prompt_of, tiny_config

TIGHT = dict(atol=1e-5, rtol=1e-5)


def int4_segment(rng, H, C, hd, n_valid, start=0):
    """Random packed K/V for C slots of which the first n_valid hold positions start.."""
    def pack(x):
        q, s = quant.quantize(jnp.asarray(x), 4, hd)
        return quant.pack_int4(q), s
    k, ks = pack(rng.normal(size=(H, C, hd)).astype(np.float32) * 2)
    v, vs = pack(rng.normal(size=(H, C, hd)).astype(np.float32))
    pos = np.full(C, -1, np.int32)
    pos[:n_valid] = start + np.arange(n_valid)
    return k, ks, v, vs, jnp.asarray(pos)


@pytest.mark.parametrize("C,n_valid,q_pos,window", [
    (16, 16, 15, 0),      # one full block
    (37, 37, 36, 0),      # odd capacity, not a multiple of any block
    (37, 23, 22, 0),      # odd number of valid slots, empty slots after them
    (100, 77, 50, 0),     # causal: keys after the query are masked
    (100, 77, 76, 9),     # sliding window
    (129, 101, 100, 5),   # window, odd capacity, several splits
    (256, 256, 255, 0),   # several blocks per split
])
def test_pallas_matches_reference(C, n_valid, q_pos, window):
    rng = np.random.default_rng(C + n_valid + window)
    H, hd = 4, 16
    k, ks, v, vs, pos = int4_segment(rng, H, C, hd, n_valid)
    q = jnp.asarray(rng.normal(size=(H, hd)).astype(np.float32)) * hd ** -0.5
    ref = ia.int4_attention_ref(q, jnp.int32(q_pos), k, ks, v, vs, pos, window=window)
    got = ia.int4_attention_pallas(q, jnp.int32(q_pos), k, ks, v, vs, pos, window=window, interpret=True)
    for name, a, b in zip("oml", got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=name, **TIGHT)
    # and the normalized output equals plain softmax attention over the dequantized values
    kf = quant.dequantize(quant.unpack_int4(k), ks, hd)
    vf = quant.dequantize(quant.unpack_int4(v), vs, hd)
    ok = (np.asarray(pos) >= 0) & (np.asarray(pos) <= q_pos)
    if window:
        ok &= np.asarray(pos) > q_pos - window
    s = np.where(ok, np.einsum("hd,hcd->hc", q, kf), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hc,hcd->hd", p / p.sum(-1, keepdims=True), vf)
    np.testing.assert_allclose(np.asarray(got[0] / got[2][:, None]), want, **TIGHT)


@pytest.mark.parametrize("H,KV", [(4, 2), (8, 1)])
def test_pallas_grouped_query_matches_repeated_heads(H, KV):
    """GQA: query head h reads key/value head h // (H / KV); the kernel reads the KV heads in
    place and equals attention over K/V repeated per query head."""
    rng = np.random.default_rng(H + KV)
    C, hd = 48, 16
    k, ks, v, vs, pos = int4_segment(rng, KV, C, hd, 40)
    q = jnp.asarray(rng.normal(size=(H, hd)).astype(np.float32)) * hd ** -0.5
    got = ia.int4_attention_pallas(q, jnp.int32(39), k, ks, v, vs, pos, window=0, interpret=True)
    rep = lambda a: jnp.repeat(a, H // KV, axis=0)  # noqa: E731
    want = ia.int4_attention_pallas(q, jnp.int32(39), rep(k), rep(ks), rep(v), rep(vs), pos, window=0,
                                    interpret=True)
    ref = ia.int4_attention_ref(q, jnp.int32(39), k, ks, v, vs, pos, window=0)
    for name, a, b, c in zip("oml", got, want, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=name, **TIGHT)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), err_msg=name, **TIGHT)


def test_fully_masked_segment_contributes_nothing():
    rng = np.random.default_rng(0)
    k, ks, v, vs, pos = int4_segment(rng, 2, 32, 8, 32, start=100)  # every key is in the future
    q = jnp.ones((2, 8), jnp.float32)
    o, m, l = ia.int4_attention_pallas(q, jnp.int32(5), k, ks, v, vs, pos, window=0, interpret=True)
    assert np.all(np.asarray(l) == 0) and np.all(np.asarray(o) == 0) and np.all(np.isfinite(np.asarray(m)))


def test_plan_blocks_divide_and_fill():
    for C in (16, 37, 128, 640, 1152, 4096):
        padded, block, splits = ia.plan(C, 12)
        assert padded >= C and padded % (block * splits) == 0 and block & (block - 1) == 0 and block >= 16


def test_kernel_lowers_for_cuda_with_triton():
    """Without a GPU, lower the kernel for the CUDA platform: Pallas' Triton lowering must accept
    it (power-of-two tiles, supported ops) and emit one Triton call carrying our params."""
    H, C, hd = 12, 1024, 64
    shapes = [((H, hd), jnp.float32), ((), jnp.int32), ((H, C, hd // 2), jnp.uint8), ((H, C, 1), jnp.float32),
              ((H, C, hd // 2), jnp.uint8), ((H, C, 1), jnp.float32), ((C,), jnp.int32)]
    f = jax.jit(functools.partial(ia.int4_attention_pallas, window=0))
    exp = export.export(f, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        *(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
    text = exp.mlir_module()
    assert text.count("xla.gpu.triton") == 1 and "tinyloop_int4_decode_attention" in text
    assert "num_warps = 4" in text


def test_unknown_impl_is_an_error(monkeypatch):
    monkeypatch.setenv("TINYLOOP_INT4_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="TINYLOOP_INT4_ATTENTION='cuda'"):
        tlc.int4_attention_from_env()
    with pytest.raises(ValueError, match="int4_attention 'cuda'"):
        tiny_config(int4_attention="cuda")
    monkeypatch.setenv("TINYLOOP_INT4_ATTENTION", "interpret")
    assert tiny_config().int4_attention == "interpret"  # resolved once, when the config is made


def decode_step_logits(model, prefix, suffix):
    """Logits of the last suffix token computed by a T = 1 decode forward (the int4 path)."""
    w, cfg = model.weights, model.weights.config
    own = F.empty_cache(w, len(suffix) + 1, prefix.loops, prefix.cache_window, start=len(prefix))
    _, own = F.prefill(w, suffix[:-1], own, ro=(prefix.cache,), loops=prefix.loops,
                       cache_window=prefix.cache_window)
    step = jax.jit(tf.forward, static_argnames=("cfg", "loops", "window"))
    x, _ = step(w.params, cfg, jnp.asarray(suffix[-1:]), jnp.int32(1), own.length, (prefix.cache,), own,
                loops=prefix.loops, window=prefix.cache_window)
    return np.asarray(tf.lm_head(w.params, cfg, x[0]))


@pytest.mark.parametrize("family,window", [("gpt2", 0), pytest.param("gpt2", 7, marks=pytest.mark.slow),
                                           ("ouro", 0)])
def test_model_decode_through_kernel_matches_reference(family, window):
    """The whole int4 decode path (prefix + own segment, looped; for the Ouro layout a 2-block
    stack with grouped-query attention) with the kernel in interpret mode gives the reference's
    tokens and logits, and the prefill path's logits."""
    prompt = prompt_of(20, seed=4)
    out = {}
    for which in ("jnp", "interpret"):  # the backend is part of the static configuration
        cfg = (tiny_config(kv_mode="int4", int4_attention=which) if family == "gpt2"
               else tl.ModelConfig(**OURO, kv_mode="int4", int4_attention=which))
        model = tl.Model.random(cfg, seed=0)
        prefix = model.build_prefix_cache(prompt[:14], loops=2, cache_window=window)
        out[which] = (model.generate_from_prefix_cache(prefix, suffix=prompt[14:], max_tokens=12),
                      decode_step_logits(model, prefix, prompt[14:]))
    assert out["jnp"][0] == out["interpret"][0]
    np.testing.assert_allclose(out["interpret"][1], out["jnp"][1], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out["interpret"][1], model.next_token_logits_from_prefix(prefix, prompt[14:]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_gpu_check_script_runs_interpreted():
    """scripts/gpu_check.py is only run for real on a GPU; keep it working here, interpreted."""
    import subprocess
    import sys
    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--interpret", "--quick"], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| 4 | 100 | 32 | 0 |" in r.stdout
