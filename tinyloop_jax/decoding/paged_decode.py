"""The `Model` path on pages: one call's prefix, prompts and outputs in a page pool, decoded by
the engine's step (`model.paged.forward`) under an on-device loop.

    a call      N rows; row i = the prefix (shared, or none) + suffix i + up to max_tokens tokens
    its pages   the prefix's full pages once, shared by every row's table; then each row's own
                pages (the prefix's partial last page copied into each row's first: rows write
                after it); the pool holds nothing else and lives for the call
    prefill     the suffixes as one group of prompt chunks [N, T] (`prefill`; with adaptive depth
                `prefill_adaptive`, each chunk exiting as a whole or running every pass)
    decode      `decode`: the engine's step body's `step.decode_steps` over the call's rows in
                order, one `lax.while_loop` of decode steps [N, 1] (plain or adaptive) or of
                speculative rounds, stops and max_tokens on the device

A `PrefixCache` stays a dense segment (immutable, saved and loaded as it is); a call copies its
stored values into the call's pages once (`model.paged.load_segment`, as the engine loads a
store entry) and reads them there. The pool is in the model's working mode: float32 K/V for an
h mode (the prefix rebuilt once per call; 2x faster than rebuilding K/V from h every step,
docs/benchmarks.md), the stored mode otherwise. Attention reads each row's live pages only where a kernel
runs (`paged.attention_kernel`), so a table sized for the whole call costs nothing per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..model import adaptive as ad
from ..model import cache as kvc
from ..model import paged
from ..model import paged_adaptive as pa
from ..model import transformer as tf
from ..model.config import ModelConfig
from ..model.params import Params
from . import step as St
from .programs import materialize
from .sampling import Knobs


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


def layout(prefix_len: int, room: int, n_rows: int, page_size: int = paged.PAGE_SIZE, window: int = 0,
           step: int = 1) -> Layout:
    """Page tables for n_rows rows of prefix_len shared positions + `room` own positions each
    (the longest suffix, max_tokens, a verify chunk). The table's length and the pool's come
    in buckets (`cache.bucket`), so that calls of nearby lengths share programs; a row is given
    only the pages it can write.

    window > 0: the model's local layers (`paged.local_layers`, their windows at most `window`)
    get local slots when that saves some: the prefix's pages a first query's window reads, and
    for each row a ring of slots over its own pages (page i in slot i mod ring) as long as its
    window and the most positions one step writes (`step`; or all its pages), so a page is
    overwritten only once no query reads it."""
    shared = prefix_len // page_size
    own = -(-(prefix_len + room) // page_size) - shared
    R = -(-kvc.bucket(prefix_len + room) // page_size)
    tables = np.zeros((n_rows, R), np.int32)
    tables[:, :shared] = np.arange(shared)
    tables[:, shared:shared + own] = shared + np.arange(n_rows * own).reshape(n_rows, own)
    n_pages = kvc.bucket(shared + n_rows * own, 1)
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
    size = lambda n, layers: n * paged.page_nbytes(cfg.storage.working, layers, cfg.n_kv_heads,  # noqa: E731
                                                   paged.PAGE_SIZE, cfg.head_dim, cfg.d_model)
    local = len(paged.local_layers(cfg)) if lay.slot_of is not None else 0
    return size(lay.n_pages, cfg.n_cache_layers(loops) - local) + size(lay.n_local, local)


_empty = jax.jit(paged.empty, static_argnums=(0, 1, 2, 3, 4, 5))


def empty_pool(cfg: ModelConfig, loops: int, n_pages: int, lay: Layout | None = None) -> paged.PagedKV:
    """A call's pool, in the model's working mode: an h mode's call holds float32 K/V (rebuilt
    from h once, when the prefix is loaded, not at every step; as the model stores them); with
    a layout's local slots, its local layers in them."""
    if lay is None or lay.slot_of is None:
        return _empty(cfg, loops, n_pages, paged.PAGE_SIZE, cfg.storage.working)
    pool = _empty(cfg, loops, n_pages, paged.PAGE_SIZE, cfg.storage.working, lay.n_local)
    return pool.replace(slot_of=jnp.asarray(lay.slot_of))
load_segment = jax.jit(paged.load_segment, donate_argnames=("pool",))
copy_pages = jax.jit(paged.copy_pages, donate_argnames=("pool",))


def load_prefix(params: Params, cfg: ModelConfig, pool: paged.PagedKV, seg, prefix_len: int,
                lay: Layout) -> paged.PagedKV:
    """The prefix's positions into the call's pages: its full pages once, its partial last page
    into every row's first own page (row 0's written, then copied). A prefix stored in another
    mode than the pool's (h) is rebuilt into it first (`programs.materialize`)."""
    if seg.kv_mode != pool.kv_mode:
        seg = materialize(params, cfg, seg, passes=pool.passes)
    pool = load_segment(pool, seg, jnp.asarray(lay.tables[0]), jnp.int32(0), jnp.int32(prefix_len))
    rows = lay.tables.shape[0]
    if prefix_len % pool.page_size and rows > 1:
        src = np.full((rows - 1,), lay.tables[0, lay.shared], np.int32)
        pool = copy_pages(pool, jnp.asarray(src), jnp.asarray(lay.tables[1:, lay.shared]))
    return pool


