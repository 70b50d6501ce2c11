"""Every KV storage mode: reuse == recompute, the position rule, quantization bounds, bytes."""

import numpy as np
import pytest
import jax.numpy as jnp

import tinyloop_jax as tl
from tinyloop_jax.model import cache as kvc
from tinyloop_jax.api import functional as F
from tinyloop_jax.decoding import programs
from tinyloop_jax.model import quant
from conftest import check_position_reset_fails, prompt_of, tiny_config

CLOSE = dict(atol=1e-3, rtol=1e-2)
QUANTIZED = ["int8", "int4", "fp16-h", "int8-h", "int4-h"]  # fp16/fp32 are covered in test_prefix


# Pairwise over (mode, loops, window): each mode at both depths and both windows, and the
# four (loops, window) pairs each met by some mode.
@pytest.mark.parametrize("mode,loops,window", [
    ("int8", 1, 0), ("int8", 8, 9), ("int4", 1, 9), ("int4", 8, 0), ("fp16-h", 1, 0), ("fp16-h", 8, 9),
    ("int8-h", 1, 9), ("int8-h", 8, 0), ("int4-h", 1, 0), ("int4-h", 8, 9)])
def test_reuse_matches_recompute_every_mode(mode_models, mode, loops, window):
    model = mode_models[mode]
    prompt = prompt_of(36, seed=loops + window)
    prefix = model.build_prefix_cache(prompt[:30], loops=loops, cache_window=window)
    np.testing.assert_allclose(model.next_token_logits_from_prefix(prefix, prompt[30:]),
                               model.next_token_logits(prompt, loops=loops, cache_window=window), **CLOSE)
    if loops == 1:  # generation through the decode loop too (depth 8 is covered by the logits above)
        a = model.generate_from_prefix_cache(prefix, suffix=prompt[30:], max_tokens=10)
        assert a == model.generate(prompt, max_tokens=10, loops=loops, cache_window=window)


@pytest.mark.parametrize("mode", ["fp16-h", "int8-h", "int4-h"])
@pytest.mark.parametrize("window", [0, pytest.param(5, marks=pytest.mark.slow)])
def test_h_mode_call_scoped_rebuild_matches_step_by_step(mode_models, mode, window):
    """Model calls rebuild an h prefix's K/V once per call and keep the request's own K/V in
    float32 (`model.materialize`); greedy tokens equal a loop of single functional steps that
    store h and re-project it at every step."""
    model = mode_models[mode]
    w, loops = model.weights, 2
    prompt = prompt_of(18, seed=window)
    prefix = model.build_prefix_cache(prompt[:12], loops=loops, cache_window=window)
    got = model.generate_from_prefix_cache(prefix, suffix=prompt[12:], max_tokens=10)[len(prompt):]
    own = F.empty_cache(w, 6 + 10, loops, window, start=12)
    logits, own = F.prefill(w, prompt[12:], own, ro=(prefix.cache,), loops=loops, cache_window=window)
    want = []
    for _ in range(10):
        want.append(int(np.argmax(np.asarray(logits))))
        logits, own = F.decode_step(w, want[-1], own, ro=(prefix.cache,), loops=loops, cache_window=window)
    assert own.kv_mode.name == mode and got == want


@pytest.mark.parametrize("mode", QUANTIZED)
def test_position_reset_is_detected_every_mode(mode_models, mode):
    check_position_reset_fails(mode_models[mode])


@pytest.mark.parametrize("mode", QUANTIZED)
def test_chunked_and_token_by_token_caches_are_identical(mode_models, mode, monkeypatch):
    """Per-token quantization: the stored values do not depend on how tokens were grouped (one
    prefill chunk, or the decode path one token at a time: write, then attend)."""
    w = mode_models[mode].weights
    p = prompt_of(21, seed=3)
    one = F.prefill(w, p, F.empty_cache(w, 21))[1]
    many = F.empty_cache(w, 21)
    shapes, real = [], programs.prefill
    with monkeypatch.context() as m:  # token by token means chunks of one, not a padded prefill
        m.setattr(programs, "prefill", lambda *a, **kw: shapes.append(a[2].shape) or real(*a, **kw))
        for t in p:
            many = F.decode_step(w, int(t), many)[1]
    assert set(shapes) == {(1,)}
    for a, b in ((one.layer(i), many.layer(i)) for i in range(one.n_layers)):
        for name in a:
            x, y = np.asarray(a[name]), np.asarray(b[name])
            if x.dtype.kind in "iu":
                # the same up to float summation order: a value may land one step away where the
                # two matmul shapes round differently right at a quantization boundary
                d = np.abs(unpack(x).astype(int) - unpack(y).astype(int)) if x.dtype == np.uint8 else np.abs(
                    x.astype(int) - y.astype(int))
                assert d.max() <= 1 and (d > 0).mean() < 0.01
            else:
                np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), atol=1e-3, rtol=1e-3)


