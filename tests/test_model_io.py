"""Model.save / Model.load with orbax."""

import os

import numpy as np
import pytest

import tinyloop_jax as tl
from conftest import prompt_of


def test_save_load_round_trip(models, tmp_path):
    model = models["fp32"]
    path = tmp_path / "m"
    model.save(path)
    loaded = tl.Model.load(path)
    assert loaded.config() == model.config()
    p = prompt_of(11)
    np.testing.assert_array_equal(loaded.next_token_logits(p), model.next_token_logits(p))
    assert loaded.generate(p, max_tokens=8) == model.generate(p, max_tokens=8)
    assert loaded.fingerprint == model.fingerprint
    fp16 = tl.Model.load(path, kv_mode="fp16")
    assert fp16.config()["kv_mode"] == "fp16" and fp16.fingerprint != model.fingerprint


def test_save_refuses_to_overwrite(models, tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ValueError, match="exists"):
        models["fp32"].save(tmp_path / "x")


def test_load_rejects_bad_folders(models, tmp_path):
    with pytest.raises(ValueError):
        tl.Model.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a tinyloop"):
        tl.Model.load(tmp_path / "empty")
    models["fp32"].save(tmp_path / "m")
    with pytest.raises(ValueError, match="kv_mode"):
        tl.Model.load(tmp_path / "m", kv_mode="nope")
    # truncate the array store: a clear error, never a model with wrong weights
    arrays = tmp_path / "m" / "arrays"
    for root, _, files in os.walk(arrays):
        for f in files:
            if f not in ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "commit_success.txt"):
                fp = os.path.join(root, f)
                with open(fp, "r+b") as fh:
                    fh.truncate(max(0, os.path.getsize(fp) // 2))
    with pytest.raises((RuntimeError, ValueError)):
        tl.Model.load(tmp_path / "m")


def flip_a_byte(folder):
    """Corrupt the largest data file of an orbax array store in the middle."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as fh:
        fh.seek(os.path.getsize(big) // 2)
        b = fh.read(1)
        fh.seek(os.path.getsize(big) // 2)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_load_detects_corrupted_weights(models, tmp_path):
    models["fp32"].save(tmp_path / "m")
    flip_a_byte(tmp_path / "m" / "arrays")
    with pytest.raises(RuntimeError, match="corrupted"):
        tl.Model.load(tmp_path / "m")


def test_checkpoints_from_before_the_llama_family_load_unchanged():
    """The bundled checkpoint and the GPT-2 folder, saved before loop stacks and Llama blocks
    existed: same fingerprint (config description + every weight) and the same greedy output as
    the code before that change gave (recorded on commit ee51fae)."""
    from tinyloop_jax.cli import BUNDLED
    from tinyloop_jax.demo import BYTE_DOCUMENT as SYSTEM_PROMPT, BYTE_QUESTIONS as QUESTIONS
    bundled = tl.Model.load(BUNDLED)
    assert bundled.fingerprint == "c7c5d1fc0f6aa9b4cef02932f706990632592fdba592d7943e1932fa4a0a67bf"
    tok = tl.ByteTokenizer()
    p = tok.encode(SYSTEM_PROMPT + QUESTIONS[0])
    assert tok.decode(bundled.generate(p, max_tokens=60)[len(p):]) == (
        "A function of the statement the same is a statement the same")
    gpt2 = tl.Model.from_hf_gpt2(os.path.join(os.path.dirname(__file__), "data", "gpt2-tiny"), kv_mode="fp32")
    assert gpt2.fingerprint == "02f3a81697244ad90228af1a31f9415c91ec312ba378d166fb21d17729c13db6"
    q = list(range(5, 40, 3))
    assert gpt2.generate(q, max_tokens=12)[len(q):] == [446, 520, 520, 520, 520, 520, 520, 520, 895, 245, 245, 245]


LLAMA = tl.ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, intermediate_size=40, n_pre_blocks=1,
                       default_loops=2, max_seq_len=64, block="llama", attention_bias=True, kv_mode="fp32")


def test_flat_fused_columns_are_the_head_shaped_projection():
    """Layout 1's flat w_qkv / b_qkv columns (q heads, then k heads, then v heads, each head's hd
    contiguous, as Hugging Face's q|k|v_proj) project to the q, k, v that the head-shaped
    weights give, and its gate | up columns to the gate and up halves."""
    import jax.numpy as jnp
    from tinyloop_jax.model import layers
    from tinyloop_jax.model.params import to_flat_layout

    c, H, KV, hd = LLAMA, LLAMA.n_heads, LLAMA.n_kv_heads, LLAMA.head_dim
    blk = tl.Model.random(c, seed=3).weights.params.loop[0]
    x, pos = np.random.default_rng(0).normal(size=(5, c.d_model)).astype(np.float32), jnp.arange(5)
    h, q, k, v = layers.qkv_heads(jnp.asarray(x), blk, c, pos)
    wf, bf = (to_flat_layout(n, np.asarray(getattr(blk, n)), c) for n in ("w_qkv", "b_qkv"))
    y = np.asarray(h) @ wf + bf
    heads = lambda a, n: a.reshape(5, n, hd).transpose(1, 0, 2)  # noqa: E731
    qf, kf, vf = heads(y[:, :H * hd], H), heads(y[:, H * hd:(H + KV) * hd], KV), heads(y[:, (H + KV) * hd:], KV)
    for got, want in ((q, layers.rope(qf, pos, c.rope_theta)), (k, layers.rope(kf, pos, c.rope_theta)),
                      (v, vf)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    gu = to_flat_layout("w_gate_up", np.asarray(blk.w_gate_up), c)
    F = c.intermediate_size
    np.testing.assert_array_equal(gu[:, :F], blk.w_gate_up[:, 0])
    np.testing.assert_array_equal(gu[:, F:], blk.w_gate_up[:, 1])


def test_layout_1_checkpoints_load_as_the_same_model(tmp_path):
    """A model checkpoint without a recorded weight layout (every one saved before head-shaped
    weights) holds the fused projections flat; it loads as the same model (fingerprint and
    logits), and a layout this version does not know is refused."""
    from tinyloop_jax.formats import checkpoint
    from tinyloop_jax.model.params import host_leaves, to_flat_layout

    model = tl.Model.random(LLAMA, seed=3)
    w = model.weights
    flat = {n: to_flat_layout(n, a, w.config) for n, a in host_leaves(w.params, w.config)}
    assert flat["loop.0.w_qkv"].shape == (32, (4 + 2 * 2) * 8) and flat["loop.0.w_gate_up"].shape == (32, 80)
    checkpoint.save(tmp_path / "old", "model", flat, {"config": w.config.to_dict()})
    old = tl.Model.load(tmp_path / "old")
    assert old.fingerprint == model.fingerprint
    p = prompt_of(9, vocab=64)
    np.testing.assert_array_equal(old.next_token_logits(p), model.next_token_logits(p))
    checkpoint.save(tmp_path / "new", "model", flat, {"config": w.config.to_dict(), "layout": 3})
    with pytest.raises(ValueError, match="layout 3"):
        tl.Model.load(tmp_path / "new")
