"""Huginn's recurrence (`injection="concat_adapter"`): how a pass takes the pre blocks' output.

Huginn (the "raven" model of seal-rg/recurrent-pretraining) does not feed the pre blocks'
output e into the first pass as the stream. It keeps a separate latent state s per position:

    e  = pre blocks (embeddings * embed_scale)            [T, D]   once
    s0 = truncated normal, drawn per position              [T, D]   (zero at state_init_scale 0)
    s  = loop blocks(adapter(concat(s, e)))                [T, D]   every pass
    y  = coda(final_norm(s)) -> final_norm -> head                  (norm_before_coda)

The initial state follows the reference's rule: std sigma = sqrt(2 / (5 D)) * state_init_scale,
truncated at +-3 sigma, then times embed_scale. Ours is a function of (seed, position) only, so
a chunked prefill, a token-by-token decode and a prefix reused by a later call draw the same
state for the same position and seed (the reference draws from torch's global generator). A
call that continues a prompt deeper carries (s | e) per position: `carry` [T, 2D].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .params import Params

# The initial states' keys are fold_in(fold_in(key(seed), STATE_STREAM), position): apart from
# the sampling keys fold_in(key(seed), step), whose steps never reach this value.
STATE_STREAM = 0xFFFF_FFFF
TRUNCATION = 3.0  # the reference's a = -3 sigma, b = 3 sigma


def injected(cfg: ModelConfig) -> bool:
    return cfg.injection != "none"


def state_std(cfg: ModelConfig) -> float:
    """sigma of the untruncated normal the initial state is drawn from, before embed_scale."""
    return math.sqrt(2.0 / (5.0 * cfg.d_model)) * cfg.state_init_scale


def initial_state(cfg: ModelConfig, seed: jax.Array | None, positions: jax.Array) -> jax.Array:
    """The loop state before the first pass at each of positions [T] -> [T, D] in the compute
    dtype. seed: uint32 [] (None: 0). Zero when state_init_scale is 0.

    >>> s = initial_state(cfg, jnp.uint32(7), jnp.arange(4))   # the same for the same seed
    """
    T, D = positions.shape[0], cfg.d_model
    std = state_std(cfg)
    if std == 0.0:
        return jnp.zeros((T, D), cfg.compute_dtype)
    base = jax.random.fold_in(jax.random.key(jnp.uint32(0) if seed is None else seed), STATE_STREAM)
    draw = jax.vmap(lambda p: jax.random.truncated_normal(jax.random.fold_in(base, p), -TRUNCATION, TRUNCATION,
                                                          (D,), jnp.float32))(positions)
    return (draw * std * cfg.embed_scale).astype(cfg.compute_dtype)


def pass_input(params: Params, s: jax.Array, e: jax.Array) -> jax.Array:
    """The adapter: state s [T, D] and the pre blocks' output e [T, D] -> the stream a pass
    starts from [T, D]."""
    return jnp.concatenate([s, e], axis=-1) @ params.adapter


def carry(s: jax.Array, e: jax.Array) -> jax.Array:
    """What a deeper call continues from: (s | e) [T, 2D]."""
    return jnp.concatenate([s, e], axis=-1)


def split_carry(c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `carry`: [T, 2D] -> (s, e), each [T, D]."""
    d = c.shape[-1] // 2
    return c[..., :d], c[..., d:]
