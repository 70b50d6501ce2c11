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

The pass loop is a `lax.while_loop` whose trip count is data: one program for every criterion
and threshold (all traced, per row), and passes after every row's exit are not run. Rows of a
batch that exited are masked (their results frozen) until the last row exits. The K/V a skipped
pass would have written are filled, at exit, with the token's last computed pass of the same
loop block, so every later token reads what the reference's `latest-m4` lookup gives it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as kvc
from . import recurrence as rec
from . import transformer as tf
from .cache import KVCache
from .config import ModelConfig
from .params import Params

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


def latent_value(pol: Policy, judge: Judge, s: jax.Array, valid: jax.Array) -> jax.Array:
    """latent-diff or cosine of the state s [T, D] against the last check's, averaged over the
    chunk's real positions (valid [T] bool)."""
    s, prev = s.astype(jnp.float32), judge.latent.astype(jnp.float32)
    norm = jnp.linalg.norm(s, axis=-1)
    diff = jnp.linalg.norm(s - prev, axis=-1) / norm
    cos = jnp.sum(s * prev, axis=-1) / norm / jnp.linalg.norm(prev, axis=-1)
    mean = lambda v: jnp.sum(jnp.where(valid, v, 0.0)) / jnp.sum(valid)  # noqa: E731
    return jnp.where(pol.kind == LATENT, mean(diff), 1.0 - mean(cos))


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


def judge_pass(pol: Policy, judge: Judge, i, last, s: jax.Array, valid: jax.Array, gate_prob: jax.Array,
               logits: jax.Array | None, check: jax.Array):
    """Fold pass i's state s [T, D] (and, when computed, the logits [V] of this check) into the
    evaluator. Returns (exit now, new judge). The gate accumulates at every pass; the rest
    move only on a check."""
    p, remaining = tf.exit_prob(gate_prob, judge.remaining, last)
    cumulative = judge.cumulative + p
    lat = latent_value(pol, judge, s, valid)
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
    judge = Judge(on(s, judge.latent), on(logp, judge.logp), on(entropy, judge.entropy), on(top, judge.argmax),
                  on(stable, judge.stable), remaining, cumulative)
    return check & leave, judge


def quick_exit(pol: Policy, judge: Judge, last, s: jax.Array, valid: jax.Array, gate_prob: jax.Array,
               check: jax.Array) -> jax.Array:
    """Does a criterion that needs no logits (latent-diff, cosine, gate) exit after this pass?
    (It decides whether the coda runs: those criteria read the logits only when they exit.)"""
    lat = latent_value(pol, judge, s, valid)
    cumulative = judge.cumulative + tf.exit_prob(gate_prob, judge.remaining, last)[0]
    k = pol.kind
    return check & ((((k == LATENT) | (k == COSINE)) & (lat < pol.threshold))
                    | ((k == GATE) & (cumulative >= pol.threshold)))


def fill_skipped(stack: dict, slots: jax.Array, src: jax.Array, depth: jax.Array, loops: int) -> dict:
    """Passes depth..loops-1 of the chunk's slots [T] (src [C]: their inverse, see
    `cache.write`) take pass depth-1's K/V, block by block: what a token that exited after
    `depth` passes offers the later tokens that run deeper."""
    def one(a):  # [L, k, lead.., C, w]: slots on axis -2
        ax = a.ndim - 2
        col = jnp.take(a, jnp.minimum(slots, a.shape[ax] - 1), axis=ax)  # [L, k, lead.., T, w]
        last = jax.lax.dynamic_index_in_dim(col, depth - 1, axis=0, keepdims=True)
        p = jnp.arange(a.shape[0]).reshape((-1,) + (1,) * (a.ndim - 1))
        col = jnp.where((p >= depth) & (p < loops), last, col)
        if slots.shape[0] == 1:
            return jax.lax.dynamic_update_slice_in_dim(a, col, slots[0], axis=ax)
        return kvc.by_slot(col, a, src, axis=ax)
    return {n: one(a) for n, a in stack.items()}


def slot_values(post: tuple, slots: jax.Array) -> tuple:
    """The coda layers' stored values at slots [T] (to put back where a row did not run it)."""
    return tuple({n: jnp.take(a, jnp.minimum(slots, a.shape[-2] - 1), axis=a.ndim - 2) for n, a in e.items()}
                 for e in post)


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


class Step(NamedTuple):
    """What `forward_rows` returns, per row (leading N axis)."""
    logits: jax.Array  # [N, V] next-token logits after each row's last real token
    own: KVCache
    depth: jax.Array  # [N] int32 passes run
    state: jax.Array  # [N, D] the last real token's state where it stopped (continuous compute)


