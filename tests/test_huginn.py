"""Huginn ("raven", model_type huginn_raven): parity with its own modeling code (golden files from
scripts/make_huginn_golden.py on tiny random models written by the reference's save_pretrained),
the seeded initial state, and the runtime's features on the prelude / core / coda layout."""

import json
import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from tinyloop_jax.model import recurrence as rec
from conftest import forward_seq, prompt_of

DATA = os.path.join(os.path.dirname(__file__), "data")
SHAPES = {"222": (2, 2, 2, 4), "242": (2, 4, 2, 3)}  # prelude, core, coda blocks, mean_recurrence
PARITY = dict(atol=1e-4, rtol=0)  # the bound: max |dlogit| <= 1e-4 in float32
CLOSE = dict(atol=1e-3, rtol=1e-2)
CACHED_STEPS = 4


def folder(name: str) -> str:
    return os.path.join(DATA, f"huginn-tiny-{name}")


_MODELS: dict = {}


def huginn(name: str, kv_mode: str = "fp32", init_scale: float = 0.0) -> tl.Model:
    """The tiny folder's model (shared per arguments); init_scale 0: the goldens' zero state."""
    key = (name, kv_mode, init_scale)
    if key not in _MODELS:
        m = tl.Model.from_pretrained(folder(name), kv_mode=kv_mode)
        w = m.weights
        _MODELS[key] = tl.Model(w.params, w.config.replace(state_init_scale=init_scale))
    return _MODELS[key]


_GOLDEN: dict = {}


def golden(name: str) -> dict:
    if name not in _GOLDEN:
        _GOLDEN[name] = dict(np.load(os.path.join(folder(name), "golden.npz")))
    return _GOLDEN[name]


@pytest.mark.parametrize("name", SHAPES)
def test_folder_maps_to_prelude_core_coda(name):
    n_pre, k, n_post, mean = SHAPES[name]
    m = tl.Model.from_pretrained(folder(name), kv_mode="fp32")
    c = m.weights.config
    assert (c.n_pre_blocks, c.loop_blocks, c.n_post_blocks, c.default_loops) == (n_pre, k, n_post, mean)
    assert (c.block, c.norm_placement, c.injection, c.rope_pairing, c.norm_before_coda) == (
        "llama", "normed_residual", "concat_adapter", "adjacent", True)
    assert c.embed_scale == math.sqrt(64) and c.state_init_scale == 1.0 and c.attention_bias
    assert c.tie_embeddings == (name == "222") and c.rope_theta == (50_000 if name == "222" else 10_000)
    # cache layers: prelude, then steps x core blocks, then coda
    assert c.n_cache_layers(8) == n_pre + 8 * k + n_post
    assert m.build_prefix_cache(prompt_of(5), loops=8).cache.n_layers == n_pre + 8 * k + n_post
    # the reference saves no lm_head when tied, and its RoPE buffer (checked against our table)
    from safetensors import safe_open
    names = set(safe_open(os.path.join(folder(name), "model.safetensors"), "np").keys())
    assert "freqs_cis" in names and ("lm_head.weight" in names) == (name == "242")


@pytest.mark.parametrize("name", SHAPES)
def test_logits_at_every_position_match_the_reference(name):
    w, g = huginn(name).weights, golden(name)
    for i in range(2):
        p = jnp.asarray(g[f"prompt_{i}"])
        for s in g["steps"]:
            got = np.asarray(forward_seq(w.params, w.config, p, loops=int(s)))
            np.testing.assert_allclose(got, g[f"logits_s{s}_{i}"], **PARITY)
        np.testing.assert_allclose(np.asarray(forward_seq(w.params, w.config, p, loops=w.config.default_loops)),
                                   g[f"logits_default_{i}"], **PARITY)
    # the depth is load-bearing: the reference's logits move between 1 and 8 steps
    assert np.abs(g["logits_s1_1"] - g["logits_s8_1"]).max() > 1e-2


@pytest.mark.parametrize("name", SHAPES)
def test_greedy_tokens_match_the_reference(name):
    m, g = huginn(name), golden(name)
    for i in range(2):
        p = g[f"prompt_{i}"]
        want = g[f"greedy_{i}"].tolist()
        assert m.generate(p, max_tokens=len(want), loops=CACHED_STEPS)[len(p):] == want
        want = g[f"greedy_default_{i}"].tolist()
        assert m.generate(p, max_tokens=len(want))[len(p):] == want


