"""`Model.score`: each token's log-probability (and the top ones) by one forward, checked
against an independent path: the next-token logits of every prefix, from scratch."""

import numpy as np
import pytest

import tinyloop_jax as tl
from conftest import ouro_model, tiny_config, tiny_model


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("family", ["gpt2", "ouro"])
def test_score_equals_log_softmax_of_every_prefix(family):
    model = tiny_model("fp32") if family == "gpt2" else ouro_model("fp32")
    tokens = np.random.default_rng(3).integers(0, 128, 21)
    s = model.score(tokens, top_logprobs=4)
    assert s.logprobs.shape == (21,) and s.top_ids.shape == s.top_logprobs.shape == (21, 4)
    assert s.logprobs[0] == 0 and not s.top_ids[0].any()
    for i in range(1, 21):
        lp = log_softmax(model.next_token_logits(tokens[:i]))
        np.testing.assert_allclose(s.logprobs[i], lp[tokens[i]], atol=1e-4, rtol=0)
        assert s.top_ids[i].tolist() == np.argsort(-lp, kind="stable")[:4].tolist()
        np.testing.assert_allclose(s.top_logprobs[i], np.sort(lp)[::-1][:4], atol=1e-4, rtol=0)
        assert s.top_logprobs[i, 0] >= s.logprobs[i]


def test_score_of_a_long_sequence_spans_position_blocks():
    model = tl.Model.random(tiny_config(kv_mode="fp32", max_seq_len=512), seed=1)
    seq = np.random.default_rng(5).integers(0, 128, 300)  # bucketed to 384 positions: 3 blocks of 128
    for loops in (3, 1):
        s = model.score(seq, loops=loops)
        assert s.top_ids.shape == (300, 0)
        for i in (1, 127, 128, 129, 299):
            lp = log_softmax(model.next_token_logits(seq[:i], loops=loops))
            np.testing.assert_allclose(s.logprobs[i], lp[seq[i]], atol=1e-4, rtol=0)


def test_bad_arguments():
    model = tiny_model("fp32")
    for bad in (-1, 129, 1.5, True):
        with pytest.raises(ValueError, match="top_logprobs"):
            model.score([1, 2, 3], top_logprobs=bad)
    with pytest.raises(ValueError):
        model.score([1, 2, 999])