@tf.exact
def forward_rows(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
                 ro: tuple, own: KVCache, loops: int, window: int, pol: Policy, seeds: jax.Array,
                 warm: jax.Array | None = None, ro_fn=None, ro_args: tuple = ()) -> Step:
    """N rows' chunks tokens [N, T] (row i real up to n_valid[i] >= 1, at start_pos[i]) through
    every layer with adaptive depth, appended to the rows' own segments (batched; one row may be
    carried unbatched, see `programs.rows_in_loop`). pol: Policy [N]; seeds [N] uint32 (initial
    states); warm [N, D]: the state a continuous-compute row starts from (None: none does).
    A chunk exits as a whole at one depth. Read-only segments: `ro`, shared by every row, or
    per row `ro_fn(*args)` of that row's ro_args (a tuple of [N] arrays; the serving pool as
    each row sees it)."""
    batched = own.length.ndim == 1
    vm = jax.vmap if batched else (lambda f: f)
    if not batched:  # the one row, without its N axis
        tokens, n_valid, start_pos, pol, seeds, ro_args = jax.tree.map(lambda a: a[0], (tokens, n_valid, start_pos, pol,
                                                                                   seeds, ro_args))
        warm = None if warm is None else warm[0]
    T, V = tokens.shape[-1], cfg.vocab_size
    chunk = vm(lambda s, n: tf.make_chunk(s, n, T, own.capacity))(start_pos, n_valid)
    valid = chunk.self_pos >= 0
    last = jnp.maximum(n_valid - 1, 0)
    at_last = vm(lambda a, i: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False))

    seg = (lambda ra: ro) if ro_fn is None else (lambda ra: ro_fn(*ra))  # noqa: E731 - a row's read-only segments

    def pre(tok, ch, o, sd, ra):
        return tf.run_pre(params, cfg, tf.embed(params, tok, ch.q_pos[0], cfg), ch, seg(ra), o, window, sd)
    s, e, pre_stores, _ = vm(pre)(tokens, chunk, own, seeds, ro_args)
    if warm is not None:
        s = jnp.where(pol.warm[..., None, None], jnp.broadcast_to(warm[..., None, :], s.shape).astype(s.dtype), s)
    judge = vm(lambda a: Judge.start(a, V))(s)

    def coda_logits(x, post, need):
        """The coda (writing only where `need`) and the logits at each row's last token."""
        def one(x, ch, o, post, i, ra):
            y, post = tf.run_coda(params, cfg, x, ch, seg(ra), o, post, window)
            return tf.lm_head(params, cfg, jax.lax.dynamic_index_in_dim(y, i, axis=0, keepdims=False)), post
        logits, new = vm(one)(x, chunk, own, post, last, ro_args)
        if post:  # rows that did not need it get their coda slots back
            old, fresh = vm(slot_values)(post, chunk.slots), vm(slot_values)(new, chunk.slots)
            mask = lambda n, o: jnp.where(need.reshape(need.shape + (1,) * (n.ndim - need.ndim)), n, o)  # noqa: E731
            vals = jax.tree.map(mask, fresh, old)
            new = vm(lambda st, v, ch: tuple(kvc.write(a, b, ch.slots, ch.src) for a, b in zip(st, v)))(
                new, vals, chunk)
        return logits, new

    def gate_prob(x):
        if not cfg.early_exit_gate:
            return jnp.zeros(x.shape[:-2], jnp.float32)
        return vm(lambda x, i: tf.gate(params, jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)))(x, last)

    def body(c: Carry) -> Carry:
        s_new, stack = vm(lambda s, e, st, ch, o, ra: tf.loop_pass(params, cfg, c.i, s, e, st, ch, seg(ra), o,
                                                                   window))(c.s, e, c.stack, chunk, own, ro_args)
        check = c.active & vm(lambda p: is_check(p, c.i))(pol)
        g = gate_prob(s_new)
        quick = vm(lambda p, j, x, v, gp, ck: quick_exit(p, j, c.i == loops - 1, x, v, gp, ck))(
            pol, c.judge, s_new, valid, g, check)
        need = check & (jnp.isin(pol.kind, jnp.array(LOGIT_KINDS)) | quick)
        logits, post = jax.lax.cond(jnp.any(need), lambda p: coda_logits(s_new, p, need),
                                    lambda p: (c.logits, p), c.post)
        leave, judge = vm(lambda p, j, x, v, gp, lg, ck: judge_pass(p, j, c.i, c.i == loops - 1, x, v, gp, lg, ck))(
            pol, c.judge, s_new, valid, g, logits, check)
        judge = jax.tree.map(lambda n, o: jnp.where(c.active.reshape(c.active.shape + (1,) * (n.ndim - c.active.ndim)),
                                                    n, o), judge, c.judge)
        return Carry(c.i + 1, jnp.where(c.active[..., None, None], s_new, c.s), stack, post, c.active & ~leave,
                     jnp.where(c.active, c.i + 1, c.depth), judge, jnp.where(need[..., None], logits, c.logits),
                     c.have | need)

    zeros = jnp.zeros(pol.kind.shape, jnp.int32)
    c = Carry(jnp.int32(0), s, own.loop, own.post, jnp.ones(pol.kind.shape, bool), zeros, judge,
              jnp.zeros(pol.kind.shape + (V,), jnp.float32), jnp.zeros(pol.kind.shape, bool))
    c = jax.lax.while_loop(lambda c: (c.i < loops) & jnp.any(c.active), body, c)
    # rows that never computed logits (no check of a logit criterion, no exit): the last pass's
    final = ~c.have
    logits, post = jax.lax.cond(jnp.any(final), lambda p: coda_logits(c.s, p, final), lambda p: (c.logits, p),
                                c.post)
    logits = jnp.where(final[..., None], logits, c.logits)
    stack = vm(lambda st, ch, d: fill_skipped(st, ch.slots, ch.src, d, loops))(c.stack, chunk, c.depth)
    new_own = own.replace(pre=tuple(pre_stores), loop=stack, post=post,
                          pos=vm(kvc.write_positions)(own.pos, chunk.q_pos, chunk.slots, chunk.src),
                          length=(start_pos + n_valid).astype(jnp.int32))
    out = Step(logits, new_own, c.depth, at_last(c.s, last))
    if not batched:
        out = Step(out.logits[None], new_own, out.depth[None], out.state[None])
    return out