@pytest.mark.parametrize("name", SHAPES)
def test_cached_path_matches_the_reference(name):
    """Token by token through the cache (prelude, steps x core, coda layers), and a prefill of
    half the prompt then decode, each token's logits against the reference's own cached path."""
    m, g = huginn(name), golden(name)
    w, p = m.weights, g["prompt_1"]
    cache = F.empty_cache(w, len(p), loops=CACHED_STEPS)
    for t, tok in enumerate(p):
        logits, cache = F.decode_step(w, int(tok), cache, loops=CACHED_STEPS)
        np.testing.assert_allclose(np.asarray(logits), g["cached_token_by_token"][t], **PARITY)
    half = int(g["cached_half"])
    cache = F.empty_cache(w, len(p), loops=CACHED_STEPS)
    logits, cache = F.prefill(w, p[:half], cache, loops=CACHED_STEPS)
    rows = [logits]
    for tok in p[half:]:
        logits, cache = F.decode_step(w, int(tok), cache, loops=CACHED_STEPS)
        rows.append(logits)
    np.testing.assert_allclose(np.stack([np.asarray(r) for r in rows]), g["cached_prefill_then_decode"], **PARITY)


def test_shared_kv_matches_the_references_compressed_cache():
    """Huginn's own cache with `compress-s4` / `compress-s8` (its 4-block core: kv_share last /
    ring:2), greedy from each prompt at 4 steps: the tokens `generate` gives on the compact
    store, and the logits of every decode step on the naive store it equals (tests/test_kv_share.py)."""
    from test_kv_share import naive_run

    m, g = huginn("242"), golden("242")
    share = np.load(os.path.join(folder("242"), "share.npz"))
    steps = int(share["steps"])
    for strategy, mode in json.loads(str(share["strategies"])).items():
        shared = tl.Model(m.weights.params, m.weights.config.replace(kv_share=mode))
        for i in range(2):
            p, want = g[f"prompt_{i}"], share[f"{strategy}_{i}_tokens"].tolist()
            assert shared.generate(p, max_tokens=len(want), loops=steps)[len(p):] == want, (strategy, i)
            tokens, logits = naive_run(m, shared.weights.config.share, p.tolist(), steps, len(want))
            assert tokens == want
            np.testing.assert_allclose(logits, share[f"{strategy}_{i}_logits"], **PARITY)
    # adaptive depth (kl exits) through the reference's compressed cache: tokens and passes
    last = tl.Model(m.weights.params, m.weights.config.replace(kv_share="last"))
    steps = int(share["adaptive_steps"])
    for i in range(2):
        p = g[f"prompt_{i}"]
        for thr in (1e-3, 1e-2):
            for no_prefill_exit in (0, 1):
                key = f"adaptive_{i}_{thr}_{no_prefill_exit}"
                want = share[f"{key}_tokens"].tolist()
                got = last.generate(p, max_tokens=len(want), loops=steps, exit_criterion="kl", exit_threshold=thr,
                                    exit_in_prefill=not no_prefill_exit)[len(p):]
                assert got == want and last.last_passes == share[f"{key}_passes"].tolist(), key
    full = dict(np.load(os.path.join(folder("242"), "adaptive.npz")))  # (the reference's full cache, latest-m4)
    assert any(full[c["key"] + "_tokens"].tolist() != share[f"adaptive_{c['prompt']}_{c['threshold']}_"
                                                            f"{int(not c['exit_in_prefill'])}_tokens"].tolist()
               for c in json.loads(str(full["cases"])) if c["criterion"] == "kl" and c["min_steps"] == 0
               and not c["continuous_compute"])
    # (the compression is load-bearing: the reference's compressed greedy tokens differ from its full cache's)
    assert any(share[f"compress-s4_{i}_tokens"].tolist() != g[f"greedy_{i}"].tolist() for i in range(2))


@pytest.mark.parametrize("mode", ["fp16", "int8-h"])
def test_prefix_reuse_equals_recompute(mode):
    m = huginn("242", kv_mode=mode)
    p = prompt_of(24, seed=3)
    prefix = m.build_prefix_cache(p[:17])
    np.testing.assert_allclose(m.next_token_logits_from_prefix(prefix, p[17:]), m.next_token_logits(p), **CLOSE)
    assert m.generate_from_prefix_cache(prefix, suffix=p[17:], max_tokens=8) == m.generate(p, max_tokens=8)
    suffixes = [p[17:20], [], p[17:]]
    batch = m.generate_batch_from_prefix_cache(prefix, suffixes, max_tokens=5)
    assert batch == [m.generate_from_prefix_cache(prefix, suffix=s, max_tokens=5) for s in suffixes]


