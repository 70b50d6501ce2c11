"""The training script's loop on a tiny config: a few steps, the loss goes down."""

import os
import sys

import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.data import pydoc_split

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import train_tiny  # noqa: E402


def test_holdout_is_a_fixed_five_percent():
    train, val = pydoc_split()
    assert abs(len(val) / (len(train) + len(val)) - 0.05) < 0.005
    again = pydoc_split()
    assert np.array_equal(again[1], val)


@pytest.mark.slow
def test_training_reduces_loss(tmp_path):
    cfg = tl.ModelConfig(vocab_size=260, d_model=32, n_heads=2, n_pre_blocks=1, default_loops=2, max_seq_len=32,
                         kv_mode="fp32")
    params, losses, _ = train_tiny.train(cfg, steps=40, batch=8, max_loops=2, lr=1e-2, seed=0,
                                         log_path=tmp_path / "log.tsv", progress=False)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses  # bits per byte
    assert len(open(tmp_path / "log.tsv").read().splitlines()) == 41
    a = train_tiny.train(cfg, steps=3, batch=8, max_loops=2, lr=1e-2, seed=0, progress=False)[1]
    b = train_tiny.train(cfg, steps=3, batch=8, max_loops=2, lr=1e-2, seed=0, progress=False)[1]
    assert a == b  # seeded data order and init
