"""Held-out bits-per-byte: the quality number for loops, kv_mode and cache_window."""

from __future__ import annotations

import numpy as np

from . import functional as F
from ..model.config import ModelConfig
from ..model.params import Params, Weights


def _nll_bits(params: Params, cfg: ModelConfig, seqs: np.ndarray, loops: int, window: int,
              n_valid: np.ndarray) -> np.ndarray:
    """Each sequence's next-token negative log-likelihood in bits, summed over positions
    1..n_valid[b]-1 of seqs [B, T] (padded past n_valid [B]), by `functional.score` (the
    log-probabilities `Model.score` gives) at depth `loops` under a cache_window `window`."""
    T = seqs.shape[1]
    lp = np.asarray(F.score(Weights.create(params, cfg), seqs, n_valid, loops, cache_window=window).logprobs,
                    np.float64)
    real = (np.arange(T)[None, :] >= 1) & (np.arange(T)[None, :] < np.asarray(n_valid)[:, None])
    return -(lp * real).sum(axis=1) / np.log(2.0)


def bits_per_byte(params: Params, cfg: ModelConfig, data: np.ndarray, loops: int, window: int = 0,
                  seq_len: int | None = None, batch: int = 8, max_bytes: int | None = None,
                  progress=None) -> float:
    """Mean bits per predicted byte over non-overlapping windows of `seq_len` bytes of `data`
    (the first byte of each window is context only), `batch` windows a program."""
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
        total += float(_nll_bits(params, cfg, chunk, loops, window, np.full((batch,), T))[:real].sum())
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
        total += float(_nll_bits(params, cfg, np.pad(row, (0, T - n))[None], loops, window, np.array([n]))[0])
        if progress:
            progress(k + 1, len(starts))
    return total / n_bytes
