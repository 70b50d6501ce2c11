"""Gemma 3 (`gemma3_text` folders, `gemma3` GGUF files) against Hugging Face transformers' Gemma 3.

A tiny random model (tests/data/gemma3-tiny, golden files by scripts/make_gemma3_golden.py: six
layers, five of them sliding over 8 positions with RoPE base 1e4 and one global with 1e6, q / k
norms, sandwich norms, tanh-GELU, embeddings scaled by sqrt(d)) as its folder and as a GGUF file of
the same weights written here the way llama.cpp writes Gemma 3 (norms stored as 1 + w, no q / k
row permutation): logits at every position, cached and uncached, greedy tokens, prefix reuse
across a window boundary, the paged engine. And the real Gemma 3 270M Q4_K_M (fetched once, kept
packed): its tokenizer's ids, logits of three prompts and a greedy continuation against
transformers' on the same file.
"""

import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from tinyloop_jax.decoding import paged_decode
from tinyloop_jax.api.prefix import tree_equal
from tinyloop_jax.formats import hub
from tinyloop_jax.model import cache as kvc
from tinyloop_jax.model import qarray
from conftest import forward_seq

DATA = os.path.join(os.path.dirname(__file__), "data")
TINY = os.path.join(DATA, "gemma3-tiny")
PARITY = dict(atol=1e-4, rtol=0)
# llama.cpp's names for Hugging Face's, per layer
GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path: str, matrix_type: str = "F32") -> None:
    """The tiny folder's weights as a `gemma3` GGUF file (matrices in `matrix_type`)."""
    import json
    cfg = json.load(open(os.path.join(TINY, "config.json")))
    w = load_file(os.path.join(TINY, "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch="gemma3")
    writer.add_block_count(cfg["num_hidden_layers"]), writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"]), writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"]), writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"]), writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"]), writer.add_rope_freq_base(1000000.0)
    writer.add_sliding_window(cfg["sliding_window"])
    for name, a in w.items():
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            gname = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight"
        if name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's (1 + w)
            writer.add_tensor(gname, (a + 1).astype(np.float32))
        elif matrix_type == "F32" or a.shape[1] % 32:
            writer.add_tensor(gname, a.astype(np.float32))
        else:
            t = gguf.GGMLQuantizationType[matrix_type]
            writer.add_tensor(gname, gguf.quants.quantize(a.astype(np.float32), t), raw_dtype=t)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(os.path.join(TINY, "golden.npz")))


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3") / "tiny.gguf")
    write_gguf(path)
    return path


@pytest.fixture(scope="module", params=["folder", "gguf"])
def gemma(request, tiny_file):
    return tl.Model.from_pretrained(TINY if request.param == "folder" else tiny_file, kv_mode="fp32", dtype="float32")


def test_config_maps_gemma3(gemma):
    c = gemma.weights.config
    assert (c.block, c.n_pre_blocks, c.loop_blocks, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 5, 1, 4, 1, 32)
    assert c.layer_windows == (8, 8, 8, 8, 8, 0) and (c.rope_theta, c.rope_local_theta) == (1e6, 1e4)
    assert c.qk_norm and c.mlp_act == "gelu_tanh" and c.norm_placement == "sandwich" and c.tie_embeddings
    assert c.embed_scale == 8.0  # sqrt(64)
    blocks = (*gemma.weights.params.pre, *gemma.weights.params.loop)
    assert [b.window for b in blocks] == [8] * 5 + [0] and [b.rope_theta for b in blocks] == [1e4] * 5 + [0.0]


@pytest.mark.parametrize("n", [5, 17, 40])
def test_logits_at_every_position_match_transformers(gemma, golden, n):
    w = gemma.weights
    got = forward_seq(w.params, w.config, jnp.asarray(golden[f"prompt_{n}"]), loops=1)
    np.testing.assert_allclose(np.asarray(got), golden[f"logits_{n}"], **PARITY)


