"""Adaptive depth: each token runs passes until an exit criterion says stop, and no further.

The criteria are Huginn's exit evaluators (seal-rg/recurrent-pretraining,
`generate_with_adaptive_compute`) with their default thresholds, and Ouro's learned exit gate:

    kl                KL(previous || current) of the next-token distribution     exit if <  1e-3
    entropy-diff      |entropy - previous entropy| (first previous: 100)          exit if <  1e-3
    latent-diff       |s - s_prev| / |s| of the state, mean over the chunk        exit if <  0.03
    cosine            1 - cos(s, s_prev), mean over the chunk                     exit if <  1e-3
    argmax-stability  checks in a row with an unchanged argmax                    exit if >= 5
    gate              Ouro's cumulative exit probability (every pass adds to it)  exit if >= threshold

A check runs after pass min_steps + 1, then every `check_every` passes; the "previous" values
move only on a check (the first previous: uniform log-probabilities, the initial state). Logit
criteria run the coda at every check; the others only when they exit. A chunk (a prompt that
may exit) exits as a whole: latent criteria average over its real positions, logit criteria
look at its last one. A row that reaches `loops` without exiting takes the logits of its last
check if it had one (the reference keeps them), else of its last pass.

This module holds the criteria, the policy and the evaluator; the pass loop over the page pool
is `paged_adaptive.forward`: a `lax.while_loop` whose trip count is data (one program for every
criterion and threshold, all traced, per row; passes after every row's exit are not run; rows
that exited are masked until the last row exits), and the K/V a skipped pass would have written
filled, at exit, with the token's last computed pass of the same loop block, so every later
token reads what the reference's `latest-m4` lookup gives it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import recurrence as rec
from . import exits
from .config import ModelConfig

CRITERIA = ("kl", "entropy-diff", "latent-diff", "cosine", "argmax-stability", "gate")
DEFAULT_THRESHOLDS = {"kl": 1e-3, "entropy-diff": 1e-3, "latent-diff": 0.03, "cosine": 1e-3,
                      "argmax-stability": 5, "gate": 0.5}
KL, ENTROPY, LATENT, COSINE, ARGMAX, GATE = range(len(CRITERIA))
NONE = -1  # every pass (a row of a batch without a criterion)
LOGIT_KINDS = (KL, ENTROPY, ARGMAX)  # criteria that read the logits at every check
START_ENTROPY = 100.0  # the reference's first "previous" entropy


class Policy(NamedTuple):
    """One request's exit rule as arrays (traced: any value runs the same program); a batch has
    a leading N axis on each."""
    kind: jax.Array  # int32: index into CRITERIA, NONE: every pass
    threshold: jax.Array  # float32
    min_steps: jax.Array  # int32: passes before the first check is made after
    check_every: jax.Array  # int32 >= 1
    warm: jax.Array  # bool: continuous compute (a token's state starts from the previous token's)

    @classmethod
    def stack(cls, policies: list["Policy"]) -> "Policy":
        return cls(*(jnp.stack([jnp.asarray(getattr(p, f)) for p in policies]) for f in cls._fields))


EVERY_PASS = Policy(np.int32(NONE), np.float32(0), np.int32(0), np.int32(1), np.bool_(False))  # no criterion


def make_policy(cfg: ModelConfig, loops: int, criterion: str | None, threshold=None, min_steps=0, check_every=1,
                continuous_compute=False) -> Policy:
    """Check one request's adaptive-depth arguments against the model and depth (ValueError
    naming the bad value) and return them as a Policy. criterion None: every pass."""
    if criterion is None:
        if threshold is not None or min_steps != 0 or check_every != 1 or continuous_compute:
            raise ValueError("exit_threshold / min_steps / check_every / continuous_compute need an exit_criterion "
                             f"(one of {CRITERIA}); Ouro's pick of the pass that feeds the head is "
                             "early_exit_threshold")
        return EVERY_PASS
    if criterion not in CRITERIA:
        raise ValueError(f"unknown exit_criterion {criterion!r}: expected one of {CRITERIA}")
    if cfg.default_loops < 1 or cfg.loop_blocks < 1:
        raise ValueError(f"exit_criterion={criterion!r} needs a looped model")
    if criterion == "gate" and not cfg.early_exit_gate:
        raise ValueError("exit_criterion='gate' needs a model with an early-exit gate (Ouro)")
    if criterion == "gate" and threshold is None and cfg.early_exit_threshold is not None:
        threshold = cfg.early_exit_threshold
    thr = DEFAULT_THRESHOLDS[criterion] if threshold is None else threshold
    if isinstance(thr, bool) or not isinstance(thr, (int, float, np.integer, np.floating)) or math.isnan(thr) \
            or thr < 0:
        raise ValueError(f"exit_threshold must be a number >= 0, got {threshold!r}")
    if criterion == "argmax-stability" and thr != int(thr):
        raise ValueError(f"exit_threshold for 'argmax-stability' counts checks: an integer, got {threshold!r}")
    for name, v, lo in (("min_steps", min_steps, 0), ("check_every", check_every, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if min_steps > loops:
        raise ValueError(f"min_steps={min_steps} is more than loops={loops}")
    if not isinstance(continuous_compute, bool):
        raise ValueError(f"continuous_compute must be True or False, got {continuous_compute!r}")
    if continuous_compute and not rec.injected(cfg):
        raise ValueError("continuous_compute needs a model with a separate loop state (Huginn)")
    return Policy(np.int32(CRITERIA.index(criterion)), np.float32(thr), np.int32(min_steps), np.int32(check_every),
                  np.bool_(continuous_compute))


class Judge(NamedTuple):
    """One row's evaluator: the values of its last check (the "previous" ones)."""
    latent: jax.Array  # [T, D] state at the last check (first: the initial state)
    logp: jax.Array  # [V] log-probabilities at the last check (first: uniform)
    entropy: jax.Array  # []
    argmax: jax.Array  # [] int32 (first: -1)
    stable: jax.Array  # [] int32 checks in a row with an unchanged argmax
    remaining: jax.Array  # [] gate: exit probability not yet given to a pass
    cumulative: jax.Array  # [] gate: exit probability of the passes so far

    @classmethod
    def start(cls, s: jax.Array, vocab: int) -> "Judge":
        return cls(s, jnp.full((vocab,), -math.log(vocab), jnp.float32), jnp.float32(START_ENTROPY), jnp.int32(-1),
                   jnp.int32(0), jnp.float32(1.0), jnp.float32(0.0))


