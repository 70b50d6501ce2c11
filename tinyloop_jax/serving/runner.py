"""`Runner`: the engine API the serving loop drives — each call runs one device program over a
lane's `BatchState` and puts the new state back (`lane.state`), so the driver (`engine.Engine`)
keeps the threads, queues and bookkeeping and never touches an array. It also knows which
programs it has run (one per shape key), so warmup can compile them all and serving can count
what it compiled later.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from . import programs as P
from .lane import Lane, Limits, batch_buckets, entry_capacities, slot_buckets
from ..api import functional as F
from ..api.prefix import PrefixCache
from ..decoding.sampling import Request
from ..model import adaptive as ad
from ..model.kv_modes import KVMode
from ..model.cache import KVCache


class _DepthPrograms:
    """The serving programs per depth, shared by every engine of the process: a depth's copies
    (`programs.copy_of`) live while some runner holds that depth, and are freed with the last
    (a depth's compiled programs hold megabytes; JAX keeps them for as long as their function)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depths: dict[int, tuple[set, dict]] = {}  # loops -> (ids of the runners holding it, programs)

    def of(self, holder: int, loops: int) -> dict:
        """The depth's programs (key -> program), held by `holder`. Under `lock`."""
        holders, programs = self.depths.setdefault(loops, (set(), {}))
        holders.add(holder)
        return programs

    def release(self, holder: int, loops: int) -> None:
        with self.lock:
            holders, _ = self.depths.get(loops, (set(), None))
            holders.discard(holder)
            if not holders:
                self.depths.pop(loops, None)


DEPTH_PROGRAMS = _DepthPrograms()


class Runner:
    """Device programs for the lanes of one engine (one model, one set of `Limits`).

    work_mode: the K/V storage of the pool and the rows (the model's mode; float32 for h modes,
    whose K/V are rebuilt from h when a store entry is loaded into a slot)."""

    def __init__(self, weights, limits: Limits, work_mode: KVMode):
        self.weights, self.limits, self.work_mode = weights, limits, work_mode
        self.programs: set = set()  # shape keys of the programs run: ("decode", loops, B, Co, S), ...
        self.warm = False
        self.compiles_after_warmup = 0
        self._sizes: dict = {}  # shape key -> bytes (`_nbytes`)
        self._held: set[int] = set()  # depths whose programs it holds (`DEPTH_PROGRAMS`)

    def _count(self, *key) -> None:
        if key not in self.programs:
            self.programs.add(key)
            if self.warm:
                self.compiles_after_warmup += 1

    def _held_program(self, loops: int, key: tuple, make):
        """The depth's program under `key` (make() on first use), held until `forget`."""
        with DEPTH_PROGRAMS.lock:
            self._held.add(loops)
            mine = DEPTH_PROGRAMS.of(id(self), loops)
            if key not in mine:
                mine[key] = make()
            return mine[key]

    def _program(self, loops: int, name: str):
        """Program `name` of programs.py at depth `loops`: the depth's copy (`programs.copy_of`)."""
        f = getattr(P, name)  # (keyed by the function too: a test may stand another in)
        return self._held_program(loops, (name, f), lambda: P.copy_of(f))

    def _built(self, loops: int, key: tuple, make):
        """make()'s arrays, built by a program of the depth's (`forget` drops it): eager
        `jnp.zeros` would compile a program per shape that JAX keeps for the whole process."""
        return self._held_program(loops, (key, self.weights.config, self.work_mode), lambda: jax.jit(make))()

    def forget(self, loops: int) -> None:
        """Let go of depth `loops`'s programs (its lane is gone): a process serving a sweep of
        depths holds those of the lanes its engines keep, not of every depth it ever served. A
        depth that returns loads them from the persistent compilation cache (or compiles)."""
        self._held.discard(loops)
        DEPTH_PROGRAMS.release(id(self), loops)

    def close(self) -> None:
        """Let go of every depth's programs (the engine stops)."""
        for loops in list(self._held):
            self.forget(loops)

    # ---- buffers ---------------------------------------------------------------------------------

    def _pool_maker(self, loops: int):
        lim = self.limits
        return lambda: F.empty_cache(self.weights, lim.prefix_capacity * lim.slots, loops, kv_mode=self.work_mode)

    def _rows_maker(self, loops: int, size: int, cap: int):
        c = self.weights.config
        req = Request.make(size, 0.0, 0, 1.0, 1.0, max_tokens=1, carry_bias=True, sampled=True)
        pol = jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (size,)), ad.EVERY_PASS)
        return lambda: dict(own=F.empty_cache(self.weights, cap, loops, kv_mode=self.work_mode, batch=size),
                            seen=jnp.zeros((size, c.vocab_size), bool),
                            counts=jnp.zeros((size, c.vocab_size), jnp.int32),
                            last=jnp.zeros((size,), jnp.int32), req=jax.tree.map(jnp.asarray, req), pol=pol,
                            warm=jnp.zeros((size, c.d_model), c.compute_dtype))

    def empty_state(self, loops: int) -> P.BatchState:
        """A lane's state with an empty pool and no rows."""
        return P.BatchState(pool=self._built(loops, ("pool",), self._pool_maker(loops)))

    def empty_rows(self, loops: int, size: int, cap: int) -> dict:
        """The row fields of a BatchState of `size` fresh rows of `cap` positions."""
        return self._built(loops, ("rows", size, cap), self._rows_maker(loops, size, cap))

    def reshape(self, lane: Lane, size: int, cap: int, order: list[int] | None = None) -> None:
        """The lane's rows as `size` rows (a batch bucket) of `cap` positions; allocated if the
        lane has none. order: new row j is old row order[j] (-1: a free row; see
        `lane.compaction`); default: every row keeps its index."""
        s = lane.state
        if s.own is None:
            lane.state = s.replace(**self.empty_rows(lane.loops, size, cap))
        elif (size, cap) != (lane.size, lane.cap) or order is not None:
            self._count("reshape", lane.loops, lane.size, lane.cap, size, cap)
            idx = np.arange(size) if order is None else np.asarray(order)
            idx = np.where((idx >= 0) & (idx < lane.size), idx, 0)  # a free row: any row, reset before use
            lane.state = P.reshape_rows(s, jnp.asarray(idx, jnp.int32), capacity=cap,
                                        take=self._program(lane.loops, "take_rows"))
        lane.size, lane.cap = size, cap

    def release_rows(self, lane: Lane) -> None:
        """Free the lane's row buffers (it has no rows); the pool stays."""
        lane.state = lane.state.replace(own=None, seen=None, counts=None, last=None, req=None, pol=None, warm=None)
        lane.size = lane.cap = 0

    # ---- sizes -----------------------------------------------------------------------------------

    def pool_nbytes(self, loops: int) -> int:
        """Bytes of a lane's pool at depth `loops`."""
        return self._nbytes("pool", loops, self._pool_maker(loops))

    def rows_nbytes(self, loops: int, size: int, cap: int) -> int:
        """Bytes of `size` rows of `cap` positions at depth `loops` (0 rows: 0)."""
        return self._nbytes("rows", loops, size, cap, self._rows_maker(loops, size, cap)) if size else 0

    def entry_nbytes(self, loops: int, capacity: int) -> int:
        """Bytes of a store entry's K/V of `capacity` positions at depth `loops` (what
        `PrefixCache.nbytes` counts)."""
        return self._nbytes("entry", loops, capacity, lambda: F.empty_cache(self.weights, capacity, loops,
                                                                             kv_mode=self.work_mode))

    def _nbytes(self, *key_and_make) -> int:
        *key, make = key_and_make
        n = self._sizes.get(tuple(key))
        if n is None:  # shapes only: nothing is allocated
            n = self._sizes[tuple(key)] = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(jax.eval_shape(make)))
        return n

    # ---- the pool --------------------------------------------------------------------------------

    def load(self, lane: Lane, g: int, source, n: int) -> None:
        """Pool slot g <- the first n positions of `source` (a store entry, or -1 / None: the slot
        emptied; an int: another pool slot)."""
        w, cp = self.weights, self.limits.prefix_capacity
        pool = lane.state.pool
        if isinstance(source, PrefixCache) and n > 0:
            src, mat = source.cache, self.work_mode != w.config.storage
        else:  # empty the slot, or copy from a slot that holds a prefix already in working form
            slot = max(source if isinstance(source, int) else g, 0)
            src = self._program(lane.loops, "slot_of")(pool, jnp.int32(slot), slot_len=cp)
            mat, n = False, n if isinstance(source, int) else 0
        self._count("load", lane.loops, src.capacity, mat)
        load = self._program(lane.loops, "load_slot")
        pool = load(w.params, w.config, pool, jnp.int32(g), src, jnp.int32(min(n, cp)), passes=lane.loops,
                    materialize=mat, slot_len=cp)
        lane.state = lane.state.replace(pool=pool)

    def extract(self, lane: Lane, g: int, n: int, capacity: int) -> KVCache:
        """Pool slot g's first n positions as a segment of `capacity` slots (a copy, for the store)."""
        self._count("extract", lane.loops, capacity)
        extract = self._program(lane.loops, "slot_prefix")
        return extract(lane.state.pool, jnp.int32(g), jnp.int32(n), capacity=capacity,
                       slot_len=self.limits.prefix_capacity)

    # ---- steps -----------------------------------------------------------------------------------

    def prefill(self, lane: Lane, chunk: P.Chunk, into_slot: bool):
        """One prompt chunk (into the row's own segment, or into its pool slot: `into_slot`).
        Returns (first token [], logits [V], depth states)."""
        w, t = self.weights, chunk.tokens.shape[0]
        if into_slot:
            self._count("prefill_slot", lane.loops, lane.size, t)
            program = self._program(lane.loops, "prefill_slot")
        else:
            self._count("prefill", lane.loops, lane.size, lane.cap, t)
            program = self._program(lane.loops, "prefill_chunk")
        tok, logits, states, lane.state = program(w.params, w.config, lane.state, chunk, loops=lane.loops,
                                                  slot_len=self.limits.prefix_capacity, exit=lane.exit)
        return tok, logits, states

    def reset_row(self, lane: Lane, i: int, start: int) -> None:
        """Row i's own segment emptied, its next position `start`."""
        self._count("reset", lane.loops, lane.size, lane.cap)
        lane.state = self._program(lane.loops, "reset_row")(lane.state, jnp.int32(i), jnp.int32(start))

    def decode(self, lane: Lane, rows: P.DecodeRows) -> tuple[jax.Array, jax.Array | None]:
        """One decode step of the lane's batch, dispatched: the next token of every row [B]
        (active rows'), and with adaptive depth the passes each row ran [B] (else None), on the
        device — reading them waits for the step."""
        w = self.weights
        if lane.adaptive:  # a row of the lane has an exit rule: the adaptive-depth step (the passes
            # run per row come back with the tokens)
            self._count("decode_adaptive", lane.loops, lane.size, lane.cap, len(rows.slot_ids))
            step = self._program(lane.loops, "decode_step_adaptive")
            tok, depth, lane.state = step(w.params, w.config, lane.state, rows, loops=lane.loops,
                                          slot_len=self.limits.prefix_capacity)
            return tok, depth
        self._count("decode", lane.loops, lane.size, lane.cap, len(rows.slot_ids))
        step = self._program(lane.loops, "decode_step")
        tok, lane.state = step(w.params, w.config, lane.state, rows, loops=lane.loops,
                               slot_len=self.limits.prefix_capacity, exit=lane.exit)
        return tok, None

    # ---- warmup ----------------------------------------------------------------------------------

    def warmup(self, lane: Lane, insert_prompts: bool) -> None:
        """Run every program a lane of no rows will need (each batch bucket, grown and shrunk, each
        chunk size and slot count; each store-entry capacity `cache.bucket` makes up to the pool
        slots' (or the store's largest entry), loaded and, if the engine inserts prompts,
        extracted), so serving compiles nothing later."""
        lim, c = self.limits, self.weights.config
        cap, sizes = lim.row_capacity, batch_buckets(lim.max_batch)
        self.release_rows(lane)
        for size in sizes:  # grown as serving grows it (the growth copies too)
            self.reshape(lane, size, cap)
            req = Request.make(1, 0.0, 0, 1.0, 1.0, max_tokens=1, carry_bias=True, sampled=True)
            for t in lim.chunk_sizes:
                tokens, no_seen = np.zeros((t,), np.int32), np.zeros((c.vocab_size,), bool)
                self.prefill(lane, P.Chunk.make(0, tokens, 1, 0, True, -1, 0, no_seen, req), into_slot=False)
                self.prefill(lane, P.Chunk.make(0, tokens, 1, 0, False, 0, 0, no_seen, req), into_slot=True)
            zeros = np.zeros((size,), np.int32)
            for n in sorted({slot_buckets(lim.slots, n) for n in range(1, lim.slots + 1)}):
                self.decode(lane, P.DecodeRows(np.zeros((n,), np.int32), zeros, zeros, np.zeros((size,), bool), zeros))
            self.reset_row(lane, 0, 0)
            jax.block_until_ready(lane.state)
        for size in reversed(sizes[:-1]):  # and shrunk, a bucket at a time, as rows leave
            self.reshape(lane, size, cap, order=[0] + [-1] * (size - 1))
        self.release_rows(lane)
        self.load(lane, 0, None, 0)  # (the slot warmup wrote into; also the slot-to-slot copy)
        if lim.prefix_cache:
            stored = self.work_mode != c.storage  # a store entry's K/V are rebuilt to the working mode
            # the entries a store can hold, and their loads: those of prompts the pool holds (the
            # engine's own), and any larger one the store holds now; a larger one put in later
            # compiles its load when first used (the context's every capacity is ~70 programs)
            largest = max((e.cache.capacity for e in lane.store.entries()), default=0)
            load = self._program(lane.loops, "load_slot")
            for n in entry_capacities(min(c.max_seq_len, max(lim.prefix_capacity, largest))):
                entry = lambda n=n: F.empty_cache(self.weights, n, lane.loops)  # noqa: E731 - a store entry's form
                sources = [self._built(lane.loops, ("entry", n), entry)]
                if insert_prompts and n <= lim.prefix_capacity:
                    sources.append(self.extract(lane, 0, 0, n))  # the engine's own entries
                self._count("load", lane.loops, n, stored)
                for src in sources:
                    pool = load(self.weights.params, c, lane.state.pool, jnp.int32(0), src, jnp.int32(0),
                                       passes=lane.loops, materialize=stored, slot_len=lim.prefix_capacity)
                    lane.state = lane.state.replace(pool=pool)
        self.warm = True
