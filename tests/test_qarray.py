"""Weights kept quantized (`qarray`): GGUF's blocks (Q8_0, Q4_x, Q5_x, the K-quants) kept packed
bit for bit give the dequantized float32 model's logits, a fused projection whose parts are in
different types included (`qarray.Fused`); `quantize_weights` int8 / int4 shrink the weights, stay close
to float32, round-trip through save / load, and keep prefix reuse == recompute in every KV mode.

References: ggml's block layout written out by hand (`ref_dequantize` in test_gguf) and the
float32 model loaded with `quantize_weights="float"` (the dequantized weights, a plain forward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quant_blocks import packed as random_packed, width
from test_gguf import LAYERS, VOCAB, write_tiny, write_tiny_gpt2

import tinyloop_jax as tl
from tinyloop_jax import native
from tinyloop_jax.model import qarray
from tinyloop_jax.model import qpack

PROMPT = np.random.default_rng(1).integers(0, VOCAB, 13).astype(np.int32)
# every matrix in a kept-packed format, q|k|v and gate|up alike within a layer (they are fused)
PACKED_TYPES = {"attn_q": ["Q4_1", "Q8_0"], "attn_k": ["Q4_1", "Q8_0"], "attn_v": ["Q4_1", "Q8_0"],
                "attn_output": ["Q8_0", "Q4_1"], "ffn_gate": ["Q4_0", "Q4_1"], "ffn_up": ["Q4_0", "Q4_1"],
                "ffn_down": ["Q8_0", "Q4_0"]}


@pytest.fixture(scope="module")
def packed_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("packed") / "tiny.gguf")
    write_tiny(path, tied=True, matrix_types=PACKED_TYPES)
    return path


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_writes_a_quantization(fmt):
    w = np.random.default_rng(0).standard_normal((96, 120)).astype(np.float32)
    dense = np.asarray(qpack.quantize(w, fmt).dequantize())
    assert np.abs(dense - w).max() < {"q8_0": 0.05, "q4_0": 0.6, "q4_1": 0.4, "q5_0": 0.3, "q5_1": 0.2}[fmt]


@pytest.mark.parametrize("fmt", qarray.FORMATS)
def test_quantized_matmul_equals_dequantized_dot(fmt):
    """Through XLA (dequantize + dot, whole or in tiles tied to x), as on a GPU or a mesh."""
    rng = np.random.default_rng(0)
    k = width(fmt, 96)
    qa = qarray.reshape_out(random_packed(fmt, k, 120)[0], 3, 40)
    assert qa.shape == (k, 3, 40)
    dense = np.asarray(qa.dequantize())
    x = jnp.asarray(rng.standard_normal((5, k)).astype(np.float32))
    want = np.einsum("tk,kab->tab", np.asarray(x, np.float64), dense)
    for tile in (None, 3000):  # the whole matrix; tiles of 30 columns tied to x
        got = np.asarray(qarray.matmul(x, qa, tile=tile))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # the embedding / head orientation: [V, D] contracted over D, rows taken by token
    e = random_packed(fmt, k, 120, seed=1, transposed=True)[0]  # [120, k]
    np.testing.assert_allclose(np.asarray(qarray.head(x, e)), np.asarray(x) @ np.asarray(e.dequantize()).T,
                               rtol=1e-5, atol=1e-4)
    rows = jnp.asarray([3, 0, 119])
    np.testing.assert_array_equal(np.asarray(qarray.take(e, rows)), np.asarray(e.dequantize())[[3, 0, 119]])


def test_gguf_blocks_are_kept_bit_for_bit(packed_file):
    from tinyloop_jax.formats import gguf as gguf_format

    model = tl.Model.from_pretrained(packed_file, kv_mode="fp32", dtype="float32")
    blk = model.weights.params.loop[0] if model.weights.config.n_pre_blocks == 0 else model.weights.params.pre[0]
    assert isinstance(blk.w_o, qarray.QuantArray) and blk.w_o.fmt == "q8_0"  # blk.0.attn_output
    reader = gguf_format.open_file(packed_file)
    raw = reader.data(reader.tensors["blk.0.attn_output.weight"])  # [rows, 34 bytes per block]
    rows, nb = raw.shape[0], raw.shape[1] // 34
    blocks = raw.reshape(rows, nb, 34)
    # held in the native kernel's tiled order where it runs: the same bytes, reordered
    assert (blk.w_o.tiled is not None) == native.available()
    w_o = qarray.canonical(blk.w_o)
    np.testing.assert_array_equal(np.asarray(w_o.q).view(np.uint8),
                                  blocks[..., 2:].transpose(1, 2, 0))  # [nb, 32, rows]
    np.testing.assert_array_equal(np.asarray(w_o.scale).view(np.uint8).reshape(nb, rows, 2),
                                  blocks[..., :2].transpose(1, 0, 2))


def test_kept_packed_gguf_equals_dequantized_float32(packed_file):
    packed = tl.Model.from_pretrained(packed_file, kv_mode="fp32", dtype="float32")
    floats = tl.Model.from_pretrained(packed_file, kv_mode="fp32", dtype="float32", quantize_weights="float")
    leaves = jax.tree.leaves(packed.weights.params, is_leaf=qarray.is_quant)
    assert sum(qarray.is_quant(a) for a in leaves) == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down) + wte
    assert packed.nbytes < floats.nbytes / 3
    a, b = np.asarray(packed.next_token_logits(PROMPT)), np.asarray(floats.next_token_logits(PROMPT))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert packed.generate(PROMPT, max_tokens=8) == floats.generate(PROMPT, max_tokens=8)
    assert packed.fingerprint != floats.fingerprint


# every kept type, q, k, v (and gate, up) in different ones within a layer: fused as `qarray.Fused`
MIXED_TYPES = {"attn_q": ["Q4_K", "Q8_0"], "attn_k": ["Q5_0", "Q4_1"], "attn_v": ["Q6_K", "Q5_K"],
               "attn_output": ["Q5_1", "Q4_K"], "ffn_gate": ["Q5_K", "Q6_K"], "ffn_up": ["Q4_K", "Q5_0"],
               "ffn_down": ["Q6_K", "Q4_0"]}


def test_mixed_types_stay_packed_and_equal_dequantized(tmp_path):
    """A Q4_K_M-like file: every matrix packed as stored (no float copy of a fused projection
    whose parts differ in type), < 0.4x the float32 bytes, logits within 1e-4 of the largest of
    the dequantized model's, greedy tokens equal; the same through a checkpoint."""
    path = str(tmp_path / "mixed.gguf")
    write_tiny(path, tied=True, matrix_types=MIXED_TYPES)
    packed = tl.Model.from_pretrained(path, kv_mode="fp32", dtype="float32")
    floats = tl.Model.from_pretrained(path, kv_mode="fp32", dtype="float32", quantize_weights="float")
    blocks = (*packed.weights.params.pre, *packed.weights.params.loop)
    assert all(qarray.is_fused(b.w_qkv) and qarray.is_fused(b.w_gate_up) for b in blocks)
    assert all(qarray.is_quant(b.w_o) and qarray.is_quant(b.w_down) for b in blocks)
    assert packed.nbytes < 0.4 * floats.nbytes
    a, b = np.asarray(packed.next_token_logits(PROMPT)), np.asarray(floats.next_token_logits(PROMPT))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    tokens = packed.generate(PROMPT, max_tokens=8)
    assert tokens == floats.generate(PROMPT, max_tokens=8)
    packed.save(tmp_path / "ckpt")
    back = tl.Model.load(tmp_path / "ckpt")
    assert back.fingerprint == packed.fingerprint and back.nbytes == packed.nbytes
    assert back.generate(PROMPT, max_tokens=8) == tokens


