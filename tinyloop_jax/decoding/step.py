"""The one step body over request rows and a page pool (`model.paged`), on the device: a group
of prompt chunks and a group of decode rows fed together, their next tokens chosen, the stop
sequence each token ends found; the serving engine dispatches these from the host
(`serving.step` holds its jitted programs and the host arrays), `Model.generate` runs
`decode_steps` as its decode loop (`paged_decode.decode`).

    pool   PagedKV       every cache layer of one depth, in pages (read and written by the step)
    state  Requests      M request rows: their `RowState` (the `Model` path's decode loops carry
                         the same, with the same feed-and-choose rule), knobs, exit rules and
                         last tokens, by which the step finds the stop sequences a token ends

A row of the step names its request row (`slot`); a decode row's input is that request's last
token, kept on the device, so the host can dispatch step t + 1 before it reads step t's
tokens. Static arguments are shapes only: one program per (decode rows, chunk length, page
table length) bucket, whatever the requests are.
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import grammar as G
from . import row_state as R
from .row_state import RowState
from .scoring import Scores, chunk_scores
from .sampling import Knobs, select_tokens, stop_match
from .speculative import DRAFT_STREAM, fold_in, round_paged
from ..model import adaptive as ad
from ..model import cache as kvc
from ..model import paged
from ..model import page_pool
from ..model import paged_adaptive as pa
from ..model import recurrence as rec
from ..model import transformer as tf
from ..model import exits
from ..model.config import ModelConfig
from ..model.params import Params


FILLER = 1 << 30  # the request row of a filler row: past every state, so its writes are dropped
STOPS = (16, 32)  # a request row's stop sequences: at most 16, of at most 32 tokens (matched in the step)


@struct.dataclass
class Requests:
    """M request rows (a row of the step reads and writes its request's row by `slot`)."""

    rows: RowState  # [M] seen, counts, the last token (a decode row's next input), warm (continuous compute)
    req: Knobs  # [M] the knobs, the stop sequences at the fixed shape STOPS
    pol: ad.Policy  # [M] the exit rules (adaptive depth; kind NONE: every pass)
    tail: Annotated[jax.Array, "int32[M, L]"]  # the last L = STOPS[1] tokens emitted, right-aligned after -1s


@struct.dataclass
class Emitted:
    """Tokens a program chose, and for each the stop sequence it ended (an index into its
    request's stop_sequences; -1: none); a prompt that exited as a whole: the passes it ran; a
    prefix's chunk: its last token's logits and depth states."""

    tokens: Annotated[jax.Array, "int32[b] | int32[b, n]"]
    stops: Annotated[jax.Array, "int32[b] | int32[b, n]"]
    passes: Annotated[jax.Array, "int32[b]"] | None = None
    # a chunk's last token, what a prefix keeps (`step(keep_depths=True)`): its next-token logits
    # (raw) and its stream after each pre block and pass
    logits: Annotated[jax.Array, "float32[b, V]"] | None = None
    depths: Annotated[jax.Array, "[b, n_pre + loops, D]"] | None = None
    stream: Annotated[jax.Array, "[b, T, D | 2D]"] | None = None  # every position's after the last pass (`Run.x`)
    scores: Scores | None = None  # a scored chunk's positions (`step(targets=...)`), [b, T, ...]


def empty_rows(rows: int, vocab: int, d_model: int, dtype=jnp.float32) -> Requests:
    """A depth's `rows` request rows, none in use (knobs at their defaults, stop sequences at the
    fixed shape STOPS)."""
    req = Knobs.make(rows, 0.0, 0, 1.0, 1.0, max_tokens=1, carry_bias=True, sampled=True, stop_shape=STOPS)
    return requests_of(np.zeros((rows, vocab), bool), jax.tree.map(np.asarray, req), d_model=d_model, dtype=dtype)


@struct.dataclass
class Chunks:
    """The step's prompt chunks: b rows of T tokens (host numpy)."""

    rows: paged.Rows  # [b, R]
    tokens: Annotated[jax.Array, "int32[b, T]"]
    slot: Annotated[jax.Array, "int32[b]"] | None  # request rows (FILLER: none); None: rows 0..b-1 of a call
    final: Annotated[jax.Array, "bool[b]"]  # the prompt's last chunk: the first token is chosen
    mask: Annotated[jax.Array, "int32[b, ceil(V / 32)]"] | None = None  # the first tokens' grammar masks (None: none)


@struct.dataclass
class Decodes:
    """The step's decode rows: b rows of one token each, the request's last (host numpy)."""

    rows: paged.Rows  # [b, R] (n_new 1; 0 for filler)
    slot: Annotated[jax.Array, "int32[b]"] | None  # request rows (FILLER: none); None: rows 0..b-1 of a call
    steps: Annotated[jax.Array, "int32[b]"]  # the token's index in the output (its sampling key)
    left: Annotated[jax.Array, "int32[b]"] | None = None  # tokens each row may still emit (`decode_steps`)
    mask: Annotated[jax.Array, "int32[b, ceil(V / 32)]"] | None = None  # the tokens' grammar masks (one step)


def _take(tree, slot):
    """Request rows `slot` [b] of each array (slot None: the rows themselves, in order)."""
    if slot is None:
        return tree
    return jax.tree.map(lambda a: jnp.take(a, slot, axis=0, mode="clip"), tree)


def _where(live: jax.Array, new, old):
    """new where live [b] (each row's whole value), else old: a call's rows, written in place
    without a scatter (on a mesh whose vocabulary axis is split, a scatter costs collectives)."""
    return jax.tree.map(lambda n, o: jnp.where(live.reshape(live.shape + (1,) * (o.ndim - 1)), n, o), new, old)


def _knobs(state: "Requests", slot: jax.Array | None, live: jax.Array, mask: jax.Array | None = None) -> Knobs:
    """The knobs of request rows `slot` [b]; those not live (filler rows, prompts' inner chunks)
    greedy (`Knobs.greedy_where`); mask [b, W]: the tokens each may choose now (structured output)."""
    req = _take(state.req, slot).greedy_where(~live)
    return req if mask is None else req.replace(allowed=mask)


def _put(tree, slot, value):
    return jax.tree.map(lambda a, v: a.at[slot].set(v, mode="drop"), tree, value)


def admit(state: Requests, slot: jax.Array, seen: jax.Array, req: Knobs, pol: ad.Policy) -> Requests:
    """Request row `slot` <- a new request: its prompt's tokens seen [V], nothing emitted, its
    knobs req [1], its exit rule pol []."""
    rows = state.rows
    rows = rows.replace(seen=rows.seen.at[slot].set(seen, mode="drop"), counts=rows.counts.at[slot].set(0, mode="drop"))
    return state.replace(rows=rows, req=_put(state.req, slot[None], req),
                         pol=_put(state.pol, slot[None], jax.tree.map(lambda a: jnp.asarray(a)[None], pol)),
                         tail=state.tail.at[slot].set(-1, mode="drop"))


def _record(state: Requests, slot: jax.Array, tok: jax.Array, live: jax.Array) -> tuple[Requests, jax.Array]:
    """Tokens tok [b] emitted by request rows slot [b] (live [b]: real ones) join their tails;
    returns the state and the stop sequence each token ended [b] (`sampling.stop_match`; -1)."""
    tail = jnp.concatenate([_take(state.tail, slot)[:, 1:], tok[:, None]], axis=1)
    stop = _take(state.req.stop, slot)
    hit = jax.vmap(stop_match, in_axes=(0, None, 0, 0))(tail, jnp.int32(tail.shape[1]), stop.tokens, stop.lengths)
    tail = (_where(live, tail, state.tail) if slot is None
            else state.tail.at[jnp.where(live, slot, FILLER)].set(tail, mode="drop"))
    return state.replace(tail=tail), jnp.where(live, hit, -1)


def step(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, state: Requests, chunks: Chunks | None,
         decodes: Decodes | None, loops: int, exit: exits.Exit | None = None, window: int = 0,
         in_prefill: bool = False, keep_depths: bool = False, targets: jax.Array | None = None, top: int = 0):
    """One step: the chunks' tokens and each decode row's last token through the model at depth
    `loops`, written into the pages; then a token for every decode row and every final chunk.
    window: a static cache_window for every row (else each row's, rows.window). in_prefill (static;
    chunks alone): prompts that may exit (`exit_in_prefill`), each one chunk exiting as a whole
    at its request's exit rule (`paged_adaptive.forward`: the passes it ran in `Emitted.passes`,
    its last state the request's warm state), each pass run `cache.EXIT_BLOCK` positions at a
    time over as many blocks as the prompts fill, so one chunk length serves every prompt.
    keep_depths (static; chunks alone): the chunks' `Emitted` also holds their last tokens'
    logits and depth states and every position's stream after the last pass (injection models:
    the (state | e) carry; a prefix built on pages: `functional.build_prefix`). targets [b, T]
    (chunks alone): no token chosen, each position scored at its target, with its `top` (static)
    likeliest (`Emitted.scores`, `scoring.chunk_scores`). Returns (the chunks' `Emitted` [b],
    the decode rows' [b'] (None for an absent group), pool, state)."""
    if in_prefill:
        if decodes is not None:
            raise ValueError("a prompt exiting as a whole runs alone (decodes must be None)")
        s = chunks.slot
        T = chunks.tokens.shape[1]
        out = pa.forward(params, cfg, pool, chunks.rows, chunks.tokens, loops, _take(state.pol, s),
                         _take(state.req.seed, s), block=kvc.EXIT_BLOCK if T > kvc.EXIT_BLOCK else None)
        got, state = start_rows(state, s, out.logits, chunks.final, out.state, chunks.mask)
        return got.replace(passes=out.depth), None, out.pool, state
    groups, tokens, seeds = [], [], []
    if chunks is not None:
        groups.append(chunks.rows)
        tokens.append(chunks.tokens)
        seeds.append(_take(state.req.seed, chunks.slot))
    if decodes is not None:
        groups.append(decodes.rows)
        tokens.append(_take(state.rows.last, decodes.slot)[:, None])
        seeds.append(_take(state.req.seed, decodes.slot))
    if (keep_depths or targets is not None) and (chunks is None or decodes is not None):
        raise ValueError("keep_depths and targets are about prompt chunks: chunks alone")
    xs, pool, states, *depths = paged.forward(
        params, cfg, pool, tuple(groups), tuple(tokens), loops, window, exit, tuple(seeds), keep_state=True,
        prompts=(True,) * (chunks is not None) + (False,) * (decodes is not None), keep_depths=keep_depths)
    if targets is not None:
        none = jnp.full(chunks.final.shape, -1, jnp.int32)
        return Emitted(none, none, scores=chunk_scores(params, cfg, xs[0], targets, top)), None, pool, state
    if decodes is None:
        warm, logits = _chunk_ends(params, cfg, chunks, xs[0], states[0])
        ctok, state = start_rows(state, chunks.slot, logits, chunks.final, warm, chunks.mask)
        if keep_depths:
            d, e = depths
            ctok = ctok.replace(logits=logits, depths=d, stream=states[0] if e is None else rec.carry(states[0], e))
        return ctok, None, pool, state
    dlogits = tf.lm_head(params, cfg, xs[-1][:, 0])
    if chunks is None:
        dtok, state = _next_tokens(state, decodes, dlogits)
        return None, dtok, pool, state
    # both groups' tokens by one sampler over their rows: a copy of it is most of a step program's
    # compile (SmolLM2's; docs/benchmarks.md), and each row's token depends on its own row alone
    warm, clogits = _chunk_ends(params, cfg, chunks, xs[0], states[0])
    cseen, creq = _start_inputs(state, chunks.slot, chunks.final, chunks.mask)
    fed, dreq = _next_inputs(state, decodes)
    dseen, dcounts = R.penalized(fed, decodes.slot)
    bc, V = clogits.shape
    full = lambda m, b: jnp.full((b, G.words(V)), -1, jnp.int32) if m is None else m  # noqa: E731 (-1: every bit)
    if (creq.allowed is None) != (dreq.allowed is None):
        creq, dreq = creq.replace(allowed=full(creq.allowed, bc)), dreq.replace(allowed=full(dreq.allowed, len(dseen)))
    tok = select_tokens(jnp.concatenate([clogits, dlogits]), jnp.concatenate([cseen, dseen]),
                        jax.tree.map(lambda a, b: jnp.concatenate([a, b]), creq, dreq),
                        jnp.concatenate([jnp.zeros((bc,), jnp.int32), decodes.steps]),
                        jnp.concatenate([jnp.zeros_like(dcounts, shape=(bc, V)), dcounts]))
    dtok, state = _next_tokens_with(state, decodes, fed, tok[bc:])  # (fed from the rows before: the
    ctok, state = _start_rows_with(state, chunks.slot, tok[:bc], chunks.final, warm)  # chunks' rows are written after)
    return ctok, dtok, pool, state


def _chunk_ends(params, cfg, chunks: Chunks, x: jax.Array, loop_state: jax.Array):
    """The chunks' last positions: their loop states [b, D] and next-token logits [b, V]."""
    last = jnp.maximum(chunks.rows.n_new - 1, 0)
    warm = jnp.take_along_axis(loop_state, last[:, None, None], axis=1)[:, 0]
    return warm, paged.last_logits(params, cfg, x, chunks.rows)


def _start_inputs(state: Requests, slot: jax.Array | None, live: jax.Array, mask: jax.Array | None):
    """What the first tokens of request rows `slot` [b] are chosen with: (seen [b, V], knobs)."""
    return _take(state.rows.seen, slot), _knobs(state, slot, live, mask)


def start_rows(state: Requests, slot: jax.Array | None, logits: jax.Array, live: jax.Array,
               warm: jax.Array | None = None, mask: jax.Array | None = None) -> tuple[Emitted, Requests]:
    """Request rows `slot` [b] (None: a call's rows in order) whose prompts ended, live [b]:
    their first tokens chosen from logits [b, V] (sampling step 0; mask [b, W]: the tokens each
    may choose), kept as `last` (and warm [b, D] their last loop state) and recorded. Returns
    (`Emitted` [b], state)."""
    seen, req = _start_inputs(state, slot, live, mask)
    return _start_rows_with(state, slot, select_tokens(logits, seen, req, jnp.int32(0)), live, warm)


def _start_rows_with(state: Requests, slot: jax.Array | None, tok: jax.Array, live: jax.Array,
                     warm: jax.Array | None = None) -> tuple[Emitted, Requests]:
    """`start_rows` once the first tokens tok [b] are chosen."""
    rows = state.rows
    new = rows.replace(last=tok) if warm is None else rows.replace(last=tok, warm=warm.astype(rows.warm.dtype))
    if slot is None:
        rows = _where(live, new, rows)
    else:
        at = jnp.where(live, slot, FILLER)
        rows = rows.replace(last=rows.last.at[at].set(tok, mode="drop"))
        if warm is not None:
            rows = rows.replace(warm=rows.warm.at[at].set(new.warm, mode="drop"))
    state, stops = _record(state.replace(rows=rows), slot, tok, live)
    return Emitted(tok, stops), state


def _next_tokens(state: Requests, decodes: Decodes, logits: jax.Array, warm: jax.Array | None = None,
                 live: jax.Array | None = None):
    """Each decode row's next token from its logits [b, V] by the rule of every decode loop
    (`row_state.feed`, then `choose`); warm [b, D]: the rows' new loop states (adaptive depth).
    A filler row's slot drops its writes; a call's rows (slot None) not live [b] keep theirs.
    Returns (`Emitted` [b], state)."""
    fed, req = _next_inputs(state, decodes, live)
    return _next_tokens_with(state, decodes, fed, R.choose(fed, logits, req, decodes.steps, decodes.slot), warm, live)


def _next_inputs(state: Requests, decodes: Decodes, live: jax.Array | None = None):
    """The decode rows' last tokens fed (`row_state.feed`), and their knobs: (the fed rows, knobs)."""
    s = decodes.slot
    live = (s != FILLER) if s is not None else live
    fed = _where(live, R.feed(state.rows), state.rows) if s is None else R.feed(state.rows, s)
    return fed, _knobs(state, s, live, decodes.mask)


def _next_tokens_with(state: Requests, decodes: Decodes, fed: R.RowState, tok: jax.Array,
                      warm: jax.Array | None = None, live: jax.Array | None = None):
    """`_next_tokens` once the rows are fed and their tokens tok [b] chosen."""
    s = decodes.slot
    live = (s != FILLER) if s is not None else live
    if s is None:  # a call's rows in order: one-hots and selects, no scatter
        new = fed.replace(last=tok) if warm is None else fed.replace(last=tok, warm=warm.astype(fed.warm.dtype))
        fed = _where(live, new, fed)
    else:
        fed = fed.replace(last=fed.last.at[s].set(tok, mode="drop"))
        if warm is not None:
            fed = fed.replace(warm=fed.warm.at[s].set(warm.astype(fed.warm.dtype), mode="drop"))
    state, stops = _record(state.replace(rows=fed), s, tok, live)
    return Emitted(tok, stops), state


def decode_forward(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, state: Requests, decodes: Decodes,
                   loops: int, window: int = 0, exit: exits.Exit | None = None):
    """The plain decode iteration's first half: each row's last token (state.rows.last) fed at
    rows.start (a row with n_new 0 writes nothing) -> (logits [b, V], pool). `decode_steps`
    runs it and `decode_choose` in one program; a driver that must read a step's tokens before
    the next choice (a grammar's masks) dispatches them apart and fills the masks while the
    next forward runs (`paged_decode.decode_constrained`)."""
    slot = decodes.slot
    x, pool = paged.forward(params, cfg, pool, decodes.rows, _take(state.rows.last, slot)[:, None], loops, window,
                            exit, _take(state.req.seed, slot))
    return tf.lm_head(params, cfg, x[:, 0]), pool


def decode_choose(state: Requests, decodes: Decodes, logits: jax.Array, live: jax.Array | None = None):
    """The plain decode iteration's second half: each row's next token from its logits [b, V]
    (`_next_tokens`, decodes.mask applied), rows not live [b] (a call's) unchanged.
    Returns (`Emitted` [b], state)."""
    return _next_tokens(state, decodes, logits, live=live)


@struct.dataclass
class Burst:
    """What `decode_steps` returns for its b rows."""

    out: Emitted  # [b, n_max]: each row's tokens in order, -1 past its last
    n: Annotated[jax.Array, "int32[b]"]  # tokens each row emitted
    passes: Annotated[jax.Array, "int32[b, n_max]"] | None  # adaptive depth: the passes each token ran
    rounds: Annotated[jax.Array, "int32[]"]  # the loop's iterations (speculative: rounds)
    accepted: Annotated[jax.Array, "int32[b]"]  # speculative: the drafts kept


def decode_steps(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, state: Requests, decodes: Decodes,
                 n: jax.Array, loops: int, n_max: int, exit: exits.Exit | None = None, window: int = 0,
                 adaptive: bool = False, draft_loops: int = 0, lookahead: int = 0, grammar: jax.Array | None = None):
    """Up to n (traced, 1 <= n <= n_max) iterations of one decode step in one `while_loop`, the
    one device token loop: the engine's decode rows' step when no prompt chunk runs beside them
    (n = 1), or a burst when nothing waits (the host's work per dispatch spread over n tokens);
    `Model.generate`'s whole decode loop and `Conversation`'s bursts. The step is static: plain
    (`step`'s decode group), adaptive (`step_adaptive`: each row's passes stop at its exit) or
    speculative (lookahead > 0: a round of `step_speculative`, up to lookahead + 1 tokens).
    Iteration i feeds each row's last token at rows.start + (tokens it emitted) and chooses the
    next; a row that emitted decodes.left tokens, or ended a stop sequence, idles (writes
    nothing, keeps its state); the loop ends when no row is left. window: a static cache_window
    for every row (else each row's, rows.window). grammar (int32 [], a call's rows in order):
    structured output, each iteration asking the host for the rows' masks after their last
    tokens (`grammar.host_masks`, an ordered callback) and ending a row whose grammar is done
    (a speculative round: its drafts and verify positions under the masks, `round_paged`).
    Returns (`Burst`, pool, state)."""
    k, b = lookahead, decodes.steps.shape[0]
    if decodes.mask is not None and (n_max != 1 if not k else grammar is None):  # a mask holds for one token
        # (a speculative round's: its first position's, the drafts' asked of the host by `grammar`)
        raise ValueError(f"grammar masks need one plain or adaptive step a dispatch, or a speculative round "
                         f"with a grammar, got n_max={n_max}, lookahead={k}")
    at = jnp.arange(n_max)[None, :]

    def live(c):
        return (c["count"] < decodes.left) & ~c["stopped"]

    def body(c):
        on, count = live(c), c["count"]
        slot = None if decodes.slot is None else jnp.where(on, decodes.slot, FILLER)
        d = decodes.replace(rows=decodes.rows.replace(start=decodes.rows.start + count, n_new=decodes.rows.n_new * on),
                            slot=slot, steps=decodes.steps + count)
        mask = decodes.mask  # (the engine's: filled after it read the rows' tokens)
        if grammar is not None and mask is None:  # the host's matchers take each row's last token, then say
            # what may follow (only the choice reads the answer, so the forward need not wait for it;
            # a row whose grammar is done writes its last token's K/V and chooses nothing)
            mask, done = G.device_masks(grammar, c["state"].rows.last, on, cfg.vocab_size)
            on, c = on & ~done, dict(c, stopped=c["stopped"] | done)
            d = d if k else d.replace(mask=mask)  # (a speculative round takes it as its first position's)
        passes, a = None, jnp.zeros((b,), jnp.int32)
        if k:
            got, a, pool, state = step_speculative(params, cfg, c["pool"], c["state"], d, loops, draft_loops, k, exit,
                                                   window, live=on,
                                                   grammar=None if grammar is None else (grammar, mask))
        elif adaptive:
            got, passes, pool, state = step_adaptive(params, cfg, c["pool"], c["state"], d, loops, live=on)
        else:
            logits, pool = decode_forward(params, cfg, c["pool"], c["state"], d, loops, window, exit)
            got, state = decode_choose(c["state"], d, logits, on)
        tokens, stops = got.tokens.reshape(b, -1), got.stops.reshape(b, -1)
        j = jnp.arange(k + 1)[None, :]
        hit = stops >= 0
        valid = on[:, None] & (j <= a[:, None]) & (count[:, None] + j < decodes.left[:, None]) & (
            jnp.cumsum(hit, axis=1) - hit == 0)  # up to a round's kept tokens, max_tokens and the first stop
        out = c["out"]
        for i in range(k + 1):  # token i of the iteration at the row's count + i (selects, no scatter)
            put = valid[:, i:i + 1] & (at == (count + i)[:, None])
            out = Emitted(jnp.where(put, tokens[:, i:i + 1], out.tokens), jnp.where(put, stops[:, i:i + 1], out.stops))
            if passes is not None:
                c = dict(c, passes=jnp.where(put, passes[:, None], c["passes"]))
        return dict(c, i=c["i"] + 1, pool=pool, state=state, out=out, count=count + jnp.sum(valid, axis=1),
                    stopped=c["stopped"] | jnp.any(valid & hit, axis=1), accepted=c["accepted"] + jnp.where(on, a, 0))

    c = dict(i=jnp.int32(0), pool=pool, state=state, count=jnp.zeros((b,), jnp.int32),
             stopped=jnp.zeros((b,), bool), accepted=jnp.zeros((b,), jnp.int32),
             out=Emitted(jnp.full((b, n_max), -1, jnp.int32), jnp.full((b, n_max), -1, jnp.int32)),
             passes=jnp.zeros((b, n_max), jnp.int32) if adaptive else None)
    c = jax.lax.while_loop(lambda c: (c["i"] < n) & jnp.any(live(c)), body, c)
    return Burst(c["out"], c["count"], c["passes"], c["i"], c["accepted"]), c["pool"], c["state"]


def requests_of(seen: jax.Array, req: Knobs, d_model: int, dtype, pol: ad.Policy | None = None,
                warm: jax.Array | None = None) -> Requests:
    """N request rows (slots 0..N-1) of one call, before their first tokens (`start_rows`, or a
    step's final chunks): prompts seen [N, V], knobs req [N], exit rules pol [N] (None: every
    pass) and warm [N, D] the loop states they start from (adaptive depth; a prefix's). Built
    on the host and put on the device as they are: zeros and what the caller gave, no program."""
    N = seen.shape[0]
    if pol is None:
        pol = jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (N,)), ad.EVERY_PASS)
    warm = np.zeros((N, d_model), dtype) if warm is None else np.broadcast_to(np.asarray(warm, dtype), (N, d_model))
    tail = np.full((N, req.stop.tokens.shape[-1]), -1, np.int32)
    return jax.device_put(Requests(RowState.start(seen, np.zeros((N,), np.int32), warm), req, pol, tail))


