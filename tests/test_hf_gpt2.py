"""GPT-2 import: parity with Hugging Face `transformers` (golden files made by
scripts/make_gpt2_golden.py, and live when transformers is installed), prefix reuse on GPT-2
weights (seed 000's test), and bad folders."""

import json
import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from conftest import forward_seq

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "gpt2-tiny")
PARITY = dict(atol=1e-4, rtol=1e-4)
CLOSE = dict(atol=1e-3, rtol=1e-2)


@pytest.fixture(scope="module")
def gpt2():
    return tl.Model.from_hf_gpt2(GOLDEN, kv_mode="fp32")


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(os.path.join(GOLDEN, "golden.npz")))


def test_config_maps_to_a_loops_1_model(gpt2):
    c = gpt2.config()
    assert (c["n_pre_blocks"], c["default_loops"], c["d_model"], c["n_heads"], c["vocab_size"], c["max_seq_len"]) == (
        2, 1, 64, 4, 1000, 128)


@pytest.mark.parametrize("n", [1, 7, 33, 100])
def test_logits_equal_hugging_face(gpt2, golden, n):
    tokens, want = golden[f"prompt_{n}"], golden[f"logits_{n}"]
    w = gpt2.weights
    every = np.asarray(forward_seq(w.params, w.config, jnp.asarray(tokens), loops=1))  # all positions
    np.testing.assert_allclose(every, want, **PARITY)
    np.testing.assert_allclose(gpt2.next_token_logits(tokens), want[-1], **PARITY)  # the cached path


@pytest.mark.parametrize("n", [5, 16, 64])
def test_greedy_generations_equal_hugging_face(gpt2, golden, n):
    prompt, want = golden[f"gen_prompt_{n}"], golden[f"gen_{n}"]
    assert gpt2.generate(prompt, max_tokens=len(want) - len(prompt)) == want.tolist()


def test_prefix_reuse_on_gpt2_weights(gpt2):
    """Seed 000's test on imported GPT-2 weights: reuse == recompute, the saved cache is not
    changed, and the position-reset variant fails the comparison."""
    rng = np.random.default_rng(0)
    prefix, suffix = rng.integers(0, 1000, 40), rng.integers(0, 1000, 9)
    w = gpt2.weights
    saved = F.save_prefix_cache(prefix, w)
    before = [np.asarray(x).copy() for x in __import__("jax").tree.leaves(saved)]
    full = gpt2.next_token_logits(np.concatenate([prefix, suffix]))
    np.testing.assert_allclose(F.generate_with_prefix(saved, len(prefix), suffix, w), full, **CLOSE)
    assert not np.allclose(F.generate_with_prefix(saved, 0, suffix, w), full, **CLOSE)
    after = __import__("jax").tree.leaves(saved)
    assert int(saved.length) == len(prefix) and all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))


def copy_golden(tmp_path):
    d = tmp_path / "gpt2"
    shutil.copytree(GOLDEN, d)
    return d


def test_missing_files_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        tl.Model.from_hf_gpt2(tmp_path / "nope")
    d = copy_golden(tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(ValueError, match="no model.safetensors"):
        tl.Model.from_hf_gpt2(d)
    os.remove(d / "config.json")
    with pytest.raises(ValueError, match="no config.json"):
        tl.Model.from_hf_gpt2(d)


def rewrite_tensors(d, change):
    t = {k: v for k, v in load_file(str(d / "model.safetensors")).items()}
    change(t)
    save_file(t, str(d / "model.safetensors"))


def test_wrong_shape_missing_tensor_and_wrong_vocab(tmp_path):
    d = copy_golden(tmp_path)
    rewrite_tensors(d, lambda t: t.update({"transformer.h.1.mlp.c_fc.weight": np.zeros((64, 200), np.float32)}))
    want = r"'h.1.mlp.c_fc.weight' has shape \(64, 200\); config.json implies \(64, 256\)"
    with pytest.raises(ValueError, match=want):
        tl.Model.from_hf_gpt2(d)

    d = copy_golden(tmp_path / "b")
    rewrite_tensors(d, lambda t: t.pop("transformer.h.2.attn.c_proj.bias"))
    with pytest.raises(ValueError, match="'h.2.attn.c_proj.bias' is missing"):
        tl.Model.from_hf_gpt2(d)

    d = copy_golden(tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, vocab_size=1001)))
    with pytest.raises(ValueError, match=r"'wte.weight' has shape \(1000, 64\); config.json implies \(1001, 64\)"):
        tl.Model.from_hf_gpt2(d)

    d = copy_golden(tmp_path / "d")
    (d / "config.json").write_text(json.dumps(dict(cfg, activation_function="relu")))
    with pytest.raises(ValueError, match="activation_function 'relu'"):
        tl.Model.from_hf_gpt2(d)

    d = copy_golden(tmp_path / "e")
    rewrite_tensors(d, lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] + 1}))
    with pytest.raises(ValueError, match="differs from .wte.weight. but tie_word_embeddings is true"):
        tl.Model.from_hf_gpt2(d)


def test_live_parity_with_transformers(tmp_path):
    """A second random config, built and run by transformers now (skipped only without it)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"transformers/torch not installed ({e}); install the 'hf' extra for the live parity test")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import make_gpt2_golden as mk

    hf = mk.build(str(tmp_path), n_layer=2, n_embd=48, n_head=6, vocab=333, n_positions=64, seed=1)
    ours = tl.Model.from_hf_gpt2(tmp_path, kv_mode="fp32")
    tokens = np.random.default_rng(1).integers(0, 333, 50).tolist()
    w = ours.weights
    np.testing.assert_allclose(np.asarray(forward_seq(w.params, w.config, jnp.asarray(tokens), loops=1)),
                               mk.hf_logits(hf, tokens), **PARITY)
    assert ours.generate(tokens[:10], max_tokens=20) == mk.hf_greedy(hf, tokens[:10], 20)
