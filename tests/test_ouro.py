"""Ouro: parity with Ouro's own modeling code (golden files from scripts/make_ouro_golden.py on
a tiny random model in Ouro's Hugging Face layout), its early exit, and every runtime feature on
a looped Llama-family stack with grouped-query attention."""

import json
import os
import shutil
import threading

import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from tinyloop_jax.model import transformer as tf
from tinyloop_jax.model import exits
from tinyloop_jax.model import layers
from tinyloop_jax.api.prefix import tree_equal
from conftest import check_position_reset_fails, forward_seq, ouro_model, prompt_of

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "ouro-tiny")
PARITY = dict(atol=1e-4, rtol=0)  # the bound: max |dlogit| <= 1e-4 in float32
CLOSE = dict(atol=1e-3, rtol=1e-2)
N_PROMPTS, PASSES = 3, 3


@pytest.fixture(scope="module")
def ouro():
    return tl.Model.from_pretrained(GOLDEN, kv_mode="fp32")


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(os.path.join(GOLDEN, "golden.npz")))


def test_folder_maps_to_a_looped_stack(ouro):
    c = ouro.weights.config
    assert (c.block, c.n_pre_blocks, c.loop_blocks, c.default_loops, c.n_heads, c.n_kv_heads, c.head_dim) == (
        "llama", 0, 3, 3, 4, 2, 16)
    assert c.norm_placement == "sandwich" and c.pass_norm and c.early_exit_gate and not c.tie_embeddings
    assert c.rope_theta == 1e6 and c.n_cache_layers(4) == 12


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_logits_at_every_position_match_the_reference(ouro, golden, i):
    w = ouro.weights
    got = forward_seq(w.params, w.config, jnp.asarray(golden[f"prompt_{i}"]), loops=PASSES)
    np.testing.assert_allclose(np.asarray(got), golden[f"logits_{i}"], **PARITY)


def test_cached_path_at_every_position_matches_the_reference(ouro, golden):
    """Token by token through the cache (one cache slot per pass and layer), and a prefix +
    suffix split: every position's logits as the reference computes them without a cache."""
    w, i = ouro.weights, 2
    p, want = golden[f"prompt_{i}"], golden[f"logits_{i}"]
    cache = F.empty_cache(w, len(p))
    for t, tok in enumerate(p):
        logits, cache = F.decode_step(w, int(tok), cache)
        np.testing.assert_allclose(np.asarray(logits), want[t], **PARITY)
    prefix = ouro.build_prefix_cache(p[:25])
    np.testing.assert_allclose(ouro.next_token_logits_from_prefix(prefix, p[25:]), want[-1], **PARITY)


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_pass_states_gates_and_exit_distribution_match_the_reference(ouro, golden, i):
    w = ouro.weights
    p = jnp.asarray(golden[f"prompt_{i}"])
    states = []
    for loops in range(1, PASSES + 1):  # the stream after pass loops-1, at every position
        own = F.empty_cache(w, len(p), loops)
        states.append(np.asarray(tf.run_layers(w.params, w.config, tf.embed(w.params, p, jnp.int32(0), w.config),
                                               jnp.int32(len(p)), jnp.int32(0), (), own, loops, 0).x))
    states = np.stack(states)
    np.testing.assert_allclose(states, golden[f"states_{i}"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(exits.gate(w.params, jnp.asarray(states))), golden[f"gates_{i}"],
                               atol=1e-5, rtol=1e-4)
    pdf = np.asarray(exits.exit_distribution(w.params, jnp.asarray(states)))
    np.testing.assert_allclose(pdf, golden[f"exit_pdf_{i}"], atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(pdf.sum(0), 1.0, atol=1e-6)


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_early_exit_logits_match_the_reference(ouro, golden, i):
    p = golden[f"prompt_{i}"]
    for s in range(PASSES):
        np.testing.assert_allclose(ouro.next_token_logits(p, exit_at_step=s), golden[f"logits_step{s}_{i}"][-1],
                                   **PARITY)
    for t, thr in enumerate(golden["thresholds"]):
        np.testing.assert_allclose(ouro.next_token_logits(p, early_exit_threshold=float(thr)),
                                   golden[f"logits_thr{t}_{i}"][-1], **PARITY)


def test_early_exit_through_the_cache_at_every_position(ouro, golden):
    w, i = ouro.weights, 1
    p = golden[f"prompt_{i}"]
    for s, key in ((0, "logits_step0"), (1, "logits_step1")):
        cache = F.empty_cache(w, len(p))
        for t, tok in enumerate(p):
            logits, cache = F.decode_step(w, int(tok), cache, exit=exits.Exit.make(step=s))
            np.testing.assert_allclose(np.asarray(logits), golden[f"{key}_{i}"][t], **PARITY)
    prefix = ouro.build_prefix_cache(p)  # the prefix's logits under another exit come from its kept states
    np.testing.assert_allclose(ouro.next_token_logits_from_prefix(prefix, [], early_exit_threshold=0.5),
                               golden[f"logits_thr1_{i}"][-1], **PARITY)


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_greedy_matches_the_reference_recompute(ouro, golden, i):
    p, want = golden[f"prompt_{i}"], golden[f"greedy_{i}"].tolist()
    assert ouro.generate(p, max_tokens=len(want))[len(p):] == want
    prefix = ouro.build_prefix_cache(p[:-2])
    assert ouro.generate_from_prefix_cache(prefix, suffix=p[-2:], max_tokens=len(want))[len(p):] == want


def test_exit_defaults_come_from_the_folder(golden, tmp_path):
    d = tmp_path / "ouro"
    shutil.copytree(GOLDEN, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, early_exit_step=1)))
    m = tl.Model.from_pretrained(str(d), kv_mode="fp32")
    p = golden["prompt_1"]
    np.testing.assert_allclose(m.next_token_logits(p), golden["logits_step1_1"][-1], **PARITY)
    np.testing.assert_allclose(m.next_token_logits(p, exit_at_step=2), golden["logits_1"][-1], **PARITY)
    out = m.generate(p, max_tokens=4)
    assert out[len(p)] == int(np.argmax(golden["logits_step1_1"][-1]))