def is_check(pol: Policy, i) -> jax.Array:
    """Is there a check after pass i (0-based)?"""
    return (pol.kind != NONE) & (i >= pol.min_steps) & ((i - pol.min_steps) % pol.check_every == 0)


def latent_sums(s: jax.Array, prev: jax.Array, valid: jax.Array) -> jax.Array:
    """float32 [2]: the sums over real positions (valid [T] bool) of |s - s_prev| / |s| and of
    cos(s, s_prev), the state s [T, D] against prev, the last check's: a chunk's latent criteria
    are their means (`latent_value`), summed a block at a time over a long prompt."""
    s, prev = s.astype(jnp.float32), prev.astype(jnp.float32)
    norm = jnp.linalg.norm(s, axis=-1)
    diff = jnp.linalg.norm(s - prev, axis=-1) / norm
    cos = jnp.sum(s * prev, axis=-1) / norm / jnp.linalg.norm(prev, axis=-1)
    return jnp.stack([jnp.sum(jnp.where(valid, diff, 0.0)), jnp.sum(jnp.where(valid, cos, 0.0))])


def latent_value(pol: Policy, sums: jax.Array, count: jax.Array) -> jax.Array:
    """latent-diff or cosine from `latent_sums` over `count` real positions: the mean over them."""
    return jnp.where(pol.kind == LATENT, sums[0] / count, 1.0 - sums[1] / count)


def logit_values(judge: Judge, logits: jax.Array):
    """KL(previous || current), |entropy change| and argmax stability of next-token logits [V]
    against the last check's. Returns (kl, entropy change, stable count, and the new logp,
    entropy, argmax)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    kl = jnp.sum(jnp.exp(judge.logp) * (judge.logp - logp))
    probs = jnp.exp(logp)
    entropy = -jnp.sum(probs * jnp.log(probs + 1e-10))
    top = jnp.argmax(logits).astype(jnp.int32)
    stable = jnp.where(top == judge.argmax, judge.stable + 1, 0).astype(jnp.int32)
    return kl, jnp.abs(entropy - judge.entropy), stable, logp, entropy, top


def judge_pass(pol: Policy, judge: Judge, i, last, lat: jax.Array, gate_prob: jax.Array,
               logits: jax.Array | None, check: jax.Array):
    """Fold pass i (its latent value `lat`, `latent_value`, and when computed the logits [V] of
    this check) into the evaluator. Returns (exit now, new judge). The gate accumulates at every
    pass; the rest move only on a check. The state a check keeps (`Judge.latent`) is the
    caller's to update: the pass loop writes it a block of positions at a time."""
    p, remaining = exits.exit_prob(gate_prob, judge.remaining, last)
    cumulative = judge.cumulative + p
    if logits is None:
        kl = dent = jnp.float32(jnp.inf)
        stable, logp, entropy, top = judge.stable, judge.logp, judge.entropy, judge.argmax
    else:
        kl, dent, stable, logp, entropy, top = logit_values(judge, logits)
    k = pol.kind
    value = jnp.select([k == KL, k == ENTROPY, k == ARGMAX, k == GATE], [kl, dent, stable.astype(jnp.float32),
                                                                           cumulative], lat)
    leave = jnp.where((k == ARGMAX) | (k == GATE), value >= pol.threshold, value < pol.threshold)
    on = lambda new, old: jnp.where(check, new, old)  # noqa: E731
    judge = Judge(judge.latent, on(logp, judge.logp), on(entropy, judge.entropy), on(top, judge.argmax),
                  on(stable, judge.stable), remaining, cumulative)
    return check & leave, judge


def quick_exit(pol: Policy, judge: Judge, last, lat: jax.Array, gate_prob: jax.Array, check: jax.Array) -> jax.Array:
    """Does a criterion that needs no logits (latent-diff, cosine, gate) exit after this pass?
    (It decides whether the coda runs: those criteria read the logits only when they exit.)"""
    cumulative = judge.cumulative + exits.exit_prob(gate_prob, judge.remaining, last)[0]
    k = pol.kind
    return check & ((((k == LATENT) | (k == COSINE)) & (lat < pol.threshold))
                    | ((k == GATE) & (cumulative >= pol.threshold)))


class Carry(NamedTuple):
    """The adaptive pass loop's carry (per row: a leading row axis on each array)."""
    i: jax.Array  # [] passes run
    s: jax.Array  # the streams (the loop state) after the row's last pass
    stack: dict  # the loop stack's cache layers
    post: tuple  # the coda's
    active: jax.Array  # the row has not exited
    depth: jax.Array  # passes the row ran
    judge: Judge
    logits: jax.Array  # the last check's logits
    have: jax.Array  # logits were computed (a check of a logit criterion, or an exit)
