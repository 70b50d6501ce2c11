"""Token selection on device: one request value, one sampling distribution, stop sequences.

A request's knobs travel as one value from the API edge to the device: `SamplingParams` (one
request, on the host; checked at the edge by `validation.sampling_params`) -> `Knobs` (N
requests' rows as arrays, `Knobs.from_params`) -> the jitted loops. Every knob is a traced
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

`filtering.filtered_logits` is the one definition of the sampling distribution: `sample` draws
from it (Gumbel-max, token for token `jax.random.categorical`'s draw), and speculative decoding's
acceptance rule compares its softmax (`distribution`); `filtering` finds its kept set without a
full sort of the vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .filtering import argmax, filtered_logits, sample


MAX_LOGIT_BIAS = 300  # (token, bias) pairs per request, as OpenAI allows


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the decode loop (host side, hashable). Built once at the API
    edge (`validation.sampling_params` checks every field against the model) and turned into
    device rows by `Knobs.from_params`.

    >>> p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, stop_sequences=((13, 10),))
    >>> req = Knobs.from_params([p, dataclasses.replace(p, seed=4)])   # two rows
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
    response_format: object = None  # structured output: a `grammar.Grammar` (None: free text)


@struct.dataclass
class StopSpec:
    """Stop sequences per request, left-aligned and padded: tokens [N, S, L] (-1 = padding),
    lengths [N, S] (0 = a padding row, never matches). Power-of-two S and L, so varied stop
    lists share compiled programs."""

    tokens: Annotated[jax.Array, "int32[N, S, L]"]
    lengths: Annotated[jax.Array, "int32[N, S]"]

    @classmethod
    def make(cls, per_request: list[list[list[int]]], shape: tuple[int, int] | None = None) -> "StopSpec":
        """shape (S, L): a fixed one (the engine's rows, `serving.step.STOPS`); a request with
        more or longer stop sequences is a ValueError."""
        n = max([1] + [len(x) for x in per_request])
        lmax = max([1] + [len(s) for x in per_request for s in x])
        S, L = (1 << (n - 1).bit_length(), 1 << (lmax - 1).bit_length()) if shape is None else shape
        if n > S or lmax > L:
            raise ValueError(f"stop_sequences: at most {S} sequences of at most {L} tokens each here, got {n} "
                             f"sequences, the longest of {lmax} tokens")
        toks = np.full((len(per_request), S, L), -1, np.int32)
        lens = np.zeros((len(per_request), S), np.int32)
        for r, stops in enumerate(per_request):
            for i, s in enumerate(stops):
                toks[r, i, :len(s)] = s
                lens[r, i] = len(s)
        return cls(toks, lens)


@struct.dataclass
class Knobs:
    """What N requests ask of the decode loop, one row each: N `SamplingParams` as arrays. Made
    on the host (numpy) by `Knobs.from_params`; traced inside the jitted loops."""

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
    # structured output: the tokens each row may choose now (`grammar` bitmask rows, set by the
    # step that carries them); None: every token
    allowed: Annotated[jax.Array, "int32[N, ceil(V / 32)]"] | None = None
    # static: False when every row is greedy, and the programs compile no sampling at all
    sampled: bool = struct.field(pytree_node=False, default=True)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], stops: bool = True,
                    logit_bias: bool | None = None, sampled: bool | None = None,
                    stop_shape: tuple[int, int] | None = None) -> "Knobs":
        """One row per request, in order. stops=False leaves the stop sequences out (an empty
        spec, the same shape for every batch): for callers that check stops on the host.
        logit_bias: carry the bias rows (None: only if some request has a logit bias); sampled:
        compile the sampling step (None: only if some request has a temperature above 0);
        stop_shape: the stop spec's fixed (S, L) (`StopSpec.make`)."""
        col = lambda name, dt: np.array([getattr(p, name) for p in params], dt)  # noqa: E731
        stop = StopSpec.make([[list(s) for s in p.stop_sequences] if stops else [] for p in params], stop_shape)
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
                   sampled=any(p.temperature > 0 for p in params) if sampled is None else sampled)

    @classmethod
    def make(cls, n: int, temperature=0.0, top_k=50, top_p=1.0, repetition_penalty=1.0, seeds=None, max_tokens=32,
             stop_sequences=None, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=(),
             carry_bias: bool | None = None, sampled: bool | None = None,
             stop_shape: tuple[int, int] | None = None) -> "Knobs":
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
                                for i in range(n)], logit_bias=carry_bias, sampled=sampled, stop_shape=stop_shape)

    @property
    def n(self) -> int:
        return int(self.temperature.shape[0])

    def pad(self, k: int) -> "Knobs":
        """k more rows (copies of the last) that stop after one token: filler for a batch split
        over devices."""
        out = jax.tree.map(lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[-1:], k, 0)]), self)
        return out.replace(max_tokens=np.concatenate([np.asarray(self.max_tokens), np.ones((k,), np.int32)]))

    def greedy_where(self, idle: jax.Array) -> "Knobs":
        """The rows with idle [N] True made greedy: rows whose tokens are thrown away (finished,
        filler, a prompt's inner chunk), whose logits may be flat enough to send a sampled row
        down the slow paths of `filtering` for nothing."""
        return self.replace(temperature=jnp.where(idle, 0.0, self.temperature))

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