def test_bad_exit_arguments(ouro, models):
    p = prompt_of(5)
    with pytest.raises(ValueError, match="exit_at_step=3"):
        ouro.next_token_logits(p, exit_at_step=3)
    with pytest.raises(ValueError, match="early_exit_threshold"):
        ouro.generate(p, early_exit_threshold=1.5)
    # two knobs, two names: an exit_criterion's threshold alone is an error that names the pick's
    with pytest.raises(ValueError, match="need an exit_criterion.*early_exit_threshold"):
        ouro.generate(p, exit_threshold=0.5)
    with pytest.raises(ValueError, match="early-exit gate"):
        models["fp32"].generate(p, exit_at_step=0)


# ---- every feature on an Ouro-layout model (random weights, GQA, 2 blocks looped) -------------

@pytest.mark.parametrize("mode,window", [("fp32", 0), ("fp16", 7), ("int8", 0), ("int4", 7), ("fp16-h", 0),
                                         ("int8-h", 7), ("int4-h", 0), ("fp32", 7)])
def test_reuse_equals_recompute_every_mode(mode, window):
    # Quantized modes: reuse and recompute add the same terms in different orders, so now and
    # then a value lands one rounding step apart in the stored cache (measured: 1 prompt in 6 at
    # int8 moves a logit by 3e-3); the prompt here is fixed, not chosen per mode.
    model = ouro_model(mode)
    prompt = prompt_of(26, seed=window)
    prefix = model.build_prefix_cache(prompt[:20], cache_window=window)
    np.testing.assert_allclose(model.next_token_logits_from_prefix(prefix, prompt[20:]),
                               model.next_token_logits(prompt, cache_window=window), **CLOSE)
    a = model.generate_from_prefix_cache(prefix, suffix=prompt[20:], max_tokens=8)
    assert a == model.generate(prompt, max_tokens=8, cache_window=window)


@pytest.mark.parametrize("mode", ["fp32", "int4-h"])
def test_position_reset_is_detected(mode):
    """With RoPE the reset changes the rotation of the suffix's queries and keys (and the mask)."""
    check_position_reset_fails(ouro_model(mode))


def test_rotation_alone_is_load_bearing():
    """Negative control of the rotation only (mask unchanged): the suffix rotated as if it sat
    8 positions later no longer matches recompute."""
    model = ouro_model("fp32")
    w = model.weights
    p, s = prompt_of(16, seed=3), prompt_of(4, seed=4)
    prefix = model.build_prefix_cache(p)
    full = model.next_token_logits(np.concatenate([p, s]))
    rope = layers.rope
    try:
        layers.rope = lambda x, pos, theta: rope(x, pos + 8, theta)  # traced below, outside any jit cache
        own = F.empty_cache(w, len(s), start=len(p))
        x, _ = tf.forward(w.params, w.config, jnp.asarray(s), jnp.int32(len(s)), jnp.int32(len(p)), (prefix.cache,),
                          own, w.config.default_loops, 0)
    finally:
        layers.rope = rope
    shifted = np.asarray(tf.lm_head(w.params, w.config, x[-1]))
    assert not np.allclose(shifted, full, **CLOSE)


