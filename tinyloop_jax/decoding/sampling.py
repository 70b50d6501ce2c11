"""Token selection on device: one request value, one sampling distribution, stop sequences.

A request's knobs travel as one value from the API edge to the device: `SamplingParams` (one
request, on the host; checked at the edge by `validation.sampling_params`) -> `Request` (N
requests' rows as arrays, `Request.from_params`) -> the jitted loops. Every knob is a traced
array with one row per request (never static), so changing them never recompiles and requests
with different knobs share a batch. The order is vLLM's:

    logit bias -> repetition penalty (HF: prompt and output) -> frequency and presence penalties
    (OpenAI: output counts) -> greedy (argmax)  |  temperature -> top-k -> top-p -> sample

The frequency and presence penalties read how often each token was emitted so far (`counts`,
[N, V] int32, kept by the decode loops beside `seen`); a logit bias is a fixed-size list of
(token, bias) pairs per row (`MAX_LOGIT_BIAS`, padded), so every value runs the same program.
A batch with no logit bias carries none (its programs leave the step out: XLA:CPU runs a
scatter as a loop), and a batch of greedy requests is marked `sampled=False` (its programs leave
out the filter and the random draws: a tiny decode program compiles in ~75% of the time); the
serving engine, whose rows come and go, always carries both.

`filtered_logits` is the one definition of the sampling distribution: `sample` draws from it
(Gumbel-max, token for token `jax.random.categorical`'s draw), and speculative decoding's
acceptance rule compares its softmax (`distribution`). Its kept set is that of a stable full
sort of each row, found without one (`cut`): no filter at all for top_k off and top_p 1; else
the row's 64 largest logits (`lax.top_k`), where a top_k <= 64 or a nucleus reached within them
ends; else, for that row alone, its 1,024 largest, then a sort. A draw whose kept set lies in
the 64 hashes their noise alone (`gumbel_at`), not the vocabulary's.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


MAX_LOGIT_BIAS = 300  # (token, bias) pairs per request, as OpenAI allows


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the decode loop (host side, hashable). Built once at the API
    edge (`validation.sampling_params` checks every field against the model) and turned into
    device rows by `Request.from_params`.

    >>> p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, stop_sequences=((13, 10),))
    >>> req = Request.from_params([p, dataclasses.replace(p, seed=4)])   # two rows
    """

    max_tokens: int = 32  # >= 1 tokens emitted at most
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 50  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0  # in [0, 2**32): the request's keys are fold_in(key(seed), step)
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences that end the output
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from every token emitted so far
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per time a token was emitted so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias in [-100, 100]) pairs, at most MAX_LOGIT_BIAS


@struct.dataclass
class StopSpec:
    """Stop sequences per request, left-aligned and padded: tokens [N, S, L] (-1 = padding),
    lengths [N, S] (0 = a padding row, never matches). Power-of-two S and L, so varied stop
    lists share compiled programs."""

    tokens: Annotated[jax.Array, "int32[N, S, L]"]
    lengths: Annotated[jax.Array, "int32[N, S]"]

    @classmethod
    def make(cls, per_request: list[list[list[int]]]) -> "StopSpec":
        n = max([1] + [len(x) for x in per_request])
        lmax = max([1] + [len(s) for x in per_request for s in x])
        S, L = 1 << (n - 1).bit_length(), 1 << (lmax - 1).bit_length()
        toks = np.full((len(per_request), S, L), -1, np.int32)
        lens = np.zeros((len(per_request), S), np.int32)
        for r, stops in enumerate(per_request):
            for i, s in enumerate(stops):
                toks[r, i, :len(s)] = s
                lens[r, i] = len(s)
        return cls(toks, lens)


