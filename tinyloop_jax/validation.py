"""Argument checks at the API edge. Each raises with a message naming the bad value."""

from __future__ import annotations

import numbers

import numpy as np

from .sampling import Request


def tokens(ids, vocab_size: int, name: str = "prompt", allow_empty: bool = False) -> np.ndarray:
    """1-D integer token ids in [0, vocab_size) -> a fresh np.ndarray[int32] (a copy)."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be token ids, got a {type(ids).__name__}; encode text first")
    arr = np.array(ids, copy=True)
    if arr.size == 0 and arr.ndim <= 1:
        if allow_empty:
            return np.zeros((0,), np.int32)
        raise ValueError(f"{name} is empty; it needs at least one token id")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D token ids, got shape {arr.shape}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {int(arr[i])} is not a token id in [0, {vocab_size})")
    return arr.astype(np.int32)


def integer(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def loops(value) -> int:
    v = integer(value, "loops")
    if v < 1:
        raise ValueError(f"loops must be >= 1, got {v}")
    return v


def cache_window(value) -> int:
    v = integer(value, "cache_window")
    if v < 0:
        raise ValueError(f"cache_window must be >= 0, got {v}")
    return v


def max_tokens(value) -> int:
    v = integer(value, "max_tokens")
    if v < 1:
        raise ValueError(f"max_tokens must be >= 1, got {v}")
    return v


def sampling(temperature, top_k, top_p, repetition_penalty, seed) -> tuple:
    t = _float(temperature, "temperature")
    if t < 0:
        raise ValueError(f"temperature must be >= 0, got {t}")
    k = integer(top_k, "top_k")
    if k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {k}")
    p = _float(top_p, "top_p")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    r = _float(repetition_penalty, "repetition_penalty")
    if r <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {r}")
    s = integer(seed, "seed")
    if not 0 <= s < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {s}")
    return t, k, p, r, s


def stop_sequences(value, vocab_size: int) -> list[list[int]]:
    """A list of non-empty token-id lists."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_sequences must be a list of token-id lists, got {value!r}")
    out = []
    for i, seq in enumerate(value):
        if isinstance(seq, (str, bytes, numbers.Number)) or not hasattr(seq, "__len__"):
            raise ValueError(f"stop_sequences[{i}] must be a list of token ids, got {seq!r}")
        if len(seq) == 0:
            raise ValueError(f"stop_sequences[{i}] is empty")
        out.append(tokens(seq, vocab_size, name=f"stop_sequences[{i}]").tolist())
    return out


def token_lists(value, vocab_size: int, name: str, allow_empty: bool) -> list[np.ndarray]:
    """A non-empty list of token-id sequences (one per request)."""
    if isinstance(value, (str, bytes, np.ndarray)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list with one token-id sequence per request, got {type(value).__name__}")
    if len(value) == 0:
        raise ValueError(f"{name} is empty; give at least one request")
    return [tokens(x, vocab_size, name=f"{name}[{i}]", allow_empty=allow_empty) for i, x in enumerate(value)]


def batch_stop_sequences(value, n: int, vocab_size: int) -> list[list[list[int]]]:
    """Stop sequences for N requests: one list shared by all (`[[1, 2], [3]]`), or one list per
    request (`[[[1, 2]], [], [[3]]]`: N items, each a list of token-id lists)."""
    if value is None:
        return [[] for _ in range(n)]
    value = list(value)
    nested = lambda x: isinstance(x, (list, tuple)) and not any(isinstance(e, numbers.Number) for e in x)  # noqa: E731
    if len(value) == n and all(nested(x) for x in value):
        return [stop_sequences(list(x), vocab_size) for x in value]
    shared = stop_sequences(value, vocab_size)
    return [shared for _ in range(n)]


def seeds(value, n: int) -> list[int]:
    if value is None:
        return [0] * n
    if isinstance(value, (int, np.integer)) or len(value) != n:
        raise ValueError(f"seeds must be a list with one seed per request ({n}), got {value!r}")
    return [sampling(0.0, 0, 1.0, 1.0, s)[4] for s in value]


def request(n: int, vocab_size: int, knobs: dict, batch: bool) -> Request:
    """The one argument check of every generate call: N requests' knobs (max_tokens,
    temperature, top_k, top_p, repetition_penalty, stop_sequences, and seed or seeds) as a
    `Request`. A single call (batch=False) gives stop_sequences as a list of token-id lists and
    one `seed`; a batched call one stop list for all or one per request, and `seeds`."""
    new = max_tokens(knobs["max_tokens"])
    t, k, p, r, _ = sampling(knobs["temperature"], knobs["top_k"], knobs["top_p"], knobs["repetition_penalty"], 0)
    if batch:
        stops = batch_stop_sequences(knobs["stop_sequences"], n, vocab_size)
        seed_list = seeds(knobs["seeds"], n)
    else:
        stops = [stop_sequences(list(knobs["stop_sequences"]), vocab_size)]
        seed_list = [sampling(0.0, 0, 1.0, 1.0, knobs["seed"])[4]]
    return Request.make(n, t, k, p, r, seed_list, new, stops)