# a GPT-2 file's block matrices in the kept formats (fused q|k|v is one tensor in GPT-2's GGUF)
GPT2_PACKED = {"attn_qkv": ["Q8_0", "Q4_1"], "attn_output": ["Q4_1", "Q8_0"], "ffn_up": ["Q4_0", "Q8_0"],
               "ffn_down": ["Q8_0", "Q4_0"]}


@pytest.mark.parametrize("head", ["untied", "copy"])
def test_gpt2_gguf_is_kept_packed(tmp_path, head):
    """A GPT-2 GGUF's quantized matrices stay packed as stored (llama.cpp's [out, in]
    rows read as Conv1D's [in, out]; the embedding too, and the head unless it is a copy of
    it); the logits equal the dequantized load's within the packed product's rounding."""
    path = str(tmp_path / "gpt2.gguf")
    write_tiny_gpt2(path, head=head, matrix_types=GPT2_PACKED)
    packed = tl.Model.from_pretrained(path, kv_mode="fp32", dtype="float32")
    floats = tl.Model.from_pretrained(path, kv_mode="fp32", dtype="float32", quantize_weights="float")
    p = packed.weights.params
    untied = head == "untied"  # its head is Q6_K, packed too
    assert sum(qarray.is_quant(a) for a in jax.tree.leaves(p, is_leaf=qarray.is_quant)) == LAYERS * 4 + 1 + untied
    assert qarray.is_quant(p.wte) and not qarray.is_quant(p.wpe)
    assert not untied or p.head.fmt == "q6_k"
    assert packed.weights.config.tie_embeddings == (head == "copy") == (p.head is None)
    # blk.0.attn_qkv's bytes, bit for bit, as the head-shaped w_qkv [D, 3, H, hd]
    from tinyloop_jax.formats import gguf as gguf_format
    reader = gguf_format.open_file(path)
    raw = reader.data(reader.tensors["blk.0.attn_qkv.weight"])  # [3D rows, 34 bytes per block]
    rows, nb = raw.shape[0], raw.shape[1] // 34
    w = qarray.canonical(p.pre[0].w_qkv)
    assert w.fmt == "q8_0" and w.shape == (nb * 32, 3, *w.shape[2:])
    np.testing.assert_array_equal(np.asarray(w.q).view(np.uint8).reshape(nb, 32, rows),
                                  raw.reshape(rows, nb, 34)[..., 2:].transpose(1, 2, 0))
    a, b = np.asarray(packed.next_token_logits(PROMPT)), np.asarray(floats.next_token_logits(PROMPT))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max() and np.abs(b).max() > 1
    want = floats.generate(PROMPT, max_tokens=8)
    assert packed.generate(PROMPT, max_tokens=8) == want
    assert packed.nbytes < floats.nbytes / 2
    packed.save(str(tmp_path / "saved"))  # saved packed: the same weights, format and tokens
    again = tl.Model.load(str(tmp_path / "saved"))
    assert again.fingerprint == packed.fingerprint != floats.fingerprint and qarray.is_quant(again.weights.params.wte)
    assert again.generate(PROMPT, max_tokens=8) == want