def test_live_parity_with_transformers(golden):
    """Against transformers' Gemma3ForCausalLM itself where the `hf` extra is installed (its
    Gemma 3 needs transformers >= 5)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 3 text model of this layout (needs 5.x)")
    model = transformers.Gemma3ForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    ours = tl.Model.from_pretrained(TINY, kv_mode="fp32", dtype="float32")
    p = golden["prompt_40"]
    with torch.no_grad():
        want = model(torch.tensor([p.tolist()]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(ours.next_token_logits(p)), want[-1], **PARITY)


def test_cached_path_matches_transformers(gemma, golden):
    """One token at a time through the cache, past the window (8) five times over."""
    w, p, want = gemma.weights, golden["prompt_40"], golden["logits_40"]
    cache = F.empty_cache(w, len(p))
    for t, tok in enumerate(p):
        logits, cache = F.decode_step(w, int(tok), cache)
        np.testing.assert_allclose(np.asarray(logits), want[t], **PARITY)


@pytest.mark.parametrize("n", [6, 21])
def test_greedy_matches_transformers(gemma, golden, n):
    assert gemma.generate(golden[f"gen_prompt_{n}"], max_tokens=12) == golden[f"gen_{n}"].tolist()


@pytest.mark.parametrize("kv_mode", ["fp32", "fp16-h"])
def test_prefix_reuse_equals_recompute_across_the_window(kv_mode, golden):
    """A 20-token prefix (the local layers' window is 8) read by a suffix equals recomputing the
    whole prompt, in a K/V mode and an h mode (K rebuilt through k_norm and the block's RoPE
    base); the suffix's positions reset to 0 must not. (Every KV mode under a cache_window,
    whose masks a layer's own window shares: tests/test_kv_modes.py.)"""
    m = tl.Model.from_pretrained(TINY, kv_mode=kv_mode, dtype="float32")
    w, p = m.weights, golden["prompt_40"]
    prefix, suffix = p[:20], p[20:27]
    full = m.next_token_logits(p[:27])
    saved = F.save_prefix_cache(prefix, w)
    np.testing.assert_allclose(F.generate_with_prefix(saved, 20, suffix, w), full, atol=1e-3, rtol=1e-2)
    assert not np.allclose(F.generate_with_prefix(saved, 0, suffix, w), full, atol=1e-3, rtol=1e-2)
    cache = m.build_prefix_cache(prefix)
    assert m.generate_from_prefix_cache(cache, suffix=suffix, max_tokens=10) == m.generate(p[:27], max_tokens=10)


def test_engine_equals_generate(golden):
    """The paged engine (every layer's window on its pages; the native kernel where it runs):
    requests in flight together, one past a window, one with a cache_window of its own."""
    m = tl.Model.from_pretrained(TINY, kv_mode="fp16", dtype="float32")
    work = [(golden["prompt_40"][:30], {}), (golden["prompt_17"], {}), (golden["prompt_5"], {"cache_window": 4})]
    with tl.Engine(m, max_batch=4, prefill_chunk=16) as eng:
        handles = [eng.submit(p, max_tokens=12, **kw) for p, kw in work]
        got = [h.result() for h in handles]
    for (p, kw), tokens in zip(work, got):
        assert tokens == m.generate(p, max_tokens=12, **kw), kw


def test_local_layers_hold_only_their_window(golden, tmp_path):
    """Past a window, each local layer's cache is a ring of its window (8 positions: 16 slots)
    and the global layer holds every position: in a prefix (its bytes), read by suffixes (==
    recompute, == transformers' logits), continued by a PrefixStore only where the ring still
    holds the matched part's window, saved and loaded, and served by the engine from the store."""
    m = tl.Model.from_pretrained(TINY, kv_mode="fp32", dtype="float32")
    p, want = golden["prompt_40"], golden["logits_40"]
    prefix = m.build_prefix_cache(p[:36])
    c = prefix.cache
    assert (c.rings, c.capacity, c.ring_capacity) == ((0, 1, 2, 3, 4), 64, 16)
    assert [e["k"].shape[-2] for e in c.pre] == [16] * 5 and c.loop["k"].shape[-2] == 64
    assert sorted(np.asarray(c.ring_pos).tolist()) == list(range(20, 36))
    whole = kvc.cache_nbytes("fp32", 6, 1, 64, 32)
    assert prefix.nbytes == kvc.cache_nbytes("fp32", 6, 1, 64, 32, rings=5, ring_capacity=16) < 0.45 * whole
    np.testing.assert_allclose(m.next_token_logits_from_prefix(prefix, p[36:40]), want[39], **PARITY)
    assert m.generate_from_prefix_cache(prefix, suffix=p[36:], max_tokens=8) == m.generate(p, max_tokens=8)

    store = tl.PrefixStore(m, loops=1)
    store.prefix_for(p[:36])
    tail = (p[:6] + 1) % 96
    near, far = np.concatenate([p[:30], tail]), np.concatenate([p[:12], tail])
    assert store.generate(near, max_tokens=6) == m.generate(near, max_tokens=6)
    assert store.stats()["tokens_reused"] == 30  # the ring holds positions 20..35: 22..29 are in it
    assert store.generate(far, max_tokens=6) == m.generate(far, max_tokens=6)
    assert store.stats()["tokens_reused"] == 30  # 4..11 are not: prefilled whole
    with pytest.raises(ValueError, match="k=12"):
        F.extend_prefix(prefix, 12, far)

    prefix.save(str(tmp_path / "p"))
    back = tl.PrefixCache.load(str(tmp_path / "p"), m)
    assert back.cache.rings == c.rings and tree_equal(back.cache, c)
    with tl.Engine(m, max_batch=2, prefill_chunk=16, store=store) as eng:  # ring entries loaded into its pages
        handles = [eng.submit(q, max_tokens=6) for q in (near, p[:38])]
        got = [h.result() for h in handles]
        loads = eng.stats()["prefix_pool_loads"]
    assert got == [m.generate(near, max_tokens=6), m.generate(p[:38], max_tokens=6)] and loads >= 1
    assert handles[0].prefix_tokens == 32  # two pages loaded, the window's with their local K/V


@pytest.mark.parametrize("chunk", [5, 16])
def test_a_long_prompt_is_prefilled_in_chunks(golden, monkeypatch, chunk):
    """A prefix longer than `PREFILL_CHUNK` is prefilled a chunk at a time (local layers reading
    their ring beside each chunk): transformers' logits, and a store's extension (itself in
    chunks) equals building it whole."""
    monkeypatch.setattr(paged_decode, "PREFILL_CHUNK", chunk)
    m = tl.Model.from_pretrained(TINY, kv_mode="fp32", dtype="float32")
    p, want = golden["prompt_40"], golden["logits_40"]
    prefix = m.build_prefix_cache(p[:37])
    assert prefix.cache.rings
    np.testing.assert_allclose(np.asarray(prefix.logits), want[36], **PARITY)
    np.testing.assert_allclose(m.next_token_logits_from_prefix(prefix, p[37:]), want[39], **PARITY)
    longer = F.extend_prefix(prefix, 30, p)
    np.testing.assert_allclose(np.asarray(longer.logits), want[39], **PARITY)
    assert m.generate_from_prefix_cache(longer, max_tokens=6) == m.generate(p, max_tokens=6)


@pytest.mark.parametrize("window,chunk", [(8, 8), (40, 8)])
def test_generate_keeps_local_layers_in_rings(golden, monkeypatch, window, chunk):
    """`generate`'s per-call pool keeps the local layers in rings of slots (the window and one
    step: a prompt chunk of `PREFILL_CHUNK`, 8 here to cut the prompts in pieces): long answers,
    from a prefix and for a batch of suffixes of several lengths, equal every layer on pages —
    the tiny Gemma (window 8, within a page) and a random one whose window spans pages (40)."""
    monkeypatch.setattr(paged_decode, "PREFILL_CHUNK", chunk)
    if window == 8:
        m, p = tl.Model.from_pretrained(TINY, kv_mode="fp32", dtype="float32"), golden["prompt_40"]
    else:
        cfg = dict(LOOPED, n_pre_blocks=3, loop_blocks=1, default_loops=2, layer_windows=(40, 0, 40, 0), kv_mode="fp32")
        m, p = tl.Model.random(tl.ModelConfig(**cfg), seed=4), np.random.default_rng(2).integers(0, 96, 40)
    lay = F.call_layout(m.weights.config, 0, 40, 200, 1)
    assert lay.slot_of is not None and lay.n_local <= lay.n_pages / 2
    lay = F.call_layout(m.weights.config, 160, 4, 8, 2)  # a long prefix: slots for its last window only
    first = (160 - window + 1) // 16
    assert (lay.slot_of[:first] == -1).all() and (lay.slot_of[first:lay.shared] >= 0).all()
    prefix = m.build_prefix_cache(p[:20])
    suffixes = [p[20:23], p[20:40], p[25:26]]

    def run():
        return (m.generate(p, max_tokens=200), m.generate_from_prefix_cache(prefix, suffix=p[20:30], max_tokens=80),
                m.generate_batch_from_prefix_cache(prefix, suffixes, max_tokens=40))
    rings = run()
    monkeypatch.setenv("TINYLOOP_LAYER_RINGS", "0")
    assert F.call_layout(m.weights.config, 0, 40, 200, 1).slot_of is None
    assert rings == run()


def test_engine_keeps_local_layers_to_their_window(golden, monkeypatch):
    """The engine keeps the local layers' K/V in local slots that follow each row's window
    (here slots for little more than two rows' windows; by default half the pages'): a long
    answer, another that takes back the first one's idle slots, a chat's next turn (its last
    window still held) and a prompt sharing the first one's start (whose window lost its slots:
    recomputed) equal `generate`."""
    from tinyloop_jax.serving.budget import Budget
    monkeypatch.setattr(Budget, "local_slots", lambda self, n: min(n, self.max_batch * self.credits(n) + 2))
    m = tl.Model.from_pretrained(TINY, kv_mode="fp16", dtype="float32")
    p = golden["prompt_40"]
    with tl.Engine(m, max_batch=2, prefill_chunk=16) as eng:
        run = lambda q, n: (q, n, eng.submit(q, max_tokens=n).result())  # noqa: E731
        done = [run(p[:30], 60), run((p[5:25] + 7) % 96, 100)]
        done += [run(np.concatenate([done[0][2], p[30:36]]), 24), run(np.concatenate([p[:34], p[:6]]), 8)]
        pages = eng.stats()["pages"][1]
    for q, n, tokens in done:
        assert tokens == m.generate(q, max_tokens=n)
    assert pages["local_slots"] < pages["total"] and pages["local_reclaimed"] > 0, pages


LOOPED = dict(block="llama", vocab_size=96, d_model=64, n_heads=4, n_kv_heads=1, head_dim=32, intermediate_size=96,
              n_pre_blocks=1, loop_blocks=2, default_loops=3, max_seq_len=256, norm_placement="sandwich", qk_norm=True,
              mlp_act="gelu_tanh", embed_scale=8.0, layer_windows=(6, 0, 6), rope_theta=1e6, rope_local_theta=1e4)


def test_a_looped_gemma_works_like_the_other_families():
    """A loop stack of Gemma blocks (a windowed block, a global one, looped 3 times): the cached
    path equals the uncached forward past the window, a prefix read by a suffix equals
    recomputing, a shallower depth from a deeper prefix, and the engine equals generate."""
    m = tl.Model.random(tl.ModelConfig(**LOOPED, kv_mode="fp32"), seed=3)
    w, p = m.weights, np.random.default_rng(5).integers(0, 96, 20).astype(np.int32)
    full = np.asarray(forward_seq(w.params, w.config, jnp.asarray(p), loops=3))
    cache = F.empty_cache(w, len(p))
    for t, tok in enumerate(p):
        logits, cache = F.decode_step(w, int(tok), cache)
        np.testing.assert_allclose(np.asarray(logits), full[t], atol=1e-4, rtol=0)
    prefix = m.build_prefix_cache(p[:14], loops=3)
    assert m.generate_from_prefix_cache(prefix, suffix=p[14:], max_tokens=8) == m.generate(p, max_tokens=8, loops=3)
    shallow = np.asarray(forward_seq(w.params, w.config, jnp.asarray(p[:14]), loops=2))
    np.testing.assert_allclose(np.asarray(prefix.at_depth(2).logits), shallow[-1], atol=1e-4, rtol=0)
    with tl.Engine(m, max_batch=2, prefill_chunk=16) as eng:
        got = [h.result() for h in [eng.submit(p, max_tokens=8), eng.submit(p[:9], max_tokens=8, loops=2)]]
    assert got == [m.generate(p, max_tokens=8), m.generate(p[:9], max_tokens=8, loops=2)]


def test_local_slots_under_speculation_and_exits(monkeypatch):
    """A looped Gemma's local layer (its pre block, window 6) in scarce local slots: speculative
    rounds (written ahead, rolled back) and adaptive exits beside a plain row, past the window
    many times over, equal `generate`."""
    from tinyloop_jax.serving.budget import Budget
    monkeypatch.setattr(Budget, "local_slots", lambda self, n: min(n, self.max_batch * self.credits(n, 3) + 2))
    m = tl.Model.random(tl.ModelConfig(**LOOPED, kv_mode="fp32"), seed=3)
    rng = np.random.default_rng(6)
    work = [(rng.integers(0, 96, 21), dict(max_tokens=80, draft_loops=1, lookahead=3)),
            (rng.integers(0, 96, 9), dict(max_tokens=80, exit_criterion="kl", exit_threshold=1e-3)),
            (rng.integers(0, 96, 30), dict(max_tokens=80))]
    with tl.Engine(m, max_batch=3, prefill_chunk=16) as eng:
        got = [h.result() for h in [eng.submit(q, **kw) for q, kw in work]]
        pages = eng.stats()["pages"][3]
    for (q, kw), tokens in zip(work, got):
        assert tokens == m.generate(q, **kw), kw
    assert pages["local_slots"] < pages["total"] and pages["local_reclaimed"] > 0, pages
    monkeypatch.setenv("TINYLOOP_LAYER_RINGS", "0")  # `generate`'s rings under verify chunks too
    assert got[0] == m.generate(work[0][0], **work[0][1])


def test_packed_gguf_equals_its_dequantized_load(tmp_path):
    """Q8_0 / Q5_0 matrices (Gemma's 640-wide ones are Q5_0 in its Q4_K_M file) kept packed."""
    path = str(tmp_path / "q.gguf")
    write_gguf(path, "Q5_0")
    packed = tl.Model.from_pretrained(path, kv_mode="fp32", dtype="float32")
    floats = tl.Model.from_pretrained(path, kv_mode="fp32", dtype="float32", quantize_weights="float")
    assert qarray.is_quant(packed.weights.params.pre[0].w_o) and packed.nbytes < floats.nbytes / 3
    p = np.arange(30) % 96
    a, b = np.asarray(packed.next_token_logits(p)), np.asarray(floats.next_token_logits(p))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_unsupported_gemma3_settings_are_named(tmp_path):
    import json
    import shutil
    for key, value in (("final_logit_softcapping", 30.0), ("query_pre_attn_scalar", 64),
                       ("hidden_activation", "relu")):
        folder = tmp_path / key
        shutil.copytree(TINY, folder)
        cfg = json.load(open(folder / "config.json"))
        json.dump({**cfg, key: value}, open(folder / "config.json", "w"))
        with pytest.raises(ValueError, match=key):
            tl.Model.from_pretrained(str(folder))


# ---- the real Gemma 3 270M Q4_K_M ----------------------------------------------------------------

REAL = os.path.join(DATA, "gemma3-270m-golden.npz")


@pytest.fixture(scope="module")
def gemma270m():
    """(model kept packed, fp32 KV; tokenizer; the file's path): fetched once per machine."""
    path = tl.model_path("gemma3-270m")
    return tl.Model.from_pretrained(path, kv_mode="fp32"), tl.load_tokenizer(path), path


@pytest.mark.slow
def test_gemma3_270m_tokenizer_ids_equal_transformers(gemma270m):
    _, tok, _ = gemma270m
    g = np.load(REAL)
    for i, s in enumerate(g["strings"]):
        assert tok.encode(str(s)).tolist() == g[f"ids_{i}"].tolist(), str(s)
    assert tok.decode(g["ids_0"].tolist()) == "The capital of France is"


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma270m):
    """Logits within 1e-3 at every position (at the 64 largest and 960 fixed entries of each
    row), the greedy continuation token for token, and the weights held at about the file's
    tensor bytes."""
    model, tok, path = gemma270m
    g = np.load(REAL)
    w = model.weights
    # one program for the three prompts (6, 11, 11 tokens): each padded to 11 at its end, which
    # no earlier position attends to
    for i in range(3):
        p = g[f"prompt_{i}"]
        got = np.asarray(forward_seq(w.params, w.config, jnp.asarray(np.pad(p, (0, 11 - len(p)))), loops=1))[:len(p)]
        np.testing.assert_allclose(np.take_along_axis(got, g[f"index_{i}"], axis=1), g[f"logits_{i}"],
                                   atol=1e-3, rtol=0)
    out = model.generate(g["greedy_prompt"], max_tokens=16)
    assert out == g["greedy"].tolist()
    assert tok.decode(out[len(g["greedy_prompt"]):]).startswith(" the capital of the country of France.")
    from tinyloop_jax.formats import gguf_reader
    reader = gguf_reader.GGUFFile(path)
    tensor_bytes = sum(reader.nbytes(i) for i in reader.tensors.values())
    assert model.nbytes <= 1.1 * tensor_bytes and os.path.getsize(path) == hub.MODELS["gemma3-270m"].size