def unpack(p):
    return np.asarray(quant.unpack_int4(jnp.asarray(p)))


@pytest.mark.parametrize("bits,bound", [(8, 1 / 127), (4, 1 / 7)])
def test_quantize_round_trip_bounds(bits, bound):
    spread = np.exp(np.random.default_rng(1).normal(size=(5, 7, 1)))  # groups of very different magnitudes
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 7, 128)) * spread, jnp.float32)
    for group in (32, 64, 128):
        q, s = quant.quantize(x, bits, group)
        err = np.abs(np.asarray(quant.dequantize(q, s, group) - x)).reshape(5, 7, -1, group)
        absmax = np.abs(np.asarray(x)).reshape(5, 7, -1, group).max(-1, keepdims=True)
        assert (err <= absmax * bound + 1e-7).all()
    z = quant.quantize(jnp.zeros((3, 64)), bits, 32)
    assert np.all(np.asarray(quant.dequantize(*z, 32)) == 0)


def test_int4_packing_is_exact():
    q = jnp.asarray(np.random.default_rng(0).integers(-7, 8, (4, 9, 64)), jnp.int8)
    packed = quant.pack_int4(q)
    assert packed.dtype == jnp.uint8 and packed.shape == (4, 9, 32)
    assert np.array_equal(np.asarray(quant.unpack_int4(packed)), np.asarray(q))


def test_nbytes_of_the_seed_example():
    """seq 1024, D 2048, 2 pre blocks, L 8 (heads 16): fp16 K+V is exactly 80 MiB, int4-h <= 14 MB."""
    layers, H, hd, T = 2 + 8, 16, 128, 1024
    kv_only = lambda mode: kvc.cache_nbytes(mode, layers, H, T, hd) - (T * 4 + 4)  # noqa: E731
    assert kv_only("fp16") == 80 * 2**20
    assert kv_only("int4-h") <= 14_000_000
    assert kv_only("fp16-h") * 2 == kv_only("fp16")  # h modes: half the bytes of their K/V twin
    # integer h modes: scales of 64-channel groups vs one per head-token: 1.94x and 1.89x smaller
    assert kv_only("int8-h") < kv_only("int8") / 1.85 and kv_only("int4-h") < kv_only("int4") / 1.85
    cfg = tl.ModelConfig(vocab_size=8, d_model=2048, n_heads=16, n_pre_blocks=2, default_loops=8, max_seq_len=1024,
                         kv_mode="int4-h")
    # the Model reports the same formula (without allocating anything of that size)
    assert kvc.cache_nbytes(cfg.kv_mode, cfg.n_cache_layers(8), 16, 1024, 128) == kv_only("int4-h") + T * 4 + 4


def test_prefix_nbytes_counts_scales(mode_models):
    for mode, model in mode_models.items():
        prefix = model.build_prefix_cache(prompt_of(20))
        assert prefix.nbytes == sum(int(np.asarray(x).nbytes) for x in __import__("jax").tree.leaves(prefix.cache))
        assert prefix.nbytes == kvc.cache_nbytes(mode, prefix.cache.n_layers, 4, prefix.cache.capacity, 8)


