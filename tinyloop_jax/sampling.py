"""Token selection on device: repetition penalty, temperature, top-k, top-p, stop sequences.

All knobs are traced arrays (not static), so changing them never recompiles. The order is
Hugging Face's: repetition penalty -> (greedy | temperature -> top-k -> top-p -> sample).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # [] float32; 0 = greedy
    top_k: jax.Array  # [] int32; 0 = off
    top_p: jax.Array  # [] float32; 1 = off
    repetition_penalty: jax.Array  # [] float32; 1 = off
    key: jax.Array  # PRNG key from the call's seed

    @classmethod
    def make(cls, temperature=0.0, top_k=50, top_p=1.0, repetition_penalty=1.0, seed=0):
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                   jnp.float32(repetition_penalty), jax.random.key(seed))

    @classmethod
    def make_batch(cls, temperature, top_k, top_p, repetition_penalty, seeds):
        """The same knobs for every request, one seed each: every field gets a leading axis."""
        n = len(seeds)
        full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
        return cls(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                   full(repetition_penalty, jnp.float32), jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32)))


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF semantics over tokens seen so far (seen [V] bool): positive logits divided,
    negative multiplied."""
    pen = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, pen, logits)


def _sample(logits: jax.Array, sp: SamplingParams, key: jax.Array) -> jax.Array:
    """Temperature, then top-k and top-p in one sort, then a categorical draw."""
    scaled = logits / sp.temperature
    order = jnp.argsort(-scaled)  # descending; sampling happens in sorted space (no ties issue)
    s = scaled[order]
    rank = jnp.arange(s.shape[0])
    keep = (sp.top_k <= 0) | (rank < sp.top_k)
    s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s)
    before = jnp.cumsum(p) - p  # probability mass strictly above each token
    keep = keep & ((before < sp.top_p) | (rank == 0))
    idx = jax.random.categorical(key, jnp.where(keep, s, -jnp.inf))
    return order[idx].astype(jnp.int32)


def select_token(logits: jax.Array, seen: jax.Array, sp: SamplingParams, step: jax.Array) -> jax.Array:
    """logits [V] float32 -> token id [] int32. Step `step` uses key fold_in(key, step)."""
    logits = apply_repetition_penalty(logits, seen, sp.repetition_penalty)
    return jax.lax.cond(sp.temperature <= 0,
                        lambda: jnp.argmax(logits).astype(jnp.int32),
                        lambda: _sample(logits, sp, jax.random.fold_in(sp.key, step)))


def select_tokens(logits: jax.Array, seen: jax.Array, sp: SamplingParams, step: jax.Array) -> jax.Array:
    """A batch: logits, seen [N, V], sp with a leading request axis -> tokens [N]. The knobs
    other than the seed are shared by the batch, so greedy is one branch for all (a vmapped
    `select_token` would turn its cond into a select and sort every row even when greedy)."""
    logits = jax.vmap(apply_repetition_penalty)(logits, seen, sp.repetition_penalty)
    return jax.lax.cond(sp.temperature[0] <= 0,
                        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
                        lambda: jax.vmap(lambda lg, s, k: _sample(lg, s, jax.random.fold_in(k, step)))(
                            logits, sp, sp.key))


# ---- stop sequences --------------------------------------------------------------------------

@struct.dataclass
class StopSpec:
    tokens: jax.Array  # [S, Lmax] int32, left-aligned, padded with -1
    lengths: jax.Array  # [S] int32 (0 rows are padding and never match)

    @classmethod
    def make(cls, stop_sequences: list[list[int]]):
        """Pad to power-of-two shapes so varied stop lists share compiled programs."""
        toks, lens = cls._padded([stop_sequences])
        return cls(jnp.asarray(toks[0]), jnp.asarray(lens[0]))

    @classmethod
    def make_batch(cls, per_request: list[list[list[int]]]):
        """One stop list per request, padded to one shape: tokens [N, S, L], lengths [N, S]."""
        toks, lens = cls._padded(per_request)
        return cls(jnp.asarray(toks), jnp.asarray(lens))

    @staticmethod
    def _padded(lists):
        n = max([1] + [len(x) for x in lists])
        lmax = max([1] + [len(s) for x in lists for s in x])
        S, L = 1 << (n - 1).bit_length(), 1 << (lmax - 1).bit_length()
        toks = np.full((len(lists), S, L), -1, np.int32)
        lens = np.zeros((len(lists), S), np.int32)
        for r, x in enumerate(lists):
            for i, s in enumerate(x):
                toks[r, i, :len(s)] = s
                lens[r, i] = len(s)
        return toks, lens


def stop_hit(out: jax.Array, n: jax.Array, stop: StopSpec) -> jax.Array:
    """Do the emitted tokens out[:n] end with one of the stop sequences? (only emitted tokens
    count: a stop sequence never starts inside the prompt)."""
    L = stop.tokens.shape[1]
    j = jnp.arange(L)
    # for stop s, token j must equal out[n - len_s + j] for j < len_s
    idx = n - stop.lengths[:, None] + j[None, :]  # [S, L]
    got = out[jnp.clip(idx, 0, out.shape[0] - 1)]
    ok = (got == stop.tokens) | (j[None, :] >= stop.lengths[:, None])
    valid = (stop.lengths > 0) & (stop.lengths <= n)
    return jnp.any(valid & jnp.all(ok, axis=1))
