"""The pure-function layer under `Model`: prefill a chunk into a cache, decode one step.

The seed-000 pair is a few lines on top of it:

    >>> saved = save_prefix_cache(prefix_ids, model.weights)          # a KVCache, length P
    >>> logits = generate_with_prefix(saved, len(prefix_ids), suffix_ids, model.weights)

`saved` is never written: the suffix goes into a fresh segment of its own that attends to
`saved` read-only, so no clone is needed and the saved cache keeps its length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as kvc
from . import engine
from .cache import KVCache
from .params import Weights


def empty_cache(weights: Weights, n_tokens: int, loops: int | None = None, cache_window: int = 0,
                start: int = 0, kv_mode: str | None = None, batch: int | None = None) -> KVCache:
    """A fresh segment with room for `n_tokens` positions, starting at position `start`, stored
    in `kv_mode` (default the model's; another mode makes a working segment whose values are
    those of the model's mode, see `model.block`)."""
    c = weights.config
    loops = c.default_loops if loops is None else loops
    capacity = kvc.segment_capacity(n_tokens, cache_window)
    own = kvc.empty(kv_mode or c.kv_mode, c.n_cache_layers(loops), c.n_heads, capacity, c.head_dim, batch)
    return own.replace(length=jnp.full(own.length.shape, start, jnp.int32))


def prefill(weights: Weights, tokens, cache: KVCache, ro: tuple = (), start_pos: int | None = None,
            loops: int | None = None, cache_window: int = 0) -> tuple[jax.Array, KVCache]:
    """Append `tokens` [T] to `cache` at positions start_pos + i (default cache.length),
    attending also to the read-only segments `ro`. Returns (next-token logits [V], new cache).
    `cache` is donated: do not use it afterwards."""
    c = weights.config
    loops = c.default_loops if loops is None else loops
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    padded = np.zeros((kvc.bucket(n),), np.int32)
    padded[:n] = tokens
    start = cache.length if start_pos is None else jnp.int32(start_pos)
    return engine.prefill(weights.params, c, jnp.asarray(padded), jnp.int32(n), start, tuple(ro), cache,
                          loops=loops, window=cache_window)


def decode_step(weights: Weights, token: int, cache: KVCache, ro: tuple = (), loops: int | None = None,
                cache_window: int = 0) -> tuple[jax.Array, KVCache]:
    """One token at position cache.length. Returns (next-token logits [V], new cache)."""
    return prefill(weights, [token], cache, ro, loops=loops, cache_window=cache_window)


def save_prefix_cache(prefix_ids, weights: Weights) -> KVCache:
    """Prefill `prefix_ids` into a fresh cache (default depth, full window) and return it."""
    prefix_ids = np.asarray(prefix_ids, np.int32)
    cache = empty_cache(weights, len(prefix_ids))
    _, cache = prefill(weights, prefix_ids, cache)
    return cache


def generate_with_prefix(saved: KVCache, prefix_len: int, suffix_ids, weights: Weights) -> np.ndarray:
    """The last suffix token's next-token logits [V], reusing `saved`; the suffix's i-th token
    gets absolute position prefix_len + i."""
    suffix_ids = np.asarray(suffix_ids, np.int32)
    own = empty_cache(weights, len(suffix_ids), loops=saved.n_layers - weights.config.n_pre_blocks,
                      start=prefix_len)
    logits, _ = prefill(weights, suffix_ids, own, ro=(saved,), start_pos=prefix_len,
                        loops=saved.n_layers - weights.config.n_pre_blocks)
    return np.asarray(logits, np.float32)