def allow(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [N, V] with every token whose bit is clear in allowed int32[N, ceil(V / 32)] at
    -inf (bit i % 32 of word i // 32: token i; llguidance's bitmask layout)."""
    ids = jnp.arange(logits.shape[-1])
    bits = (jnp.take(allowed, ids // 32, axis=1) >> (ids % 32)) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)


def adjusted_logits(logits: jax.Array, seen: jax.Array, req: Knobs, counts: jax.Array | None = None) -> jax.Array:
    """The logits [N, V] a token is chosen from: the logit bias, the repetition penalty over
    `seen` [N, V] (prompt and output), the frequency and presence penalties over `counts`
    [N, V] (how often each token was emitted so far; None: nothing yet, the first token), then
    the grammar's mask (`req.allowed`; last, so no bias revives a forbidden token)."""
    if req.bias_ids is not None:
        logits = bias(logits, req.bias_ids, req.bias_values)
    logits = penalize(logits, seen, req.repetition_penalty)
    if counts is not None:
        logits = penalize_counts(logits, counts, req.frequency_penalty, req.presence_penalty)
    return logits if req.allowed is None else allow(logits, req.allowed)


def _sampled_knobs(req: Knobs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(temperature, top_k, top_p) [N] for the sampling branch: a greedy row (temperature 0) in
    a sampled batch takes temperature 1, top_k 1 and top_p 0 (no request's: the mark of a row
    whose sampled token is dropped, `filtering`), so it costs its neighbours nothing (its token
    is the argmax's)."""
    greedy = req.temperature <= 0
    return (jnp.where(greedy, 1.0, req.temperature), jnp.where(greedy, 1, req.top_k),
            jnp.where(greedy, 0.0, req.top_p))


def _choose(logits: jax.Array, req: Knobs, greedy, sampled) -> jax.Array:
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


def select_tokens(logits: jax.Array, seen: jax.Array, req: Knobs, step: jax.Array,
                  counts: jax.Array | None = None) -> jax.Array:
    """logits, seen [N, V] -> token ids [N] int32 (row i draws with req.keys(step)[i]; step [] or
    [N], one per row). counts [N, V]: tokens emitted so far (None: none, the first token)."""
    return _choose(adjusted_logits(logits, seen, req, counts), req, argmax,
                   lambda lg, t, k, p: sample(lg, t, k, p, req.keys(step)))


def distribution(logits: jax.Array, seen: jax.Array, req: Knobs, counts: jax.Array | None = None) -> jax.Array:
    """The distribution each row's token is drawn from, [N, V]: a one-hot argmax for greedy
    rows, else the softmax of `filtered_logits` (the same steps as `select_tokens`)."""
    return _choose(adjusted_logits(logits, seen, req, counts), req,
                   lambda lg: jax.nn.one_hot(argmax(lg), lg.shape[-1]),
                   lambda lg, t, k, p: jax.nn.softmax(filtered_logits(lg, t, k, p), axis=-1))


def stop_match(out: jax.Array, n: jax.Array, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """The token stop rule, the one place it is written. One row: the index of the first stop
    sequence (tokens [S, L], lengths [S]) that the emitted tokens out[:n] ([B] buffer) end with,
    or -1. Only emitted tokens count: a stop never starts in the prompt. (The engine's rows keep
    their last L tokens, right-aligned after -1s: out = that tail, n = L.)"""
    j = jnp.arange(tokens.shape[1])
    idx = n - lengths[:, None] + j[None, :]  # stop s matches if out[n - len_s + j] == tokens[s, j]
    got = out[jnp.clip(idx, 0, out.shape[0] - 1)]
    ok = (got == tokens) | (j[None, :] >= lengths[:, None])
    hit = (lengths > 0) & (lengths <= n) & jnp.all(ok, axis=1)
    return jnp.where(jnp.any(hit), jnp.argmax(hit), -1).astype(jnp.int32)


def stop_hit(out: jax.Array, n: jax.Array, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """Do the emitted tokens out[:n] end with a stop sequence (`stop_match`)?"""
    return stop_match(out, n, tokens, lengths) >= 0
