"""The early exit's pick (Ouro): a gate's exit probability per pass, the distribution over the
passes, and which pass's output gives the logits (every pass still runs); `adaptive` stops the
passes themselves.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .params import Params
from .precision import exact


class Exit(NamedTuple):
    """Which pass's output gives the logits (Ouro's early exit; every pass still runs). step >= 0:
    that pass (0-based); else the first pass whose cumulative exit probability reaches
    `threshold` (> 1: never, i.e. the last pass)."""
    step: jax.Array  # int32 []
    threshold: jax.Array  # float32 []

    @classmethod
    def make(cls, step: int | None = None, threshold: float | None = None) -> "Exit":
        return cls(jnp.int32(-1 if step is None else step), jnp.float32(2.0 if threshold is None else threshold))


def gate(params: Params, x: jax.Array) -> jax.Array:
    """The exit gate's probability lambda [..] of a pass output x [.., D]."""
    return jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), params.gate_w.astype(jnp.float32)) + params.gate_b)


def exit_prob(lam: jax.Array, remaining: jax.Array, last) -> tuple[jax.Array, jax.Array]:
    """One pass of Ouro's exit distribution: p_t = lambda_t * prod_{s<t} (1 - lambda_s), the
    last pass taking what remains. Returns (p_t, remaining after pass t)."""
    return jnp.where(last, remaining, lam * remaining), remaining * (1.0 - lam)


def exit_distribution(params: Params, pass_states: jax.Array) -> jax.Array:
    """Pass outputs [passes, ..., D] -> the exit distribution [passes, ...] (sums to 1)."""
    rem, pdf = jnp.ones(pass_states.shape[1:-1], jnp.float32), []
    for t in range(pass_states.shape[0]):
        p, rem = exit_prob(gate(params, pass_states[t]), rem, t == pass_states.shape[0] - 1)
        pdf.append(p)
    return jnp.stack(pdf)


class ExitCarry(NamedTuple):
    """The early exit's running pick over the passes, per position of a chunk of T tokens."""
    x: jax.Array  # [T, D] the stream of the pass taken (zeros until one is)
    remaining: jax.Array  # [T] float32: exit probability not yet given to a pass
    cumulative: jax.Array  # [T] float32: exit probability of the passes so far
    chosen: jax.Array  # [T] bool: a pass was taken

    @classmethod
    def start(cls, x: jax.Array) -> "ExitCarry":
        """Before the first pass, for streams like x [T, D]."""
        T = x.shape[0]
        return cls(jnp.zeros_like(x), jnp.ones((T,), jnp.float32), jnp.zeros((T,), jnp.float32),
                   jnp.zeros((T,), bool))

    def pick(self, last: jax.Array) -> jax.Array:
        """The streams the logits come from [T, D]: the taken pass's, else `last` (the last pass's)."""
        return jnp.where(self.chosen[:, None], self.x, last)


def exit_update(params: Params, ex: Exit, i, last, x: jax.Array, carry: ExitCarry) -> ExitCarry:
    """Fold pass i's output x [T, D] into the exit's pick: the pass is taken if it is `ex.step`,
    or (no step) the first whose cumulative exit probability reaches `ex.threshold`. `last`:
    pass i is the last one (it takes what probability remains)."""
    p, remaining = exit_prob(gate(params, x), carry.remaining, last)
    cumulative = carry.cumulative + p
    take = jnp.where(ex.step >= 0, i == ex.step, ~carry.chosen & (cumulative >= ex.threshold))
    return ExitCarry(jnp.where(take[:, None], x, carry.x), remaining, cumulative, carry.chosen | take)


@exact
def exit_stream(params: Params, cfg: ModelConfig, pass_states: jax.Array, exit: Exit | None) -> jax.Array:
    """One position's pass outputs [loops, D] -> the stream its logits come from [D]."""
    if exit is None or not cfg.early_exit_gate:
        return pass_states[-1]
    sel, n = ExitCarry.start(pass_states[:1]), pass_states.shape[0]
    for i in range(n):  # a handful of [D] dot products
        sel = exit_update(params, exit, i, i == n - 1, pass_states[i:i + 1], sel)
    return sel.pick(pass_states[-1:])[0]