def test_prefix_reuse_with_drawn_states_and_deeper_prefixes():
    """With random initial states (init_scale 1): a prefix built with seed s plus a suffix
    decoded with seed s equals the whole prompt generated with seed s (the state of a position
    depends on the seed and the position only); a prefix taken deeper continues from its kept
    (state | prelude output) carry and equals one built at that depth."""
    m = huginn("222", init_scale=1.0)
    p = prompt_of(21, seed=4)
    prefix = m.build_prefix_cache(p[:15], seed=7)
    assert prefix.seed == 7
    assert m.generate_from_prefix_cache(prefix, suffix=p[15:], max_tokens=8, seed=7) == m.generate(
        p, max_tokens=8, seed=7)
    full = m.next_token_logits(p)  # seed 0
    np.testing.assert_allclose(m.next_token_logits_from_prefix(m.build_prefix_cache(p[:15]), p[15:]), full, **CLOSE)
    assert not np.allclose(m.next_token_logits_from_prefix(prefix, p[15:]), full, **CLOSE)  # the prefix's seed counts
    shallow = m.build_prefix_cache(p, loops=2, keep_state=True, seed=5)
    assert shallow.state.shape[-1] == 2 * 64  # the carry: state | prelude output
    deep = shallow.at_depth(5)
    np.testing.assert_allclose(np.asarray(deep.logits), np.asarray(m.build_prefix_cache(p, loops=5, seed=5).logits),
                               **CLOSE)
    plain = m.generate(p, max_tokens=8, seed=5)
    assert m.generate(p, max_tokens=8, seed=5, draft_loops=2, lookahead=3) == plain


def test_same_seed_same_tokens_different_seeds_differ():
    m = huginn("222", init_scale=1.0)
    p = prompt_of(12, seed=5)
    runs = {s: m.generate(p, max_tokens=12, seed=s) for s in (1, 2, 3)}
    assert m.generate(p, max_tokens=12, seed=1) == runs[1]
    assert len({tuple(r) for r in runs.values()}) > 1
    one, two = (np.asarray(m.build_prefix_cache(p, seed=s).logits) for s in (1, 2))
    assert not np.allclose(one, two, **CLOSE)
    # init_scale 0: the zero state, whatever the seed
    z = huginn("222")
    assert z.generate(p, max_tokens=6, seed=1) == z.generate(p, max_tokens=6, seed=2)


def _phi(z: float) -> float:
    return math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


def _mass(z: float) -> float:
    """P(|Z| < z) for a standard normal Z."""
    return math.erf(z / math.sqrt(2))


TRUNC_STD = math.sqrt(1 - 2 * 3 * _phi(3) / _mass(3))  # std of N(0, 1) truncated at +-3: 0.9865


def test_initial_state_follows_the_reference_rule():
    """sigma = sqrt(2 / (5 D)) * init_scale, truncated at +-3 sigma, times sqrt(D): checked on
    4096 positions x 64 channels against the truncated normal's std and the reference's own draw."""
    cfg = huginn("222", init_scale=1.0).weights.config
    pos = jnp.arange(4096)
    x = np.asarray(rec.initial_state(cfg, jnp.uint32(3), pos), np.float64)
    sigma = math.sqrt(2 / (5 * 64)) * cfg.embed_scale
    want_std = sigma * TRUNC_STD
    assert abs(x.std() / want_std - 1) < 0.01 and abs(x.mean()) < 0.01 * sigma
    assert np.abs(x).max() <= 3 * sigma * (1 + 1e-6) and np.abs(x).max() > 2.9 * sigma  # truncated, and reached
    g = golden("222")  # the reference's draw of the same size
    assert abs(float(g["ref_state_std"]) / want_std - 1) < 0.01 and float(g["ref_state_absmax"]) <= 3 * sigma * 1.001
    for z in (0.5, 1.0, 2.0):  # the shape: mass within +-z sigma, as the truncated normal has it
        assert abs(np.mean(np.abs(x) < z * sigma) - _mass(z) / _mass(3)) < 0.005
    again = np.asarray(rec.initial_state(cfg, jnp.uint32(3), pos[100:110]), np.float64)
    np.testing.assert_array_equal(again, x[100:110])  # a function of (seed, position)
    assert not np.allclose(np.asarray(rec.initial_state(cfg, jnp.uint32(4), pos[:10])), x[:10])
    half = cfg.replace(state_init_scale=0.5)
    np.testing.assert_allclose(np.asarray(rec.initial_state(half, jnp.uint32(3), pos[:10])), x[:10] / 2, rtol=1e-6)
    assert not np.any(np.asarray(rec.initial_state(cfg.replace(state_init_scale=0.0), jnp.uint32(3), pos)))


