"""The `Model` path on pages: one call's prefix, prompts and outputs in a page pool, run by the
engine's programs (`compiled.SHARED`: the step body of `step.py`) over the call's rows in order.

    a call      N rows; row i = the prefix (shared, or none) + suffix i + up to max_tokens tokens
    its pages   the prefix's full pages once, shared by every row's table; then each row's own
                pages (the prefix's partial last page copied into each row's first: rows write
                after it); the pool holds nothing else and lives for the call
    rows        the call's request rows (`step.requests_of`: knobs, seen tokens, exit rules)
    prefill     the suffixes as the step's chunk group [N, T] (`prefill`: `step.step`, or with
                exit_in_prefill `step.step(in_prefill=True)`, each prompt exiting as a whole); each
                row's first token chosen in the step that ends its prompt
    decode      `decode`: the engine's step body's `step.decode_steps` over the call's rows in
                order, one `lax.while_loop` of decode steps [N, 1] (plain or adaptive) or of
                speculative rounds, stops and max_tokens on the device

A `PrefixCache` stays a dense segment (immutable, saved and loaded as it is); a call copies its
stored values into the call's pages once (`model.page_pool.load_segment`, as the engine loads a
store entry) and reads them there. The pool is in the model's working mode: float32 K/V for an
h mode (the prefix rebuilt once per call; 2x faster than rebuilding K/V from h every step,
docs/benchmarks.md), the stored mode otherwise. Attention reads each row's live pages only where a kernel
runs (`paged.attention_kernel`), so a table sized for the whole call costs nothing per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..model import cache as kvc
from ..model import paged
from ..model import page_pool
from ..model import exits
from ..model.config import ModelConfig
from ..model.params import Params
from . import grammar as G
from . import step as St
from .compiled import SHARED
from .sampling import Knobs


# A long prompt's prefill runs in chunks of this many tokens: attention's [T, T] scores of one
# chunk would grow with the square of the prompt (a 32 k-token prompt: gigabytes a layer), and a
# chunk's windowed layers read only their ring beside it.
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Layout:
    """Where a call's rows live: page tables [N, R] (the prefix's `shared` full pages first in
    every row, then the row's `own`; entries past them are never read or written), and the
    pool's size."""

    tables: np.ndarray
    shared: int
    own: int
    n_pages: int
    slot_of: np.ndarray | None = None  # [n_pages] each page's local slot (-1: none); None: no local slots
    n_local: int = 0


