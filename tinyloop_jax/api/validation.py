"""Argument checks at the API edge. Each raises with a message naming the bad value."""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from ..decoding.sampling import MAX_LOGIT_BIAS, SamplingParams
from ..decoding.speculative import Speculation

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def same(a, b) -> bool:
    """a equals b, an empty list, tuple, dict or None all alike (stop_sequences=(), logit_bias=None)."""
    def empty(x):
        return x is None or (isinstance(x, (tuple, list, dict)) and not x)
    if empty(a) and empty(b):
        return True
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # an array
        return False


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


def _bounded(value, name: str, parse, ok, rule: str):
    v = parse(value, name)
    if not ok(v):
        raise ValueError(f"{name} must be {rule}, got {v}")
    return v


def loops(value) -> int:
    return _bounded(value, "loops", integer, lambda v: v >= 1, ">= 1")


def cache_window(value) -> int:
    return _bounded(value, "cache_window", integer, lambda v: v >= 0, ">= 0")


def speculation(draft_loops, lookahead, loops_: int) -> Speculation | None:
    """Self-speculative decoding's knobs, checked against the request's depth (None: off)."""
    if draft_loops is None:
        return None
    d, k = loops(draft_loops), integer(lookahead, "lookahead")
    if d > loops_:
        raise ValueError(f"draft_loops={d} must not exceed loops={loops_}")
    if k < 1:
        raise ValueError(f"lookahead must be >= 1, got {k}")
    return Speculation(d, k)


def max_tokens(value) -> int:
    return _bounded(value, "max_tokens", integer, lambda v: 1 <= v < 2**31, "in [1, 2**31)")  # int32 on device


def temperature(value) -> float:
    return _bounded(value, "temperature", _float, lambda v: v >= 0, ">= 0")


