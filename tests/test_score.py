"""`Model.score`: each token's log-probability (and the top ones) by one forward, checked
against an independent path: the next-token logits of every prefix, from scratch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyloop_jax as tl
from conftest import forward_seq, huginn_model, ouro_model, prompt_of, tiny_config, tiny_model
from test_gemma3 import LOOPED
from tinyloop_jax.api import functional as F
from tinyloop_jax.decoding import paged_decode


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


def _layout(name: str) -> tuple[tl.Model, int]:
    """(model, cache_window) of a layout scoring must serve."""
    if name == "huginn":  # injection (its initial states drawn from the seed), a coda
        return huginn_model(), 0
    if name == "looped-gemma":  # local layers of their own window, held in slots
        return tl.Model.random(tl.ModelConfig(**LOOPED, kv_mode="fp32"), seed=3), 0
    if name == "kv_share-avg":  # a compact store: a prompt runs every pass on pass slots
        return tl.Model(tiny_model("fp32").weights.params, tiny_config(kv_mode="fp32", kv_share="avg")), 0
    if name == "window":
        return tiny_model("fp32"), 8
    return tiny_model(name), 0


# the paged and the cache-free forward sum in different orders, which Huginn's recurrence
# amplifies to 7.8e-5 here (the others: 3e-6): the suite's bound, its rtol dropped
BOUND = dict(atol=1e-3, rtol=0)


@pytest.mark.parametrize("layout", ["huginn", "looped-gemma", "kv_share-avg", "int8-h", "window"])
def test_scoring_in_chunks_equals_the_cache_free_forward(layout, monkeypatch):
    """Scoring runs the step over pages a chunk at a time (here 16 positions, so 45 tokens are
    three chunks: a position's next token can be the next chunk's first): each position's
    log-probability and top tokens equal the log-softmax of the cache-free forward's logits
    (`transformer.forward_seq`), for an injection model with a seed, local layers, a compact
    kv_share, an h mode and a cache window."""
    monkeypatch.setattr(paged_decode, "PREFILL_CHUNK", 16)
    model, window = _layout(layout)
    w, seed = model.weights, 5
    loops = w.config.default_loops
    seq = prompt_of(45, seed=1, vocab=w.config.vocab_size)
    got = F.score(w, np.stack([seq, np.roll(seq, 3)]), np.int32([45, 30]), loops, top=3, cache_window=window,
                  seed=seed)
    for row, n in ((seq, 45), (np.roll(seq, 3)[:30], 30)):
        b = 0 if n == 45 else 1
        lp = np.asarray(jax.nn.log_softmax(forward_seq(w.params, w.config, jnp.asarray(row), loops, window,
                                                       jnp.uint32(seed)), axis=-1))
        np.testing.assert_allclose(np.asarray(got.logprobs)[b, 1:n], lp[np.arange(n - 1), row[1:]], **BOUND)
        np.testing.assert_allclose(np.asarray(got.top_logprobs)[b, 1:n], -np.sort(-lp, axis=-1)[:n - 1, :3],
                                   **BOUND)
        assert np.asarray(got.logprobs)[b, 0] == 0