def layout(prefix_len: int, room: int, n_rows: int, page_size: int = page_pool.PAGE_SIZE, window: int = 0,
           step: int = 1) -> Layout:
    """Page tables for n_rows rows of prefix_len shared positions + `room` own positions each
    (the longest suffix, max_tokens, a verify chunk). The table's length and the pool's come
    in buckets (`cache.bucket`, at least `page_pool.MIN_TABLE` pages), so that calls of nearby
    lengths share programs; a row is given only the pages it can write.

    window > 0: the model's local layers (`page_pool.local_layers`, their windows at most `window`)
    get local slots when that saves some: the prefix's pages a first query's window reads, and
    for each row a ring of slots over its own pages (page i in slot i mod ring) as long as its
    window and the most positions one step writes (`step`; or all its pages), so a page is
    overwritten only once no query reads it."""
    shared = prefix_len // page_size
    own = -(-(prefix_len + room) // page_size) - shared
    R = max(page_pool.MIN_TABLE, -(-kvc.bucket(prefix_len + room) // page_size))
    tables = np.zeros((n_rows, R), np.int32)
    tables[:, :shared] = np.arange(shared)
    tables[:, shared:shared + own] = shared + np.arange(n_rows * own).reshape(n_rows, own)
    n_pages = kvc.bucket(shared + n_rows * own, page_pool.MIN_TABLE)
    ring = min(own, -(-(window - 1) // page_size) + -(-step // page_size) + 1)
    first = max(0, prefix_len - window + 1) // page_size
    n_local = kvc.bucket(shared - first + n_rows * ring, 1)
    if window <= 0 or n_local >= n_pages:
        return Layout(tables, shared, own, n_pages)
    slot_of = np.full((n_pages,), -1, np.int32)
    slot_of[first:shared] = np.arange(shared - first)
    rows = np.arange(n_rows)[:, None] * ring + np.arange(own)[None] % ring  # [n_rows, own]
    slot_of[shared:shared + n_rows * own] = (shared - first + rows).reshape(-1)
    return Layout(tables, shared, own, n_pages, slot_of, n_local)


def pool_nbytes(cfg: ModelConfig, loops: int, lay: Layout) -> int:
    size = lambda n, layers: n * page_pool.page_nbytes(cfg.storage.working, layers, cfg.n_kv_heads,  # noqa: E731
                                                   page_pool.PAGE_SIZE, cfg.head_dim, cfg.d_model)
    local = len(page_pool.local_layers(cfg)) if lay.slot_of is not None else 0
    compact = 0 if cfg.share.full else cfg.share.slots(loops) * cfg.loop_blocks  # beside the pass slots
    return size(lay.n_pages, cfg.n_cache_layers(loops) - local + compact) + size(lay.n_local, local)


def empty_pool(cfg: ModelConfig, loops: int, n_pages: int, lay: Layout | None = None,
               compact: bool = False) -> page_pool.PagedKV:
    """A call's pool, in the model's working mode: an h mode's call holds float32 K/V (rebuilt
    from h once, when the prefix is loaded, not at every step; as the model stores them); with
    a layout's local slots, its local layers in them. compact (a compact `kv_share`): an
    engine's compact pool whose every page has its pass slot, which the call's prompts fill
    (`page_pool.swap`) before `collapse` turns them into the compact layers its decode reads."""
    local = None if lay is None or lay.slot_of is None else lay.n_local
    pool = SHARED.empty_pool(cfg, loops, n_pages, page_pool.PAGE_SIZE, cfg.storage.working, local,
                             n_pages if compact else None)
    if compact:
        pool = pool.replace(aside_of=jnp.arange(n_pages, dtype=jnp.int32))
    return pool if local is None else pool.replace(slot_of=jnp.asarray(lay.slot_of))


def load_prefix(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, seg, prefix_len: int,
                lay: Layout) -> page_pool.PagedKV:
    """The prefix's positions into the call's pages: its full pages once, its partial last page
    into every row's first own page (row 0's written, then copied). A prefix stored in another
    mode than the pool's (h) is rebuilt on the way, by the same program."""
    rebuilt = (params, cfg) if seg.kv_mode != pool.kv_mode else (None, None)
    pool = SHARED.load_segment(pool, seg, jnp.asarray(lay.tables[0]), jnp.int32(0), jnp.int32(prefix_len), *rebuilt)
    rows = lay.tables.shape[0]
    if prefix_len % pool.page_size and rows > 1:
        src = np.full((rows - 1,), lay.tables[0, lay.shared], np.int32)
        pool = SHARED.copy_pages(pool, jnp.asarray(src), jnp.asarray(lay.tables[1:, lay.shared]))
    return pool


def collapse(pool: page_pool.PagedKV, loops: int) -> page_pool.PagedKV:
    """A compact call's pool (`empty_pool(compact=True)`) once its prompts are done: every page's
    passes into its compact layers (the engine's `collapse_pages`), the pass slots dropped; the
    decode steps read the compact store."""
    pool = SHARED.collapse_pages(pool, jnp.arange(pool.n_pages, dtype=jnp.int32), loops=loops)
    return pool.replace(aside=None, aside_of=None, aside_share="full")


class Prefilled(NamedTuple):
    """What `prefill` returns: each row's first token and the stop sequence it ends (-1: none),
    the passes its prompt ran (None: every pass), the pool and the request rows; with
    keep_depths, each prompt's last token's logits [N, V] and depth states [N, n_pre + loops, D],
    and every position's stream after the last pass [N, longest, D | 2D] (`step.Emitted.stream`)."""
    first: jax.Array
    stop: jax.Array
    depth: jax.Array | None
    pool: page_pool.PagedKV
    state: St.Requests
    logits: jax.Array | None = None
    depths: jax.Array | None = None
    stream: jax.Array | None = None


def prefill(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, state: St.Requests, tables: np.ndarray,
            prefix_len: int, suffixes: list, prior_logits: jax.Array, loops: int, window: int,
            exit: exits.Exit | None = None, chunk: int = 0, adaptive: bool = False, exits: bool = False,
            windows: np.ndarray | None = None, masks: np.ndarray | None = None, keep_depths: bool = False) -> Prefilled:
    """N rows' suffixes (row i's prompt after the shared prefix_len positions; possibly empty)
    into their pages (tables [N, R]) by the step's chunk group over the call's rows in order,
    `chunk` tokens of each a step (0: each whole); their first tokens chosen in the step that
    ends them (a row with no suffix: from the prefix's prior_logits [V]). adaptive: the passes
    each prompt ran are kept (every pass, or with `exits` each prompt one chunk exiting as a
    whole at its row's exit rule, `step.step(in_prefill=True)`); a suffix may be streams entering
    the passes [n, D | 2D] instead of ids (`fill_prefix`); windows [N]: each row's cache_window;
    masks [N, W]: the tokens each row's first may be (structured output; None: any); keep_depths:
    each prompt's last token's logits and depth states too (`step.step`; every row's suffix
    non-empty)."""
    N = len(suffixes)
    lens = np.array([len(x) for x in suffixes], np.int32)
    stream = np.ndim(suffixes[0]) == 2  # streams entering the passes [n, D | 2D] (`fill_prefix`), not ids
    first = stop = logits = depths = None
    streams = []
    depth = jnp.full((N,), loops, jnp.int32) if adaptive else None
    if (lens == 0).any():  # the prefix alone: its logits choose
        got, state = SHARED.start_rows(state, None, jnp.broadcast_to(prior_logits, (N, cfg.vocab_size)),
                                       jnp.asarray(lens == 0), mask=masks)
        first, stop = got.tokens, got.stops
    step = max(int(lens.max()), 1) if exits or not chunk else chunk
    for at in range(0, int(lens.max()), step):
        n_new = np.clip(lens - at, 0, step).astype(np.int32)
        final = (lens > at) & (lens <= at + step)
        width = (kvc.exit_length if exits else kvc.bucket)(int(n_new.max()))
        tokens = np.zeros((N, width, *np.shape(suffixes[0])[1:]), suffixes[0].dtype if stream else np.int32)
        for i, x in enumerate(suffixes):
            tokens[i, :n_new[i]] = x[at:at + n_new[i]]
        chunks = St.Chunks(paged.Rows(tables, np.full((N,), prefix_len + at, np.int32), n_new, windows), tokens, None,
                           final, masks)
        got, _, pool, state = (SHARED.step(params, cfg, pool, state, chunks, None, loops=loops, in_prefill=True)
                               if exits else SHARED.step(params, cfg, pool, state, chunks, None, loops=loops, exit=exit,
                                                         window=window, keep_depths=keep_depths))
        if exits:
            depth = jnp.where(jnp.asarray(final), got.passes, depth)
        live = jnp.asarray(final)
        first = got.tokens if first is None else jnp.where(live, got.tokens, first)
        stop = got.stops if stop is None else jnp.where(live, got.stops, stop)
        if keep_depths:
            logits = got.logits if logits is None else jnp.where(live[:, None], got.logits, logits)
            depths = got.depths if depths is None else jnp.where(live[:, None, None], got.depths, depths)
            streams.append(got.stream[:, :int(n_new.max())])
    return Prefilled(first, stop, depth, pool, state, logits, depths,
                     jnp.concatenate(streams, axis=1) if keep_depths else None)


def prefix_pool(cfg: ModelConfig, n_tokens: int, loops: int, beside: int = 0,
                what: str = "a prefix's pages") -> tuple[page_pool.PagedKV, np.ndarray]:
    """A prefix's pages while it is built: room for its n_tokens positions at depth `loops`,
    every layer on the pages (no local slots: the dense segment's rings are gathered from
    them), stored in the model's mode (an h mode's segment holds h; a compact `kv_share`'s
    prompts run every pass, as the dense segment holds them). The pages and `beside` bytes more
    (what is built with them) are checked to fit before anything is allocated. Returns (pool,
    its page table [R])."""
    lay = layout(0, n_tokens, 1)
    pages = lay.n_pages * page_pool.page_nbytes(cfg.storage, cfg.n_cache_layers(loops), cfg.n_kv_heads,
                                                page_pool.PAGE_SIZE, cfg.head_dim, cfg.d_model)
    kvc.check_fits(pages + beside, what)
    return SHARED.empty_pool(cfg, loops, lay.n_pages, page_pool.PAGE_SIZE, cfg.storage, None, None), lay.tables[0]


def fill_prefix(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, pages: np.ndarray, k: int,
                inputs: np.ndarray, loops: int, window: int, exit: exits.Exit | None, seed: int, chunk: int,
                capacity: int, rings: tuple = (), ring_capacity: int = 0):
    """One prompt's positions k.. fed by the step (`prefill`, `chunk` a step, keeping the last
    token's depth states and every position's stream) into `pool`, whose pages [R] hold the
    positions before k, then gathered into a dense segment of `capacity` slots (its local
    layers' rings: `rings`, `ring_capacity`; `page_pool.to_segment`). inputs: token ids [n - k],
    or streams entering the passes [n - k, D | 2D] (a deeper prefix's: `loops` more passes
    from the stream a prefix kept, the pre layers not run). Returns (segment, next-token logits
    [V], depth states [n_pre + loops, D] (streams: [loops, D]), every fed position's stream after
    the last pass [n - k, D | 2D])."""
    n = k + len(inputs)
    state = St.requests_of(np.zeros((1, cfg.vocab_size), bool), Knobs.make(1, seeds=[seed], max_tokens=1),
                           d_model=cfg.d_model, dtype=cfg.compute_dtype)
    fill = prefill(params, cfg, pool, state, pages[None], k, [inputs], None, loops, window, exit, chunk=chunk,
                   keep_depths=True)
    own = SHARED.to_segment(fill.pool, jnp.asarray(pages), jnp.int32(n), capacity=capacity, rings=rings,
                            ring_capacity=ring_capacity)
    return own, fill.logits[0], fill.depths[0], fill.stream[0]


@dataclass(frozen=True)
class Decoded:
    """What `decode` returns: row i emitted tokens[i, :n[i]] (on the device)."""

    first: jax.Array  # [N] the prompts' tokens
    burst: St.Burst  # the loop's
    first_depth: jax.Array | None  # [N] adaptive depth: the passes the prompts ran
    pool: page_pool.PagedKV  # the call's pages after it

    @property
    def tokens(self) -> jax.Array:  # [N, S], -1 past each row's end
        return jnp.concatenate([self.first[:, None], self.burst.out.tokens], axis=1)

    @property
    def n(self) -> jax.Array:
        return 1 + self.burst.n

    @property
    def passes(self) -> jax.Array | None:  # [N, S] adaptive depth: the passes each token ran
        if self.burst.passes is None:
            return None
        return jnp.concatenate([self.first_depth[:, None], self.burst.passes], axis=1)

    @property
    def rounds(self) -> jax.Array:  # the loop's iterations (speculative: rounds)
        return self.burst.rounds

    @property
    def accepted(self) -> jax.Array:  # speculative: drafts kept [N]
        return self.burst.accepted


def decode(params: Params, cfg: ModelConfig, rows: paged.Rows, fill: Prefilled, req: Knobs, loops: int, window: int,
           out_len: int, exit: exits.Exit | None = None, draft_loops: int = 0, lookahead: int = 0,
           matchers: list | None = None) -> Decoded:
    """Emit up to req.max_tokens (<= out_len) tokens for each of N rows by the engine's step body
    (`step.decode_steps`, one `lax.while_loop` on the device, over the call's rows in order).
    rows: page tables [N, R], start [N] the position each row's first token (fill.first) is fed
    at. Token i is chosen from the logits token i - 1 produced (n tokens cost n - 1 steps); the
    loop ends when every row is done. lookahead > 0: rounds of self-speculative decoding
    (`lookahead` drafts at `draft_loops`; the pages need room for lookahead + 1 positions past
    the last emitted token). fill.depth not None (the prompts' passes): adaptive depth, each
    step's passes stopping at each row's exit rule (`state.pol`). matchers [N]: structured
    output, each row's grammar matcher (None: free), asked for its masks once an iteration
    from inside the loop (`grammar.device_masks`; the call blocks until the loop is done)."""
    N = rows.start.shape[0]
    left = jnp.where(fill.stop >= 0, 0, jnp.asarray(req.max_tokens) - 1)
    decodes = St.Decodes(rows, None, np.ones((N,), np.int32), left)
    n_max = max(out_len - 1, 1)
    call = None if matchers is None else G.register(matchers)
    try:
        got, pool, _ = SHARED.decode_steps(params, cfg, fill.pool, fill.state, decodes, np.int32(n_max), loops=loops,
                                           n_max=n_max, exit=exit, window=window, adaptive=fill.depth is not None,
                                           draft_loops=draft_loops, lookahead=lookahead,
                                           grammar=None if call is None else np.int32(call))
        if call is not None:
            jax.block_until_ready(got)
    finally:
        if call is not None:
            G.release(call)
    return Decoded(fill.first, got, fill.depth, pool)


# how a `Model` call with a grammar decodes: "host" (`decode_constrained`: a plain step's forward
# and choice dispatched apart, the masks filled while the forward runs; 0.88-0.98x of free
# decoding, docs/benchmarks.md) or "device" (`decode`: the loop on the device asks the host for
# each iteration's masks by an ordered callback; 0.73-0.78x). Adaptive depth's step is one
# program (no forward to overlap): its calls take the device loop either way, but on a mesh.
GRAMMAR_LOOP = "host"


def decode_constrained(params: Params, cfg: ModelConfig, rows: paged.Rows, fill: Prefilled, req: Knobs, loops: int,
                       window: int, out_len: int, matchers: list, exit: exits.Exit | None = None) -> Decoded:
    """`decode` for rows of which some follow a grammar (matchers [N]: each row's llguidance
    matcher, None: free), driven from the host. A plain step is two dispatches a token
    (`step.decode_forward`, then `step.decode_choose` with the rows' masks): iteration i's
    forward is queued before the host reads iteration i - 1's tokens, so the matchers take them
    and fill the next masks (`grammar.fill_masks`) while the device runs it; a row that ended
    in the choice before has fed one token for nothing. Adaptive depth: one `decode_steps`
    iteration a dispatch (its forward and choice are one program). A row ends at max_tokens, a
    stop sequence, or when its grammar is complete (its end-of-sequence token emitted). The same
    step body, keys and stop rule as `decode`: free rows emit its tokens."""
    N = rows.start.shape[0]
    first, stop = np.asarray(fill.first), np.asarray(fill.stop)
    max_tokens = np.asarray(req.max_tokens)
    out = np.full((N, max(out_len - 1, 1)), -1, np.int32)
    stops, passes = np.full_like(out, -1), np.zeros_like(out) if fill.depth is not None else None
    count = np.zeros((N,), np.int32)  # tokens chosen past the first (the one in flight counted)
    done = (stop >= 0) | (max_tokens <= 1)
    for r, m in enumerate(matchers):
        done[r] |= m is not None and G.consume(m, int(first[r]))
    pool, state = fill.pool, fill.state
    pending = None  # the choice not read yet: (its tokens, its rows, where they go)

    def read(got, which, at):
        em = got.out if passes is not None else got  # (adaptive: a one-iteration `Burst`)
        tok, hit = np.asarray(em.tokens).reshape(N, -1)[:, 0], np.asarray(em.stops).reshape(N, -1)[:, 0]
        for r, c in zip(which, at):
            out[r, c], stops[r, c] = tok[r], hit[r]
            if passes is not None:
                passes[r, c] = int(got.passes[r, 0])
            done[r] |= hit[r] >= 0 or (matchers[r] is not None and G.consume(matchers[r], int(tok[r])))

    live = ~done & (count < max_tokens - 1)  # the rows whose next token is chosen (as far as the host knows)
    while live.any():
        step = St.Decodes(rows.replace(start=rows.start + count, n_new=live.astype(np.int32)), None, 1 + count,
                          live.astype(np.int32))
        if passes is None:
            logits, pool = SHARED.decode_forward(params, cfg, pool, state, step, loops=loops, window=window, exit=exit)
        if pending is not None:  # the choice before, read while this forward runs
            read(*pending)
            live = live & ~done
            if not live.any():
                pending = None
                break
        step = step.replace(left=live.astype(np.int32),
                            mask=G.fill_masks([m if on else None for m, on in zip(matchers, live)], cfg.vocab_size))
        if passes is None:
            got, state = SHARED.decode_choose(state, step, logits, jnp.asarray(live))
        else:  # adaptive: the forward's passes depend on the row, one program
            got, pool, state = SHARED.decode_steps(params, cfg, pool, state, step, np.int32(1), loops=loops, n_max=1,
                                                   exit=exit, window=window, adaptive=True)
        pending = (got, np.flatnonzero(live), count[live])
        count = count + live
        live = live & (count < max_tokens - 1)
        if passes is not None:  # (no next forward queued: read now)
            read(*pending)
            pending, live = None, live & ~done
    if pending is not None:
        read(*pending)
    burst = St.Burst(St.Emitted(jnp.asarray(out), jnp.asarray(stops)), jnp.asarray(count),
                     None if passes is None else jnp.asarray(passes), jnp.int32(out_len - 1),
                     jnp.zeros((N,), jnp.int32))
    return Decoded(fill.first, burst, fill.depth, pool)


def lower_decode(params: Params, cfg: ModelConfig, pool: page_pool.PagedKV, rows: paged.Rows, req: Knobs, loops: int,
                 out_len: int, window: int = 0, exit: exits.Exit | None = None, **kind) -> jax.stages.Lowered:
    """The program `decode` runs for N rows of these shapes (kind: `adaptive`, or `draft_loops`
    and `lookahead`), lowered, not run: for XLA's memory analysis and its collectives. Arrays
    may be abstract (`jax.ShapeDtypeStruct`, with shardings)."""
    N = rows.start.shape[0]
    seen = jax.ShapeDtypeStruct((N, cfg.vocab_size), jnp.bool_)
    state = jax.eval_shape(partial(St.requests_of, d_model=cfg.d_model, dtype=cfg.compute_dtype), seen, req)
    decodes = St.Decodes(rows, None, np.ones((N,), np.int32), np.asarray(req.max_tokens) - 1)
    n_max = max(out_len - 1, 1)
    return SHARED.decode_steps.lower(params, cfg, pool, state, decodes, np.int32(n_max), loops=loops, n_max=n_max,
                                     exit=exit, window=window, **kind)