def unit_interval(value, name: str) -> float:
    return _bounded(value, name, _float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")


def top_k(value) -> int:  # int32 on device; any k >= the vocabulary keeps every token
    return _bounded(value, "top_k", integer, lambda v: 0 <= v < 2**31, "in [0, 2**31) (0 = off)")


def top_p(value) -> float:
    return _bounded(value, "top_p", _float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")


def repetition_penalty(value) -> float:
    return _bounded(value, "repetition_penalty", _float, lambda v: v > 0, "> 0")


def penalty(value, name: str) -> float:
    """presence_penalty / frequency_penalty: OpenAI's range."""
    return _bounded(value, name, _float, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")


def logit_bias(value, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal strings, as JSON sends them) or (token, bias)
    pairs -> sorted (token, bias) pairs: at most MAX_LOGIT_BIAS, ids in [0, vocab_size), biases
    in [-100, 100]."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {value!r}")
    pairs = list(value.items()) if hasattr(value, "items") else list(value)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out: dict[int, float] = {}
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases; got the entry {pair!r}")
        t, b = pair
        if isinstance(t, str) and t.strip().lstrip("-").isdigit():  # a JSON object's key
            t = int(t)
        t = integer(t, "a logit_bias token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"logit_bias token id {t} is not a token id in [0, {vocab_size})")
        if t in out:
            raise ValueError(f"logit_bias names token id {t} twice")
        out[t] = _bounded(b, f"logit_bias[{t}]", _float, lambda v: -100.0 <= v <= 100.0, "in [-100, 100]")
    return tuple(sorted(out.items()))


def seed(value) -> int:
    return _bounded(value, "seed", integer, lambda v: 0 <= v < 2**32, "in [0, 2**32)")


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


def seed_list(value, n: int) -> list[int]:
    """One seed per request (None: 0 each)."""
    if value is None:
        return [0] * n
    if isinstance(value, (int, np.integer)) or len(value) != n:
        raise ValueError(f"seeds must be a list with one seed per request ({n}), got {value!r}")
    return [seed(s) for s in value]


def sampling_params(vocab_size: int, **fields) -> SamplingParams:
    """One request's sampling arguments as keywords (any `SamplingParams` field; the others at
    their defaults), each checked with a message naming it -> a `SamplingParams`. The one check
    of every generate call and of every served request.

    >>> p = sampling_params(256, max_tokens=16, temperature=0.7, stop_sequences=[[13, 10]])
    >>> p.stop_sequences, p.top_k
    (((13, 10),), 50)
    """
    unknown = sorted(set(fields) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"unknown sampling argument(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_FIELDS)}")
    p = SamplingParams(**fields)
    stops = p.stop_sequences
    if stops is not None and not isinstance(stops, (str, bytes)) and hasattr(stops, "__iter__"):
        stops = list(stops)  # any iterable of sequences (a tuple, a generator, a 2-D array)
    return SamplingParams(max_tokens=max_tokens(p.max_tokens), temperature=temperature(p.temperature),
                          top_k=top_k(p.top_k), top_p=top_p(p.top_p),
                          repetition_penalty=repetition_penalty(p.repetition_penalty), seed=seed(p.seed),
                          stop_sequences=tuple(tuple(s) for s in stop_sequences(stops, vocab_size)),
                          presence_penalty=penalty(p.presence_penalty, "presence_penalty"),
                          frequency_penalty=penalty(p.frequency_penalty, "frequency_penalty"),
                          logit_bias=logit_bias(p.logit_bias, vocab_size),
                          response_format=response_format(p.response_format, vocab_size))


def response_format(value, vocab_size: int):
    """None, or a `Grammar` built for this vocabulary (OpenAI's dict needs the tokenizer:
    `Grammar.of(response_format, tokenizer, vocab_size)`; the server builds it from the body)."""
    from ..decoding.grammar import Grammar

    if value is None or isinstance(value, Grammar):
        return value if value is None else Grammar.of(value, None, vocab_size)
    raise ValueError(f"response_format must be a tinyloop_jax.Grammar (Grammar.of(response_format, tokenizer, "
                     f"vocab_size) builds one from OpenAI's dict), got {type(value).__name__}")


def batch_sampling_params(vocab_size: int, n: int, seeds=None, stop_sequences=(), **fields) -> list[SamplingParams]:
    """N requests' sampling arguments: `seeds` one per request (None: 0 each), `stop_sequences`
    one list for all requests or one list per request (`batch_stop_sequences`), every other
    keyword shared -> one `SamplingParams` per request."""
    if "seed" in fields:
        raise ValueError("a batch takes `seeds` (one per request), not `seed`")
    shared = sampling_params(vocab_size, **fields)
    per_seed, per_stops = seed_list(seeds, n), batch_stop_sequences(stop_sequences, n, vocab_size)
    return [dataclasses.replace(shared, seed=s, stop_sequences=tuple(tuple(x) for x in stops))
            for s, stops in zip(per_seed, per_stops)]


def batch_request(vocab_size: int, n: int, params, fields: dict) -> list[SamplingParams]:
    """N requests' SamplingParams from a batch call's `params` (one SamplingParams for every
    row, or a list of one per row; each checked) or from its keywords (`fields`: the sampling
    keywords with `seeds` for `seed`, `batch_sampling_params`), never both."""
    if params is None:
        return batch_sampling_params(vocab_size, n, **fields)
    rows = [params] * n if isinstance(params, SamplingParams) else params
    if not isinstance(rows, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in rows):
        raise ValueError(f"params must be a SamplingParams or a list of one per request, got {type(params).__name__}")
    if len(rows) != n:
        raise ValueError(f"params has {len(rows)} SamplingParams for {n} requests")
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)} | {"seeds": None}
    given = sorted(k for k, v in fields.items() if not same(v, defaults[k]))
    if given:
        raise ValueError(f"pass {', '.join(given)} inside the SamplingParams or as keywords, not both")
    return [sampling_params(vocab_size, **dataclasses.asdict(p)) for p in rows]

