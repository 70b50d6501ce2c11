"""A lane: the rows and prefixes of one depth, as plain data, and the admission rules as pure
functions over it (no device work: `runner.Runner` does that, the driver `engine.Engine` calls
both).

    limits = Limits.of(max_batch=16, prefill_chunk=64, prefix_slots=8, ...)
    p = place(limits, lane, n_prompt, max_tokens, *choose_prefix(...))   # None: wait for a slot
    for row, n in prefill_turns(lane.order, limits.chunk): ...            # this iteration's chunks
    rows = decode_rows(lane.rows, lane.size, limits.slots)               # the decode step's inputs

Requests at one `loops` share programs, prefixes and a store, so each depth is its own lane.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..model.cache import bucket
from .pool import PrefixPool
from .programs import BatchState, DecodeRows


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes programs are compiled for: powers of two below max_batch, and max_batch."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})


def slot_buckets(slots: int, n: int) -> int:
    """How many pool slots a step reads when its rows read n distinct ones: 1 or 2 (a copy of
    them), else all of them in place (copying more than a quarter of the pool costs more than
    reading all of it)."""
    return n if n <= 2 and 4 * n <= slots else slots


def entry_capacity(n: int) -> int:
    """Capacity of a store entry of an n-token prompt: `cache.bucket(n)`, the rule `PrefixStore`
    entries follow too, so warmup covers the entries of any store (`entry_capacities`)."""
    return bucket(n)


def entry_capacities(context: int) -> list[int]:
    """Every store-entry capacity up to `context` positions: 16, 32, 64, 128, 256, 384, ..."""
    return sorted({bucket(n) for n in range(1, bucket(context) + 1)})


@dataclass(frozen=True)
class Limits:
    """An engine's sizes, shared by its lanes."""

    max_batch: int  # rows decoded together
    chunk: int  # prompt tokens per chunk, and per iteration (a bucket)
    long_rest: int  # a prompt rest longer than this is prefilled into a pool slot
    slots: int  # G pool slots
    prefix_capacity: int  # Cp positions per slot
    row_capacity: int  # positions of a row's own segment, usually
    max_capacity: int  # ... while a row needs more: the model's context
    prefix_cache: bool  # False: no store and no pool (every prompt prefilled whole)

    @classmethod
    def of(cls, max_batch: int, prefill_chunk: int, prefix_slots: int, context: int, prefix_capacity: int | None,
           row_capacity: int | None, prefix_cache: bool) -> "Limits":
        """From the engine's arguments (context: the model's max_seq_len)."""
        chunk = bucket(prefill_chunk)
        max_capacity = bucket(context)
        return cls(max_batch, chunk, min(chunk, 32), prefix_slots, bucket(prefix_capacity or context),
                   min(max_capacity, bucket(row_capacity or 256)), max_capacity, prefix_cache)

    @property
    def chunk_sizes(self) -> list[int]:
        """The padded lengths a prompt chunk can have: 16, 32, ... chunk."""
        return sorted({bucket(n) for n in range(1, self.chunk + 1)})


@dataclass
class Row:
    handle: object  # the request's `Handle` (prompt, sampling, tokens so far)
    index: int  # its row in the batch
    group: int  # pool slot it reads, -1: none
    limit: int  # prompt positions read from the pool slot
    fed: int  # prompt positions in place (limit + prefilled)
    need: int  # positions its own segment must hold
    owner: bool = False  # its prompt is prefilled into its pool slot (a long prompt)
    decoding: bool = False
    ahead: int = 0  # tokens a dispatched step chose for it that the host has not read yet
    left: bool = False  # it left the batch (a step still in flight chose a token for it: discarded)


@dataclass
class Lane:
    """One depth's rows and prefixes (its `state` is the device side; None while being rebuilt)."""

    loops: int
    store: object  # its PrefixStore
    exit: object  # its early exit (tf.Exit or None)
    pool: PrefixPool
    state: BatchState  # the device side (the driver passes it to the runner, never reads it)
    size: int = 0  # rows allocated (a batch bucket; 0: none)
    cap: int = 0  # positions per row (Co)
    rows: dict = field(default_factory=dict)  # index -> Row
    order: collections.deque = field(default_factory=collections.deque)  # rows still prefilling, FIFO
    used: int = 0  # tick of its last admission (the least recently used idle lane is evicted first)
    inflight: tuple | None = None  # (tokens [B], passes [B] or None, [(row, index)] it ran): the step not yet read
    adaptive: bool = False  # a row with an exit rule came in: its steps take the adaptive-depth program


def choose_prefix(pool_hit: tuple[int, int], store_hit: tuple[object | None, int], cap: int,
                  chunk: int) -> tuple[int, int, object | None]:
    """(pool slot or -1, positions it serves, the store entry to load instead or None): the
    pooled prefix (pool_hit = (slot, k)), unless the store's (store_hit = (entry, k)) is longer
    by more than a chunk, or longer and nothing is pooled. k is at most `cap`."""
    best_g, best_k = pool_hit
    entry, k = store_hit
    k = min(k, cap) if entry is not None else 0
    if k > best_k + chunk or (k > best_k and best_g < 0):
        return -1, k, entry
    return best_g, best_k, None