@struct.dataclass
class Request:
    """What N requests ask of the decode loop, one row each: N `SamplingParams` as arrays. Made
    on the host (numpy) by `Request.from_params`; traced inside the jitted loops."""

    temperature: Annotated[jax.Array, "float32[N]"]  # 0 = greedy
    top_k: Annotated[jax.Array, "int32[N]"]  # 0 = off
    top_p: Annotated[jax.Array, "float32[N]"]  # 1 = off
    repetition_penalty: Annotated[jax.Array, "float32[N]"]  # 1 = off
    seed: Annotated[jax.Array, "uint32[N]"]  # the row's keys are fold_in(key(seed), step)
    max_tokens: Annotated[jax.Array, "int32[N]"]  # >= 1
    stop: StopSpec
    presence_penalty: Annotated[jax.Array, "float32[N]"]  # 0 = off
    frequency_penalty: Annotated[jax.Array, "float32[N]"]  # 0 = off
    bias_ids: Annotated[jax.Array, "int32[N, MAX_LOGIT_BIAS]"] | None  # logit bias tokens, -1 = padding
    bias_values: Annotated[jax.Array, "float32[N, MAX_LOGIT_BIAS]"] | None  # their biases (0 in the padding)
    # static: False when every row is greedy, and the programs compile no sampling at all
    sampled: bool = struct.field(pytree_node=False, default=True)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], stops: bool = True,
                    logit_bias: bool | None = None, sampled: bool | None = None) -> "Request":
        """One row per request, in order. stops=False leaves the stop sequences out (an empty
        spec, the same shape for every batch): for callers that check stops on the host.
        logit_bias: carry the bias rows (None: only if some request has a logit bias); sampled:
        compile the sampling step (None: only if some request has a temperature above 0)."""
        col = lambda name, dt: np.array([getattr(p, name) for p in params], dt)  # noqa: E731
        stop = StopSpec.make([[list(s) for s in p.stop_sequences] if stops else [] for p in params])
        bias_ids = np.full((len(params), MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((len(params), MAX_LOGIT_BIAS), np.float32)
        for r, p in enumerate(params):
            if p.logit_bias:
                ids, values = zip(*p.logit_bias)
                bias_ids[r, :len(ids)], bias_values[r, :len(ids)] = ids, values
        if not (any(p.logit_bias for p in params) if logit_bias is None else logit_bias):
            bias_ids = bias_values = None
        return cls(col("temperature", np.float32), col("top_k", np.int32), col("top_p", np.float32),
                   col("repetition_penalty", np.float32), col("seed", np.uint32), col("max_tokens", np.int32), stop,
                   col("presence_penalty", np.float32), col("frequency_penalty", np.float32), bias_ids, bias_values,
                   any(p.temperature > 0 for p in params) if sampled is None else sampled)

    @classmethod
    def make(cls, n: int, temperature=0.0, top_k=50, top_p=1.0, repetition_penalty=1.0, seeds=None, max_tokens=32,
             stop_sequences=None, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=(),
             carry_bias: bool | None = None, sampled: bool | None = None) -> "Request":
        """N rows from keywords (unchecked; the functional API's shorthand for `from_params`):
        scalars apply to every row; `seeds` and `max_tokens` may be per row; stop_sequences
        is one list of token-id lists per row (None: no stops); logit_bias one {token: bias}
        (or (token, bias) pairs) for every row; carry_bias and sampled: as `from_params`'
        logit_bias and sampled."""
        seeds = np.broadcast_to(np.asarray(0 if seeds is None else seeds), (n,))
        max_tokens = np.broadcast_to(np.asarray(max_tokens), (n,))
        stops = stop_sequences or [[] for _ in range(n)]
        bias = tuple(sorted((int(t), float(b)) for t, b in dict(logit_bias or ()).items()))
        return cls.from_params([SamplingParams(max_tokens=int(max_tokens[i]), temperature=temperature, top_k=top_k,
                                               top_p=top_p, repetition_penalty=repetition_penalty, seed=int(seeds[i]),
                                               stop_sequences=tuple(tuple(s) for s in stops[i]),
                                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                               logit_bias=bias)
                                for i in range(n)], logit_bias=carry_bias, sampled=sampled)

    @property
    def n(self) -> int:
        return int(self.temperature.shape[0])

    def pad(self, k: int) -> "Request":
        """k more rows (copies of the last) that stop after one token: filler for a batch split
        over devices."""
        out = jax.tree.map(lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[-1:], k, 0)]), self)
        return out.replace(max_tokens=np.concatenate([np.asarray(self.max_tokens), np.ones((k,), np.int32)]))

    def keys(self, step: jax.Array) -> jax.Array:
        """[N] PRNG keys for loop step `step` ([] or one per row [N]; the first token is step 0)."""
        steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), self.seed.shape)
        return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(self.seed, steps)