def test_save_load_round_trip(tmp_path):
    m = huginn("242", init_scale=0.5)
    m.save(str(tmp_path / "m"))
    back = tl.Model.load(str(tmp_path / "m"))
    assert back.fingerprint == m.fingerprint and back.config()["injection"] == "concat_adapter"
    p = prompt_of(9, seed=6)
    np.testing.assert_array_equal(back.next_token_logits(p), m.next_token_logits(p))
    prefix = m.build_prefix_cache(p, seed=9)
    prefix.save(str(tmp_path / "prefix"))
    loaded = tl.PrefixCache.load(str(tmp_path / "prefix"), back)
    assert loaded.seed == 9
    assert back.generate_from_prefix_cache(loaded, max_tokens=5, seed=9) == m.generate(p, max_tokens=5, seed=9)


def test_other_families_describe_themselves_as_before():
    for cfg in (tl.ModelConfig(), tl.ModelConfig(block="llama", norm_placement="sandwich", pass_norm=True)):
        assert not {"injection", "state_init_scale", "embed_scale", "norm_before_coda",
                    "rope_pairing"} & set(cfg.to_dict())


def _copy(tmp_path, name="222", **changes) -> str:
    d = tmp_path / f"h{len(list(tmp_path.iterdir()))}"
    shutil.copytree(folder(name), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("key,value", [("block_class_name", "TransformerPreNormBlock"), ("injection_type", "add"),
                                       ("nonlin_name", "GELU"), ("state_init", "zero"), ("test_time_noise", 0.5),
                                       ("bias", True), ("num_key_value_heads", 2), ("n_layers_in_coda", 0),
                                       ("qk_bias", "yes"), ("mean_recurrence", 0), ("padded_vocab_size", 256),
                                       ("rope_base", -1)])
def test_unsupported_config_values_name_the_key(tmp_path, key, value):
    with pytest.raises(ValueError, match=key):
        tl.Model.from_pretrained(_copy(tmp_path, **{key: value}))


def test_folder_and_weights_must_agree(tmp_path):
    with pytest.raises(ValueError, match="freqs_cis"):  # another RoPE base than the stored table's
        tl.Model.from_pretrained(_copy(tmp_path, rope_base=20_000))
    with pytest.raises(ValueError, match="transformer.core_block.2"):  # a deeper core than the weights hold
        tl.Model.from_pretrained(_copy(tmp_path, n_layers_in_recurrent_block=3))
    with pytest.raises(ValueError, match="lm_head"):  # an untied head the tied folder does not have
        tl.Model.from_pretrained(_copy(tmp_path, tie_embeddings=False))


def test_bad_recurrence_settings():
    llama = dict(block="llama", vocab_size=64, d_model=32, n_heads=4, n_post_blocks=1, kv_mode="fp32")
    for kw, key in ((dict(injection="add"), "injection"), (dict(rope_pairing="odd"), "rope_pairing"),
                    (dict(injection="concat_adapter", state_init_scale=-1.0), "state_init_scale"),
                    (dict(injection="concat_adapter", state_init_scale=float("nan")), "state_init_scale"),
                    (dict(injection="concat_adapter", embed_scale=0.0), "embed_scale"),
                    (dict(mlp_act="relu"), "mlp_act"), (dict(layer_windows=(8,)), "layer_windows"),
                    (dict(state_init_scale=0.0), "state_init_scale"),
                    (dict(injection="concat_adapter", pass_norm=True, n_post_blocks=0), "injection"),
                    (dict(norm_before_coda=True, n_post_blocks=0), "norm_before_coda"),
                    (dict(norm_placement="residual"), "norm_placement")):
        with pytest.raises(ValueError, match=key):
            tl.ModelConfig(**{**llama, **kw})
    with pytest.raises(ValueError, match="rope_pairing"):
        tl.ModelConfig(vocab_size=64, d_model=32, n_heads=4, rope_pairing="adjacent")


def test_random_huginn_layout_runs_every_kv_mode_path():
    """A random model of the same shape family (no folder): injection, adjacent RoPE and normed
    residuals through random_params and an int4 mode's decode path."""
    cfg = tl.ModelConfig(vocab_size=128, d_model=32, n_heads=4, block="llama", intermediate_size=48,
                         n_pre_blocks=1, loop_blocks=2, n_post_blocks=1, default_loops=3, max_seq_len=64,
                         norm_placement="normed_residual", injection="concat_adapter", embed_scale=4.0,
                         norm_before_coda=True, rope_pairing="adjacent", attention_bias=True, kv_mode="int4")
    m = tl.Model.random(cfg, seed=2)
    assert m.weights.params.adapter.shape == (64, 32)
    p = prompt_of(14, seed=8)
    prefix = m.build_prefix_cache(p[:10])
    np.testing.assert_allclose(m.next_token_logits_from_prefix(prefix, p[10:]), m.next_token_logits(p), **CLOSE)
