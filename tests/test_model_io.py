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
    from tinyloop_jax.cli import BUNDLED, QUESTIONS, SYSTEM_PROMPT
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