def test_mode_selection(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="valid modes: fp16, fp32, int8, int4, fp16-h, int8-h, int4-h"):
        tiny_config(kv_mode="int3")
    for env, want in [({}, "fp16"), ({"TINYLOOP_KV_H_MODE": "1"}, "fp16-h"), ({"TINYLOOP_KV_INT4": "1"}, "int4"),
                      ({"TINYLOOP_KV_H_MODE": "1", "TINYLOOP_KV_INT4": "1"}, "int4-h")]:
        monkeypatch.delenv("TINYLOOP_KV_H_MODE", raising=False)
        monkeypatch.delenv("TINYLOOP_KV_INT4", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert tiny_config().kv_mode == want
        assert tiny_config(kv_mode="int8").kv_mode == "int8"  # an explicit mode wins
    model = tl.Model.random(tiny_config(kv_mode="fp32"))
    model.save(tmp_path / "m")
    assert tl.Model.load(tmp_path / "m", kv_mode="int8-h").config()["kv_mode"] == "int8-h"


@pytest.mark.slow
def test_int8_greedy_agrees_with_fp32_on_the_bundled_model():
    from tinyloop_jax.cli import BUNDLED
    tok = tl.ByteTokenizer()
    p = tok.encode('The "with" statement\n********************\n\nThe "with" statement is used to')
    runs = {m: tl.Model.load(BUNDLED, kv_mode=m).generate(p, max_tokens=160)[len(p):] for m in ("fp32", "int8")}
    agree = np.mean(np.array(runs["fp32"]) == np.array(runs["int8"]))
    assert agree >= 0.9, agree


def test_modes_parse_once_into_types():
    """A mode name becomes one value: its codec by type, h or not, the working mode, head splits."""
    from tinyloop_jax.model.kv_modes import FloatFormat, IntFormat, KVMode, kv_mode

    for name in tl.KV_MODES:
        m = kv_mode(name)
        assert isinstance(m, KVMode) and str(m) == name and kv_mode(m) is m and kv_mode(name) is m
        assert m.h == name.endswith("-h") and m.splits_heads == (not m.h)
        assert isinstance(m.format, FloatFormat if name.startswith("fp") else IntFormat)
        assert m.working == (kv_mode("fp32") if m.h else m)
        assert m.packed_int4 == (name == "int4")
    assert kv_mode("int4-h").format is kv_mode("int4").format  # one codec per format
    with pytest.raises(ValueError, match="int3"):
        kv_mode("int3")
    # a cache built from the name holds the value; the public prefix reports the name
    c = tiny_config(kv_mode="int8-h")
    assert c.storage is kv_mode("int8-h")
    seg = kvc.empty("int8-h", 1, 2, c.n_kv_heads, 16, c.head_dim, d_model=c.d_model)
    assert seg.kv_mode is kv_mode("int8-h")
    assert set(seg.pre[0]) == {"h", "hs"} and seg.pre[0]["h"].dtype == jnp.int8


def test_a_chunk_write_equals_a_numpy_scatter():
    """A chunk of T tokens (the first n_valid real) written at start into C slots lands where a
    scatter by `write_slots` puts it: the ring wrapping, a chunk longer than the ring keeping its
    last C tokens, padding and the slots not written left as they were; the pre-layer and the
    loop-stack forms alike."""
    rng = np.random.default_rng(0)
    for C, T, start, n_valid in [(16, 8, 0, 5), (16, 8, 12, 8), (8, 16, 3, 13), (8, 16, 5, 16), (32, 16, 20, 0),
                                 (8, 4, 30, 4)]:
        old, fresh = rng.normal(size=(2, C, 3)).astype(np.float32), rng.normal(size=(2, T, 3)).astype(np.float32)
        q_pos = start + np.arange(T, dtype=np.int32)
        slots = np.asarray(kvc.write_slots(jnp.asarray(q_pos), jnp.int32(n_valid), C))
        src = kvc.write_sources(jnp.int32(start), jnp.int32(n_valid), C)
        want, want_pos = old.copy(), np.full((C,), -1, np.int32)
        for i in range(T):  # the reference scatter (a slot >= C drops the token)
            if slots[i] < C:
                want[:, slots[i]], want_pos[slots[i]] = fresh[:, i], q_pos[i]
        got = kvc.write({"k": jnp.asarray(old)}, {"k": jnp.asarray(fresh)}, jnp.asarray(slots), src)["k"]
        np.testing.assert_array_equal(got, want)
        pos = kvc.write_positions(jnp.full((C,), -1, jnp.int32), jnp.asarray(q_pos), jnp.asarray(slots), src)
        np.testing.assert_array_equal(pos, want_pos)
        stack = np.stack([np.stack([old, old + 1])] * 2)  # [passes 2, blocks 2, lead, C, w]: write pass 1, block 0
        got = kvc.write({"k": jnp.asarray(stack)}, {"k": jnp.asarray(fresh)}, jnp.asarray(slots), src,
                        (jnp.int32(1), 0))["k"]
        np.testing.assert_array_equal(got[1, 0], want)
        np.testing.assert_array_equal(np.delete(np.asarray(got).reshape(4, 2, C, 3), 2, axis=0),
                                      np.delete(stack.reshape(4, 2, C, 3), 2, axis=0))