@pytest.fixture(scope="module")
def tiny_float():
    cfg = tl.ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_pre_blocks=1, default_loops=3, max_seq_len=128,
                         block="llama", n_kv_heads=2, kv_mode="fp32")
    return cfg, tl.Model.random(cfg, seed=3)


# measured on this random model (3 passes of large random matrices amplify every rounding): the
# largest logit error is 5.6% (int8) and 35% (int4) of the largest logit; correlation 0.9991 and 0.952
@pytest.mark.parametrize("mode, ratio, bound, corr", [("int8", (3.4, 3.9), 0.1, 0.998), ("int4", (5.5, 7.2), 0.5, 0.9)])
def test_quantize_weights_shrinks_and_stays_close(tiny_float, tmp_path, mode, ratio, bound, corr):
    cfg, full = tiny_float
    q = tl.Model.random(cfg, seed=3, quantize_weights=mode)
    matrices = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(q.weights.params, is_leaf=qarray.is_quant)
                   if qarray.is_quant(a))
    packed = sum(a.nbytes for a in jax.tree.leaves(q.weights.params, is_leaf=qarray.is_quant) if qarray.is_quant(a))
    assert ratio[0] < matrices / packed < ratio[1]  # q8_0: 128 / 34 bytes = 3.76; q4_0: 128 / 18 = 7.1
    a, b = np.asarray(q.next_token_logits(PROMPT % 96)), np.asarray(full.next_token_logits(PROMPT % 96))
    assert np.abs(a - b).max() <= bound * np.abs(b).max() and np.corrcoef(a, b)[0, 1] > corr
    q.save(str(tmp_path / "m"))
    back = tl.Model.load(str(tmp_path / "m"))
    for x, y in zip(jax.tree.leaves(q.weights.params), jax.tree.leaves(back.weights.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert back.fingerprint == q.fingerprint != full.fingerprint
    assert back.generate(PROMPT % 96, max_tokens=6) == q.generate(PROMPT % 96, max_tokens=6)


@pytest.mark.parametrize("kv_mode", ["fp32", "fp16", "int8", "int4", "fp16-h", "int8-h", "int4-h"])
def test_prefix_reuse_equals_recompute_with_int4_weights(tiny_float, kv_mode):
    cfg, _ = tiny_float
    model = tl.Model.random(cfg.replace(kv_mode=kv_mode), seed=3, quantize_weights="int4")
    prompt, suffix = PROMPT % 96, np.asarray([5, 9, 2], np.int32)
    prefix = model.build_prefix_cache(prompt)
    reuse = np.asarray(model.next_token_logits_from_prefix(prefix, suffix))
    full = np.asarray(model.next_token_logits(np.concatenate([prompt, suffix])))
    np.testing.assert_allclose(reuse, full, atol=1e-3, rtol=1e-2)
    got = model.generate_from_prefix_cache(prefix, max_tokens=6, suffix=suffix)
    assert got == model.generate(np.concatenate([prompt, suffix]), max_tokens=6)


def test_8bit_activations_model(tiny_float):
    """activations="int8" tags every packed weight; the logits move a little (the inputs' rounding)
    and every path agrees with itself: a prefix's reuse equals recompute, and the engine's
    batched, paged decode equals `generate` greedily beside a second request sharing the prompt."""
    cfg, _ = tiny_float
    base = tl.Model.random(cfg, seed=3, quantize_weights="int4")
    model = tl.Model.random(cfg, seed=3, quantize_weights="int4", activations="int8")
    packed = [a for a in jax.tree.leaves(model.weights.params, is_leaf=qarray.is_quant) if qarray.is_quant(a)]
    assert packed and all(a.act == "int8" for a in packed)
    prompt, suffix = PROMPT % 96, np.asarray([5, 9, 2], np.int32)
    a, b = np.asarray(model.next_token_logits(prompt)), np.asarray(base.next_token_logits(prompt))
    assert 1e-5 * np.abs(b).max() < np.abs(a - b).max() <= 0.1 * np.abs(b).max()
    prefix = model.build_prefix_cache(prompt)
    full = np.concatenate([prompt, suffix])
    np.testing.assert_allclose(np.asarray(model.next_token_logits_from_prefix(prefix, suffix)),
                               np.asarray(model.next_token_logits(full)), atol=1e-3, rtol=1e-2)
    want = model.generate(full, max_tokens=6)
    assert model.generate_from_prefix_cache(prefix, max_tokens=6, suffix=suffix) == want
    with tl.Engine(model, max_batch=4, prefill_chunk=16) as eng:
        hs = [eng.submit(full, max_tokens=6), eng.submit(np.concatenate([prompt, [7]]), max_tokens=4)]
        assert hs[0].result(timeout=300) == want
        assert hs[1].result(timeout=300) == model.generate(np.concatenate([prompt, [7]]), max_tokens=4)
    with pytest.raises(ValueError, match="activations='int4'"):
        tl.Model.random(cfg, quantize_weights="int4", activations="int4")


def test_bad_quantize_weights_is_a_value_error(tiny_float):
    cfg, _ = tiny_float
    with pytest.raises(ValueError, match="'int3'"):
        tl.Model.random(cfg, quantize_weights="int3")
    odd = cfg.replace(d_model=48, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match="multiple of 32"):
        tl.Model.random(odd, quantize_weights="int8")


def test_smollm2_kept_packed_equals_dequantized(smollm2):
    model, _ = smollm2  # the session's load, packed as stored
    floats = tl.Model.from_pretrained("smollm2", kv_mode="fp32", dtype="float32", quantize_weights="float")
    assert qarray.is_quant(model.weights.params.wte) and model.weights.params.wte.fmt == "q8_0"
    assert model.weights.params.pre[0].w_down.fmt == "q4_1"
    prompt = np.arange(100, 140, dtype=np.int32)
    # the prompt's logits from the prefill program `generate` runs next (two programs, not four)
    a, b = (np.asarray(m.build_prefix_cache(prompt).logits) for m in (model, floats))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert model.generate(prompt, max_tokens=8) == floats.generate(prompt, max_tokens=8)
    assert model.nbytes < floats.nbytes / 5
    # 8-bit activations (the same weights, no second load): measured 3.0% of the largest logit and
    # a correlation of 0.9988 on this prompt; 0.0015 bits/byte on held-out text (docs/quality.md)
    c = np.asarray(tl.Model(model.weights.params, model.weights.config, activations="int8")
                   .build_prefix_cache(prompt).logits)
    assert np.abs(c - b).max() <= 0.06 * np.abs(b).max() and np.corrcoef(c, b)[0, 1] > 0.995


def test_cli_weights_flag(packed_file, capsys):
    from test_bundled_and_cli import tinyloop

    outs = {}
    for form in ("as-stored", "float", "int4"):
        r = tinyloop(capsys, "generate", "--model", packed_file, "--kv-mode", "fp32", "--weights", form,
                     "--max-tokens", "6", "the cat")
        assert r.returncode == 0, r.stderr
        outs[form] = r.stdout
    assert outs["as-stored"] == outs["float"]  # packed == dequantized, greedy
    assert outs["int4"].startswith("the cat")
    assert tinyloop(capsys, "generate", "--model", packed_file, "--weights", "int3", "x").returncode == 2
    r = tinyloop(capsys, "generate", "--model", packed_file, "--kv-mode", "fp32", "--activations", "int8",
                 "--max-tokens", "6", "the cat")
    assert r.returncode == 0 and r.stdout.startswith("the cat"), r.stderr
    assert tinyloop(capsys, "generate", "--model", packed_file, "--activations", "int4", "x").returncode == 2