def penalize(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF repetition penalty over the tokens seen so far: logits, seen [N, V], penalty [N]:
    positive logits divided, negative multiplied."""
    p = penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)


def bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits [N, V] + values [N, K] at tokens ids [N, K] (-1: padding, left alone)."""
    ids = jnp.where(ids >= 0, ids, logits.shape[-1])  # out of range: dropped
    return jax.vmap(lambda lg, i, b: lg.at[i].add(b, mode="drop"))(logits, ids, values)


def penalize_counts(logits: jax.Array, counts: jax.Array, frequency: jax.Array, presence: jax.Array) -> jax.Array:
    """OpenAI's penalties over the tokens emitted so far: logits - counts * frequency -
    (counts > 0) * presence; logits, counts [N, V], frequency and presence [N]."""
    return (logits - counts.astype(logits.dtype) * frequency[:, None]
            - (counts > 0).astype(logits.dtype) * presence[:, None])


def adjusted_logits(logits: jax.Array, seen: jax.Array, req: Request, counts: jax.Array | None = None) -> jax.Array:
    """The logits [N, V] a token is chosen from: the logit bias, the repetition penalty over
    `seen` [N, V] (prompt and output), then the frequency and presence penalties over `counts`
    [N, V] (how often each token was emitted so far; None: nothing yet, the first token)."""
    if req.bias_ids is not None:
        logits = bias(logits, req.bias_ids, req.bias_values)
    logits = penalize(logits, seen, req.repetition_penalty)
    if counts is None:
        return logits
    return penalize_counts(logits, counts, req.frequency_penalty, req.presence_penalty)


# Each sampled row first looks at its CANDIDATES largest logits (`lax.top_k`, a partial selection):
# its kept set almost always ends there (a top_k <= 64, or a nucleus whose mass is reached within
# them). A row whose set reaches past them looks at WIDE_CANDIDATES, then sorts its whole row: the
# exact definition, rare (scripts/bench_sampling.py counts how often on a real model).
CANDIDATES = 64
WIDE_CANDIDATES = 1024


@struct.dataclass
class Cut:
    """Where each row's kept set ends, in the order of a stable descending sort (equal logits
    lowest id first): the kept tokens are those above `value`, and those equal to it with ids up
    to `last`. value -inf keeps every token (no filter)."""

    value: Annotated[jax.Array, "float32[N]"]  # the smallest kept (scaled) logit
    last: Annotated[jax.Array, "int32[N]"]  # the highest id kept among the logits equal to it
    path: Annotated[jax.Array, "int32[N]"]  # how it was found: PATHS


PATHS = ("none", "candidates", "wide", "sort")  # no filter; the top 64; the top 1,024; a full sort


def candidates(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest of x [..., V] in the order of a stable descending sort: values [..., k]
    descending, equal values lowest id first, and their ids [..., k] int32.

    `lax.top_k` is a partial selection on XLA:CPU only while nothing slices its outputs: it is
    lowered as a full sort and a slice, and rewritten back into its TopK call only where the
    slice is the sort's one reader (a read of the largest value alone made the whole sort run,
    130x slower at 16 x 49,152). Sorting the k candidates straight away (by value, then id: TopK
    leaves equal values in no set order) makes that small sort its one reader.
    tests/test_sampling.py checks the compiled step holds no sort over the vocabulary."""
    vals, ids = jax.lax.top_k(x, k)
    neg, ids = jax.lax.sort((-vals, ids), dimension=-1, num_keys=2)
    return -neg, ids


def _whole_ties(scaled: jax.Array, vals: jax.Array, value: jax.Array) -> jax.Array:
    """Do the candidates vals [..., K] of scaled [..., V] hold every token equal to the cut
    value [...]? Not always where it is their smallest: TopK picks among equal values at its
    edge in no set order, and the kept ones must be the lowest ids."""
    return ((value > vals[..., -1])
            | (jnp.sum(scaled == value[..., None], -1) == jnp.sum(vals == value[..., None], -1)))


def _k(top_k: jax.Array, V: int) -> jax.Array:
    """top_k [N] -> the number of ranks kept by it: V when it is off (0) or covers the vocabulary."""
    return jnp.where((top_k <= 0) | (top_k >= V), V, top_k)


def _nucleus(s: jax.Array, k: jax.Array, top_p: jax.Array, total: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One row's kept ranks among its largest scaled logits s [K] (descending): the top k, and of
    those the smallest prefix whose softmax mass (over the top k; `total` the normaliser when
    the top k reach past K) reaches top_p (the mass strictly above each kept token is < top_p;
    top_p >= 1 keeps all). The softmax is jax.nn.softmax's: exp(s - max) / sum. -> (kept [K],
    the mass of all K)."""
    rank = jnp.arange(s.shape[0])
    keep = rank < k
    e = jnp.exp(jnp.where(keep, s - s[0], -jnp.inf))
    p = e / jnp.where(k <= s.shape[0], jnp.sum(e), total)
    cum = jnp.cumsum(p)
    return keep & ((top_p >= 1) | (cum - p < top_p) | (rank == 0)), cum[-1]


def _candidate_cut(vals: jax.Array, ids: jax.Array, k: jax.Array, top_p: jax.Array, total: jax.Array, V: int):
    """One row's cut from its K largest scaled logits vals [K] (descending, ties lowest id first:
    `lax.top_k`'s order) and their ids [K] -> (value, last, found: the kept set ends inside
    them). It does when k <= K, or when the top k reach past K (top-k off) and the candidates'
    mass already reaches top_p < 1; a top_k between K and V never does here."""
    keep, mass = _nucleus(vals, k, top_p, total)
    n = jnp.sum(keep)
    found = (k <= vals.shape[0]) | ((k >= V) & (top_p < 1) & (mass >= top_p))
    return vals[n - 1], ids[n - 1], found


def _sorted_cut(scaled: jax.Array, k: jax.Array, top_p: jax.Array):
    """One row's cut by a stable full sort of scaled [V] (equal logits in id order): the
    definition the candidate paths reproduce."""
    order = jnp.argsort(-scaled)
    s = scaled[order]
    keep, _ = _nucleus(s, k, top_p, jnp.float32(1.0))
    n = jnp.sum(keep)
    return s[n - 1], order[n - 1].astype(jnp.int32)


def cut(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> tuple[Cut, jax.Array, jax.Array]:
    """Each row's kept set, found without a full sort where it can be. scaled [N, V] (logits over
    the temperature), top_k [N] (0 = off), top_p [N] (1 = off) -> (Cut, the candidates' values
    and ids [N, K]: every kept token is among them where path is "candidates").

    A row with no filter skips everything; the others take `lax.top_k` of 64; a row whose set
    reaches past them (a flat distribution, or 64 < top_k < V) is found again, in a loop over
    such rows alone, from its top 1,024 or else by a full sort. Batch-level conds, never vmapped
    ones: a vmapped cond runs both branches."""
    N, V = scaled.shape
    K, W = min(CANDIDATES, V), min(WIDE_CANDIDATES, V)
    k, top_p = _k(jnp.asarray(top_k), V), jnp.asarray(top_p)
    none = (k >= V) & (top_p >= 1)
    vals, ids = candidates(scaled, K)
    # the normaliser over every token, for a nucleus without top-k (skipped when no row has one)
    total = jax.lax.cond(jnp.any((k >= V) & (top_p < 1)),
                         lambda: jnp.sum(jnp.exp(scaled - vals[:, :1]), axis=-1), lambda: jnp.ones((N,), scaled.dtype))
    value, last, found = jax.vmap(_candidate_cut, (0, 0, 0, 0, 0, None))(vals, ids, k, top_p, total, V)
    found &= jax.lax.cond(jnp.any(value == vals[:, -1]), lambda: _whole_ties(scaled, vals, value),
                          lambda: jnp.ones((N,), bool))
    path = jnp.where(none, 0, jnp.where(found, 1, 2)).astype(jnp.int32)

    def again(c: Cut) -> Cut:
        def row(i, c: Cut) -> Cut:
            def wide():
                wv, wi = candidates(scaled[i], W)
                v, l, ok = _candidate_cut(wv, wi, k[i], top_p[i], total[i], V)
                ok &= _whole_ties(scaled[i], wv, v)
                return jax.lax.cond(ok, lambda: (v, l, jnp.int32(2)),
                                    lambda: (*_sorted_cut(scaled[i], k[i], top_p[i]), jnp.int32(3)))

            v, l, p = jax.lax.cond(c.path[i] == 2, wide, lambda: (c.value[i], c.last[i], c.path[i]))
            return Cut(c.value.at[i].set(v), c.last.at[i].set(l), c.path.at[i].set(p))

        return jax.lax.fori_loop(0, N, row, c)

    c = Cut(jnp.where(none, -jnp.inf, value), jnp.where(none, V - 1, last), path)
    return jax.lax.cond(jnp.any(path == 2), again, lambda c: c, c), vals, ids


def _kept(x: jax.Array, ids: jax.Array, c: Cut) -> jax.Array:
    """Which of x [N, K'] (scaled logits at token ids [N, K']) the cut keeps."""
    return (x > c.value[:, None]) | ((x == c.value[:, None]) & (ids <= c.last[:, None]))


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [N, V] -> temperature-scaled logits with -inf outside the top-k and the top-p
    nucleus (the smallest set of most likely tokens, equal logits lowest id first, whose
    softmax mass reaches top_p; top_p = 1 keeps every token). temperature, top_k, top_p [N]."""
    scaled = logits / temperature[:, None]
    c, _, _ = cut(scaled, top_k, top_p)
    iota = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    return jnp.where(_kept(scaled, iota, c), scaled, -jnp.inf)


def gumbel_at(key: jax.Array, ids: jax.Array, V: int) -> jax.Array:
    """jax.random.gumbel(key, (V,))[ids], without drawing the other tokens' noise: with
    partitionable threefry (JAX's default) token i's bits hash the counter i alone, so K of
    them cost K hashes, not V. The same float steps as `jax.random.gumbel`'s "low" mode
    (tests/test_sampling.py checks the numbers against it)."""
    if not (jax.config.jax_threefry_partitionable and jax.random.key_impl(key) == jax.random.key_impl(
            jax.random.key(0))):
        return jax.random.gumbel(key, (V,))[ids]
    from jax.extend.random import threefry2x32_p

    k1, k2 = jax.random.key_data(key)
    lo = ids.astype(jnp.uint32)
    b1, b2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(lo), lo)
    mantissa = jax.lax.shift_right_logical(b1 ^ b2, jnp.uint32(9)) | jnp.uint32(0x3F800000)
    tiny = jnp.float32(jnp.finfo(jnp.float32).tiny)
    u = jnp.maximum(tiny, (jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0) * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array) -> jax.Array:
    """A token per row [N] drawn from softmax(filtered_logits(logits [N, V], temperature, top_k,
    top_p)) with keys [N]: `jax.random.categorical(keys[i], filtered[i])` token for token (the
    same Gumbel-max draw). When every row's kept set lies in its 64 candidates, only their
    noise is drawn; otherwise every row draws over V."""
    scaled = logits / temperature[:, None]
    N, V = scaled.shape
    c, vals, ids = cut(scaled, top_k, top_p)

    def small():
        score = jnp.where(_kept(vals, ids, c), vals + jax.vmap(gumbel_at, (0, 0, None))(keys, ids, V), -jnp.inf)
        best = jnp.max(score, axis=-1, keepdims=True)
        return jnp.min(jnp.where(score == best, ids, V), axis=-1)  # the lowest id of equal scores, as argmax

    def full():
        iota = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
        filt = jnp.where(_kept(scaled, iota, c), scaled, -jnp.inf)
        return argmax(jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(keys) + filt)

    return jax.lax.cond(jnp.all(c.path == 1), small, full).astype(jnp.int32)


def argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value; of the first NaN if
    any) -> int32, as two plain reductions: XLA:CPU's argmax (a reduce over (value, index)
    pairs) took 1.2 ms over Gemma's 262,144 logits, a max and then a min of the matching indices
    0.23 ms (docs/benchmarks.md, profile_decode)."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == m) | (jnp.isnan(logits) & jnp.isnan(m))
    return jnp.min(jnp.where(hit, iota, logits.shape[-1]), axis=-1)


def _sampled_knobs(req: Request) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(temperature, top_k, top_p) [N] for the sampling branch: a greedy row (temperature 0) in
    a sampled batch takes temperature 1 and top_k 1, so it costs its neighbours nothing (its
    token is the argmax's)."""
    greedy = req.temperature <= 0
    return (jnp.where(greedy, 1.0, req.temperature), jnp.where(greedy, 1, req.top_k),
            jnp.where(greedy, 1.0, req.top_p))


def _choose(logits: jax.Array, req: Request, greedy, sampled) -> jax.Array:
    """greedy(logits) for rows with temperature 0, sampled(logits, knobs) for the others; when
    every row is greedy the sampling branch is skipped (one cond for the batch), and a request
    marked greedy (`sampled=False`) compiles none."""
    g = greedy(logits)
    if not req.sampled:
        return g

    def mixed():
        s = sampled(logits, *_sampled_knobs(req))
        return jnp.where((req.temperature <= 0).reshape((-1,) + (1,) * (g.ndim - 1)), g, s)

    return jax.lax.cond(jnp.all(req.temperature <= 0), lambda: g, mixed)


def select_tokens(logits: jax.Array, seen: jax.Array, req: Request, step: jax.Array,
                  counts: jax.Array | None = None) -> jax.Array:
    """logits, seen [N, V] -> token ids [N] int32 (row i draws with req.keys(step)[i]; step [] or
    [N], one per row). counts [N, V]: tokens emitted so far (None: none, the first token)."""
    return _choose(adjusted_logits(logits, seen, req, counts), req, argmax,
                   lambda lg, t, k, p: sample(lg, t, k, p, req.keys(step)))


def distribution(logits: jax.Array, seen: jax.Array, req: Request, counts: jax.Array | None = None) -> jax.Array:
    """The distribution each row's token is drawn from, [N, V]: a one-hot argmax for greedy
    rows, else the softmax of `filtered_logits` (the same steps as `select_tokens`)."""
    return _choose(adjusted_logits(logits, seen, req, counts), req,
                   lambda lg: jax.nn.one_hot(argmax(lg), lg.shape[-1]),
                   lambda lg, t, k, p: jax.nn.softmax(filtered_logits(lg, t, k, p), axis=-1))


def stop_hit(out: jax.Array, n: jax.Array, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """One row: do the emitted tokens out[:n] ([S] buffer) end with one of the stop sequences
    (tokens [S', L], lengths [S'])? Only emitted tokens count: a stop never starts in the prompt."""
    j = jnp.arange(tokens.shape[1])
    idx = n - lengths[:, None] + j[None, :]  # stop s matches if out[n - len_s + j] == tokens[s, j]
    got = out[jnp.clip(idx, 0, out.shape[0] - 1)]
    ok = (got == tokens) | (j[None, :] >= lengths[:, None])
    valid = (lengths > 0) & (lengths <= n)
    return jnp.any(valid & jnp.all(ok, axis=1))