@dataclass(frozen=True)
class Placement:
    """Where an admitted request goes."""

    group: int  # pool slot its row reads, -1: none
    limit: int  # prompt positions it reads there
    owner: bool  # its prompt is prefilled into that slot
    load: tuple | None  # (slot, source, n): first, slot <- the first n positions of source (a store
    #                     entry, or a pool slot index; -1: emptied)
    shares: bool  # the loaded slot then holds that store entry for others to read
    need: int  # positions its own segment must hold
    size: int  # the batch's rows, after it joins
    cap: int  # and their positions
    recomputed: int = 0  # positions a store entry holds that are prefilled again: no pool slot was free


def place(limits: Limits, lane: Lane, n: int, max_tokens: int, group: int, limit: int,
          source) -> Placement | None:
    """Admit an n-token prompt whose best cached prefix is (group, limit, source) (see
    `choose_prefix`); None: it waits for a pool slot to free up, rather than moving every row
    to the whole context (rows hold slots: one frees)."""
    owner, load, shares = False, None, False
    if n - limit > limits.long_rest and n <= limits.prefix_capacity and limits.prefix_cache:  # into a pool slot
        slot = lane.pool.lru_free()
        if slot is None and n - limit + max_tokens > limits.row_capacity:
            return None
        if slot is not None:
            load = (slot, source if source is not None else group, limit)
            group, owner = slot, True
    elif source is not None and group < 0:  # a cached prefix not pooled yet
        slot = lane.pool.lru_free()
        if slot is not None:
            load, shares, group = (slot, source, len(source)), True, slot
    recomputed = limit if group < 0 and source is not None else 0
    if group < 0:
        limit = 0
    need = max_tokens + (0 if owner else n - limit)
    free = any(i not in lane.rows for i in range(lane.size))
    size = lane.size if free else next(b for b in batch_buckets(limits.max_batch) if b > len(lane.rows))
    cap = max(lane.cap, limits.row_capacity if need <= limits.row_capacity else limits.max_capacity)
    return Placement(group, limit, owner, load, shares, need, size, cap, recomputed)


def fitted(limits: Limits, lane: Lane) -> tuple[int, int]:
    """(rows, positions) the batch should have now: the smallest batch bucket holding its rows,
    and row_capacity unless a row needs more (then the positions it has). (0, 0): no rows."""
    if not lane.rows:
        return 0, 0
    size = next(b for b in batch_buckets(limits.max_batch) if b >= len(lane.rows))
    wide = max(r.need for r in lane.rows.values()) > limits.row_capacity
    return size, lane.cap if wide else limits.row_capacity


def compaction(rows: dict, size: int) -> list[int]:
    """The rows' indices in order, as the first rows of a batch of `size` (size >= len(rows)):
    new row j is old row out[j]; past the rows, -1 (a free row, reset before use)."""
    keep = sorted(rows)
    return keep + [-1] * (size - len(keep))


def prefill_turns(order: collections.deque, chunk: int) -> Iterator[tuple[Row, int]]:
    """One iteration's prompt chunks, oldest row first: (row, tokens) for the row at the head of
    `order`, while the padded lengths run stay within `chunk` (several short prompt rests, or
    one chunk of a long prompt). Reads `order` live: the caller advances `row.fed` and drops a
    row from `order` once its prompt is in (or it fails)."""
    budget = chunk
    while order and budget > 0:
        r = order[0]
        n = min(chunk, len(r.handle.prompt) - r.fed)
        yield r, n
        budget -= bucket(n)  # a short rest runs a short program


def decode_rows(rows: dict, size: int, slots: int) -> DecodeRows:
    """The decode step's inputs for the rows past their prompt: the pool slots they read (a
    bucket of `slot_buckets`), and per row its slot among them, prefix length and token index.
    A row's tokens still in flight (`Row.ahead`) count as emitted: a row they take to max_tokens
    sits the step out."""
    active = np.zeros((size,), bool)
    group, limit, steps = (np.zeros(size, np.int32) for _ in range(3))
    decoding = [r for r in rows.values()
                if r.decoding and len(r.handle.tokens) + r.ahead < r.handle.params.max_tokens]
    read = sorted({r.group for r in decoding if r.group >= 0}) or [0]
    if slot_buckets(slots, len(read)) == slots:
        read = list(range(slots))
    for r in decoding:  # a row reads only its slot of the step's slots (masked by position)
        i = r.index
        active[i], steps[i] = True, len(r.handle.tokens) + r.ahead
        group[i], limit[i] = (read.index(r.group), r.limit) if r.group >= 0 else (-1, 0)
    return DecodeRows(np.array(read, np.int32), group, limit, active, steps)