@partial(jax.jit, static_argnames=("cfg", "loops", "window"), donate_argnames=("pool",))
def prefill(params: Params, cfg: ModelConfig, pool: paged.PagedKV, rows: paged.Rows, tokens: jax.Array,
            prior_logits: jax.Array, loops: int, window: int, exit: tf.Exit | None = None,
            seeds: jax.Array | None = None):
    """N rows' suffixes tokens [N, T] (row i's first rows.n_new[i] real, possibly none) at
    rows.start into their pages. Returns (next-token logits [N, V]; prior_logits [V], what the
    prefix ends with, for empty rows; the pool)."""
    x, pool = paged.forward(params, cfg, pool, rows, tokens, loops, window, exit, seeds)
    logits = paged.last_logits(params, cfg, x, rows)
    return jnp.where((rows.n_new > 0)[:, None], logits, prior_logits), pool


@partial(jax.jit, static_argnames=("cfg", "loops"), donate_argnames=("pool",))
def prefill_adaptive(params: Params, cfg: ModelConfig, pool: paged.PagedKV, rows: paged.Rows, tokens: jax.Array,
                     prior_logits: jax.Array, prior_depth: jax.Array, prior_state: jax.Array, pol: ad.Policy,
                     seeds: jax.Array, loops: int):
    """`prefill` with adaptive depth (`model.paged_adaptive.forward`; pol [N], kind NONE: every
    pass; a chunk exits as a whole). Returns (logits [N, V], the pool, each row's depth [N] and
    last state [N, D]); empty rows take what the prefix ends with (prior_logits [V], prior_depth
    [], prior_state [D])."""
    out = pa.forward(params, cfg, pool, rows, tokens, loops, pol, seeds)
    has = rows.n_new > 0
    return (jnp.where(has[:, None], out.logits, prior_logits), out.pool, jnp.where(has, out.depth, prior_depth),
            jnp.where(has[:, None], out.state, prior_state.astype(out.state.dtype)))


@struct.dataclass
class Decoded:
    """What `decode` returns: row i emitted tokens[i, :n[i]]."""

    tokens: Annotated[jax.Array, "int32[N, S]"]  # the first token, then the loop's; -1 past each row's end
    n: Annotated[jax.Array, "int32[N]"]
    passes: Annotated[jax.Array, "int32[N, S]"] | None  # adaptive depth: the passes each token ran
    rounds: Annotated[jax.Array, "int32[]"]  # the loop's iterations (speculative: rounds)
    accepted: Annotated[jax.Array, "int32[N]"]  # speculative: drafts kept
    pool: paged.PagedKV  # the call's pages after it


@partial(jax.jit, static_argnames=("cfg", "loops", "window", "out_len", "draft_loops", "lookahead"),
         donate_argnames=("pool",))
def decode(params: Params, cfg: ModelConfig, pool: paged.PagedKV, rows: paged.Rows, first: jax.Array,
           seen: jax.Array, req: Knobs, loops: int, window: int, out_len: int, exit: tf.Exit | None = None,
           draft_loops: int = 0, lookahead: int = 0, pol: ad.Policy | None = None, first_depth: jax.Array | None = None,
           warm: jax.Array | None = None) -> Decoded:
    """Emit up to req.max_tokens (<= out_len) tokens for each of N rows by the engine's step body
    (`step.decode_steps`, one `lax.while_loop` on the device, over the call's rows in order). rows:
    page tables [N, R], start [N] the position each row's first emitted token is fed at; first
    [N]: those tokens (`programs.first_tokens`); seen [N, V]: each row's prompt. Token i is
    chosen from the logits token i - 1 produced (n tokens cost n - 1 steps); the loop ends when
    every row is done.

    lookahead > 0: in rounds of self-speculative decoding (`lookahead` drafts at `draft_loops`;
    the rows' pages need room for lookahead + 1 positions past the last emitted token). pol [N]:
    adaptive depth, each step's passes stopping at each row's exit (first_depth [N], warm [N, D]:
    the prompts' passes and last states; rows.window each row's cache_window)."""
    N = first.shape[0]
    state, stop = St.requests_of(seen, first, req, cfg.d_model, cfg.compute_dtype, pol, warm)
    decodes = St.Decodes(rows, None, jnp.ones((N,), jnp.int32), jnp.where(stop >= 0, 0, req.max_tokens - 1))
    n_max = max(out_len - 1, 1)
    got, pool, state = St.decode_steps(params, cfg, pool, state, decodes, jnp.int32(n_max), loops, n_max, exit,
                                       window, adaptive=pol is not None, draft_loops=draft_loops, lookahead=lookahead)
    tokens = jnp.concatenate([first[:, None], got.out.tokens[:, :out_len - 1]], axis=1)
    passes = None if pol is None else jnp.concatenate([first_depth[:, None], got.passes[:, :out_len - 1]], axis=1)
    return Decoded(tokens, 1 + got.n, passes, got.rounds, got.accepted, pool)


# a call's rows as request rows, and bursts of the step body over them (`Conversation`: the
# host streams each burst's tokens, then asks for the next)
requests_of = jax.jit(St.requests_of, static_argnames=("d_model", "dtype"))
decode_burst = jax.jit(St.decode_steps, static_argnames=("cfg", "loops", "n_max", "window"),
                       donate_argnames=("pool", "state"))
