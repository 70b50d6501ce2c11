"""Held-out bits-per-byte: the quality number for loops, kv_mode and cache_window."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..model import transformer as tf
from ..model.config import ModelConfig
from ..model.params import Params


@partial(jax.jit, static_argnames=("cfg", "loops", "window"))
def _nll_bits(params: Params, cfg: ModelConfig, seqs: jax.Array, loops: int, window: int,
              n_valid: jax.Array | None = None) -> jax.Array:
    """seqs [B, T] -> per-sequence next-token negative log-likelihood [B], in bits, summed over
    positions 1..n_valid-1 (n_valid [B]: each row's real tokens; None: all T)."""
    logits = jax.vmap(lambda s: tf.forward_seq(params, cfg, s, loops, window))(seqs)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, seqs[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    if n_valid is not None:
        nll = jnp.where(jnp.arange(1, seqs.shape[1])[None, :] < n_valid[:, None], nll, 0.0)
    return jnp.sum(nll, axis=1) / jnp.log(2.0)


def bits_per_byte(params: Params, cfg: ModelConfig, data: np.ndarray, loops: int, window: int = 0,
                  seq_len: int | None = None, batch: int = 8, max_bytes: int | None = None,
                  progress=None) -> float:
    """Mean bits per predicted byte over non-overlapping windows of `seq_len` bytes of `data`
    (the first byte of each window is context only)."""
    T = seq_len or cfg.max_seq_len
    cfg.check_positions(T, f"seq_len={T}")
    data = np.asarray(data[:max_bytes] if max_bytes else data, np.int32)
    n = len(data) // T
    if n == 0:
        raise ValueError(f"need at least {T} bytes of data, got {len(data)}")
    seqs = data[: n * T].reshape(n, T)
    total = 0.0
    for i in range(0, n, batch):
        chunk = seqs[i:i + batch]
        real = len(chunk)
        if real < batch:  # pad the last batch (one compiled shape), count only the real rows
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, 0)])
        total += float(np.asarray(_nll_bits(params, cfg, jnp.asarray(chunk), loops, window))[:real].sum())
        if progress:
            progress(min(i + batch, n), n)
    return total / (n * (T - 1))


def bits_per_byte_of_text(params: Params, cfg: ModelConfig, ids, n_bytes: int, first: int, loops: int,
                          window: int = 0, seq_len: int = 1024, progress=None) -> float:
    """Bits per UTF-8 byte of a text of `n_bytes` bytes that a tokenizer made `ids` [n] of: every
    token predicted once, the first after the id `first` (a BOS or end-of-text token), in windows
    of `seq_len` tokens that each begin with the previous window's last token (as
    lm-evaluation-harness's rolling log-likelihood does). For models whose tokens are not bytes."""
    seq = np.concatenate([[first], np.asarray(ids, np.int64)]).astype(np.int32)
    if len(seq) < 2 or n_bytes < 1:
        raise ValueError(f"need a non-empty text, got {len(seq) - 1} tokens and {n_bytes} bytes")
    T = min(seq_len, cfg.max_seq_len, len(seq))
    if T < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    starts = range(0, len(seq) - 1, T - 1)
    total = 0.0
    for k, s in enumerate(starts):
        row = seq[s:s + T]
        n = len(row)  # the last window may be short: padded to one compiled shape, its padding not counted
        padded = np.pad(row, (0, T - n))[None]
        total += float(_nll_bits(params, cfg, jnp.asarray(padded), loops, window, jnp.asarray([n], jnp.int32))[0])
        if progress:
            progress(k + 1, len(starts))
    return total / n_bytes
