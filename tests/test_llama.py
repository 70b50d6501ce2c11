"""Llama-family import (`Model.from_pretrained`): parity with `transformers`' LlamaForCausalLM
(golden files from scripts/make_llama_golden.py, and live when transformers is installed),
sharded folders, the GPT-2 dispatch, and every unsupported config value or bad tensor as a
ValueError naming it."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from conftest import forward_seq

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "llama-tiny")
GPT2 = os.path.join(os.path.dirname(__file__), "data", "gpt2-tiny")
OURO = os.path.join(os.path.dirname(__file__), "data", "ouro-tiny")
PARITY = dict(atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def llama():
    return tl.Model.from_pretrained(GOLDEN, kv_mode="fp32")


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(os.path.join(GOLDEN, "golden.npz")))


def test_config_maps_to_a_plain_stack(llama):
    c = llama.weights.config
    assert (c.block, c.n_pre_blocks, c.loop_blocks, c.default_loops, c.n_heads, c.n_kv_heads) == ("llama", 2, 1, 1,
                                                                                                   4, 2)
    assert c.rope_theta == 500000.0 and not c.tie_embeddings and c.norm_placement == "pre" and not c.pass_norm


@pytest.mark.parametrize("n", [1, 9, 40])
def test_logits_at_every_position_match_transformers(llama, golden, n):
    w = llama.weights
    got = forward_seq(w.params, w.config, jnp.asarray(golden[f"prompt_{n}"]), loops=1)
    np.testing.assert_allclose(np.asarray(got), golden[f"logits_{n}"], **PARITY)


def test_cached_path_matches_transformers(llama, golden):
    w, p, want = llama.weights, golden["prompt_40"], golden["logits_40"]
    cache = F.empty_cache(w, len(p))
    for t, tok in enumerate(p):
        logits, cache = F.decode_step(w, int(tok), cache)
        np.testing.assert_allclose(np.asarray(logits), want[t], **PARITY)


@pytest.mark.parametrize("n", [6, 21])
def test_greedy_matches_transformers_generate(llama, golden, n):
    assert llama.generate(golden[f"gen_prompt_{n}"], max_tokens=12) == golden[f"gen_{n}"].tolist()


def test_live_parity_with_transformers(llama, golden):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    model = transformers.LlamaForCausalLM.from_pretrained(GOLDEN).eval()
    p = golden["prompt_40"]
    with torch.no_grad():
        want = model(torch.tensor([p.tolist()])).logits[0].numpy()
    np.testing.assert_allclose(llama.next_token_logits(p), want[-1], **PARITY)


def test_sharded_folder_reads_the_same(llama, golden, tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(os.path.join(GOLDEN, "config.json"), d)
    tensors = load_file(os.path.join(GOLDEN, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(d / file))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}))
    again = tl.Model.from_pretrained(str(d), kv_mode="fp32")
    assert again.fingerprint == llama.fingerprint


def test_gpt2_folders_dispatch_to_the_gpt2_import():
    a, b = tl.Model.from_pretrained(GPT2, kv_mode="fp32"), tl.Model.from_hf_gpt2(GPT2, kv_mode="fp32")
    assert a.fingerprint == b.fingerprint


def test_bfloat16_weights_and_compute(golden):
    m = tl.Model.from_pretrained(GOLDEN, kv_mode="fp16", dtype="bfloat16")
    assert m.weights.params.wte.dtype == jnp.bfloat16
    p = golden["prompt_40"]
    got = m.next_token_logits(p)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, golden["logits_40"][-1], atol=0.25)  # bf16 rounding through 3 layers


def edited(tmp_path, src, config=None, tensors=None):
    d = tmp_path / "edited"
    shutil.copytree(src, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(d / "model.safetensors"))
        tensors(t)
        save_file(t, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize("change,msg", [
    (lambda c: c.update(model_type="mistral"), "model_type 'mistral'"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "rope_type"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 3), "layer_types"),
    (lambda c: c.update(num_key_value_heads=3), "n_kv_heads=3"),
    (lambda c: c.pop("hidden_size"), "hidden_size"),
])
def test_unsupported_config_values_are_named(tmp_path, change, msg):
    with pytest.raises(ValueError, match=msg):
        tl.Model.from_pretrained(edited(tmp_path, GOLDEN, config=change))


@pytest.mark.parametrize("change,msg", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
    (lambda t: t.update({"model.norm.weight": np.ones(3, np.float32)}), "model.norm.weight"),
    (lambda t: t.update({"model.layers.0.extra.weight": np.ones(3, np.float32)}), "model.layers.0.extra"),
])
def test_missing_misshaped_or_extra_tensors_are_named(tmp_path, change, msg):
    with pytest.raises(ValueError, match=msg):
        tl.Model.from_pretrained(edited(tmp_path, GOLDEN, tensors=change))


def test_ouro_without_its_gate_is_named(tmp_path):
    with pytest.raises(ValueError, match="model.early_exit_gate.weight"):
        tl.Model.from_pretrained(edited(tmp_path, OURO, tensors=lambda t: t.pop("model.early_exit_gate.weight")))


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        tl.Model.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        tl.Model.from_pretrained(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="dtype='float16'"):
        tl.Model.from_pretrained(GOLDEN, dtype="float16")