def step_adaptive(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, state: Requests, decodes: Decodes,
                  loops: int, live: jax.Array | None = None):
    """The decode rows' next tokens with adaptive depth: each row's passes stop at its exit (its
    request's `pol`; kind NONE: every pass). live [b]: a call's rows (slot None) that step.
    Returns (`Emitted` [b], passes run [b], pool, state)."""
    s = decodes.slot
    out = pa.forward_decode(params, cfg, pool, decodes.rows, _take(state.rows.last, s), loops, _take(state.pol, s),
                            _take(state.req.seed, s), _take(state.rows.warm, s))
    tok, state = _next_tokens(state, decodes, out.logits, out.state, live)
    return tok, out.depth, out.pool, state


def step_speculative(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, state: Requests, decodes: Decodes,
                     loops: int, draft_loops: int, lookahead: int, exit: exits.Exit | None = None, window: int = 0,
                     live: jax.Array | None = None, grammar: tuple | None = None):
    """One round of self-speculative decoding for the decode rows (`speculative.round_paged`:
    drafts at `draft_loops` over their pages, one verify chunk at `loops`; greedy: plain
    decoding's tokens). decodes.steps: tokens each row emitted (its round's keys are
    fold_in(keys(steps), DRAFT_STREAM)); live [b]: a call's rows (slot None) that step;
    grammar (call, masks [b, W] after the rows' last tokens): structured output (`round_paged`).
    Returns (`Emitted` [b, k + 1]: d_1 .. d_a then the next token, each row's tokens up to a
    stop; kept a [b], pool, state)."""
    s = decodes.slot
    live = (s != FILLER) if s is not None else live
    req = _knobs(state, s, live)
    keys = fold_in(req.keys(decodes.steps), DRAFT_STREAM)
    rows = _take(state.rows, s)
    tokens, a, seen, counts, pool = round_paged(params, cfg, pool, decodes.rows, rows.last, rows.seen, rows.counts,
                                                req, keys, loops, draft_loops, lookahead, window, exit,
                                                None if grammar is None else (grammar[0], grammar[1], live))
    nxt = jnp.take_along_axis(tokens, a[:, None], axis=1)[:, 0]
    new = rows.replace(seen=seen, counts=counts, last=nxt)
    state = state.replace(rows=_where(live, new, state.rows) if s is None else _put(state.rows, s, new))
    stops, stopped = [], jnp.zeros(live.shape, bool)
    for j in range(lookahead + 1):  # the round's tokens in order, up to a stop
        state, hit = _record(state, s, tokens[:, j], live & (j <= a) & ~stopped)
        stops.append(hit)
        stopped |= hit >= 0
    return Emitted(tokens, jnp.stack(stops, axis=1)), a, pool, state