def test_batched_equals_single_calls_and_store_equals_generate():
    model = ouro_model("fp16")
    p = prompt_of(18, seed=5)
    prefix = model.build_prefix_cache(p)
    suffixes = [prompt_of(3, seed=6), [], prompt_of(6, seed=7)]
    batch = model.generate_batch_from_prefix_cache(prefix, suffixes, max_tokens=6)
    for s, got in zip(suffixes, batch):
        assert got == model.generate_from_prefix_cache(prefix, suffix=s, max_tokens=6)
    prompts = [prompt_of(9, seed=8), prompt_of(14, seed=9)]
    assert model.generate_batch(prompts, max_tokens=5) == [model.generate(q, max_tokens=5) for q in prompts]
    store = tl.PrefixStore(model)
    for q in (np.concatenate([p, prompt_of(4, seed=10)]), np.concatenate([p, prompt_of(5, seed=11)])):
        assert store.generate(q, max_tokens=6) == model.generate(q, max_tokens=6)


def test_at_depth_is_a_layer_subset_and_deeper_runs_only_new_passes():
    model = ouro_model("fp32")
    p = prompt_of(20, seed=12)
    deep = model.build_prefix_cache(p, loops=3, keep_state=True)
    two = deep.at_depth(2)
    assert two.cache.loop["k"] is deep.cache.loop["k"]  # a view: the same arrays
    np.testing.assert_allclose(np.asarray(two.logits), model.next_token_logits(p, loops=2), **CLOSE)
    assert model.generate_from_prefix_cache(two, max_tokens=6) == model.generate(p, loops=2, max_tokens=6)
    four = deep.at_depth(4)
    np.testing.assert_allclose(np.asarray(four.logits), model.next_token_logits(p, loops=4), **CLOSE)
    assert model.generate_from_prefix_cache(four, max_tokens=6) == model.generate(p, loops=4, max_tokens=6)


def test_speculative_greedy_equals_plain():
    model = ouro_model("fp32")
    p = prompt_of(15, seed=13)
    plain = model.generate(p, max_tokens=12)
    assert model.generate(p, max_tokens=12, draft_loops=1, lookahead=3) == plain
    assert model.generate(p, max_tokens=12, draft_loops=2, lookahead=2, exit_at_step=2) == plain


def test_model_and_prefix_save_load_round_trip(tmp_path):
    model = ouro_model("int8")
    model.save(str(tmp_path / "m"))
    again = tl.Model.load(str(tmp_path / "m"))
    assert again.weights.config == model.weights.config and again.fingerprint == model.fingerprint
    p = prompt_of(12, seed=14)
    prefix = model.build_prefix_cache(p)
    prefix.save(str(tmp_path / "p"))
    loaded = tl.PrefixCache.load(str(tmp_path / "p"), again)
    assert tree_equal(loaded.cache, prefix.cache)
    assert again.generate_from_prefix_cache(loaded, max_tokens=6) == model.generate(p, max_tokens=6)


def test_threads_share_a_prefix():
    model = ouro_model("fp16")
    p = prompt_of(16, seed=15)
    prefix = model.build_prefix_cache(p)
    suffixes = [prompt_of(2 + i, seed=20 + i) for i in range(4)]
    serial = [model.generate_from_prefix_cache(prefix, suffix=s, max_tokens=5) for s in suffixes]
    out = [None] * 4

    def run(i):
        out[i] = model.generate_from_prefix_cache(prefix, suffix=suffixes[i], max_tokens=5)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == serial


def test_gqa_cache_is_n_heads_over_n_kv_heads_smaller():
    model = ouro_model("fp16")
    c = model.weights.config
    mha = tl.Model.random(c.replace(n_kv_heads=c.n_heads), seed=0)
    p = prompt_of(20, seed=16)
    a, b = model.build_prefix_cache(p), mha.build_prefix_cache(p)
    kv_bytes = lambda x: x.nbytes - x.cache.pos.nbytes - x.cache.length.nbytes  # noqa: E731
    assert kv_bytes(b) == kv_bytes(a) * c.n_heads // c.n_kv_heads
    assert a.cache.loop["k"].shape[-3] == c.n_kv_heads and a.cache.n_layers == c.n_cache_layers(3)
    pos_bytes = 20 * 4 + 4
    assert (model.cache_nbytes(20) - pos_bytes) * c.n_heads // c.n_kv_heads == mha.cache_nbytes(20) - pos_bytes
