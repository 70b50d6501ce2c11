"""`Scheduler`: the batch side of the engine's loop, on its thread only — the lanes (one per
depth), queued requests placed into rows, one iteration of prompt chunks and decode steps, and
rows leaving. It decides with the pure functions of `lane` and the records of `pool`, and runs
device programs through `runner.Runner`; it knows nothing of threads or the queue.

Memory: every lane's pool, rows and store count against one `memory_budget`; a lane that must
grow (or be made) first evicts idle lanes, least recently used first, and a request waits while
busy lanes hold the room it needs (or fails with `MemoryBudgetError` when nothing can free it).
A program that fails takes its lane's device state with it (donated buffers, the pool among
them): the lane's rows fail and its buffers are made anew; other lanes go on.
"""

from __future__ import annotations

import collections
import weakref
from typing import Callable

import jax.numpy as jnp
import numpy as np

from .handles import Handle, MemoryBudgetError
from .lane import (Lane, Limits, Row, batch_buckets, choose_prefix, compaction, decode_rows, entry_capacity, fitted,
                   place, prefill_turns)
from .pool import PrefixPool
from .programs import Chunk
from .runner import Runner
from ..api.prefix import PrefixCache
from ..api.store import PrefixStore
from ..decoding.sampling import Request
from ..model.kv_modes import KVMode
from ..model.cache import bucket


class StoreBytes:
    """Bytes a store's entries hold (`PrefixCache.nbytes`: their K/V and kept states), each
    entry's counted once (entries are immutable; the count is forgotten with the entry)."""

    def __init__(self):
        self._memo: dict[int, tuple[weakref.ref, int]] = {}

    def __call__(self, store: PrefixStore) -> int:
        total = 0
        for e in store.entries():
            hit = self._memo.get(id(e))
            if hit is None or hit[0]() is not e:
                ref = weakref.ref(e, lambda _, k=id(e): self._memo.pop(k, None))
                hit = self._memo[id(e)] = (ref, e.nbytes)
            total += hit[1]
        return total


class Scheduler:
    """The rows of every depth over one model. `stats`: its counters (prefix hits, chunks, steps,
    tokens out, finished requests, lanes evicted; the loop thread's own: the driver copies
    them); `on_first_token(handle)`: told when a request emits its first token.
    memory_budget: bytes for every lane's pool, rows and store together (None: no bound).
    max_lanes: depths held at once (their programs are outside the budget; see `_make_room`).
    overlap: a decode step's tokens are read after the next step is dispatched (False: at once,
    the device idle while the host works — the baseline of scripts/bench_serve.py)."""

    def __init__(self, model, limits: Limits, store: PrefixStore | None, store_bytes: int, insert_prompts: bool,
                 work_mode: KVMode, stats: collections.Counter, on_first_token: Callable[[Handle], None],
                 memory_budget: int | None = None, overlap: bool = True, max_lanes: int = 8):
        self.model, self.limits = model, limits
        self.overlap, self.max_lanes = overlap, max_lanes
        self.default_store, self.store_bytes = store, store_bytes
        self.insert_prompts = insert_prompts
        self.runner = Runner(model.weights, limits, work_mode)
        self.lanes: dict[int, Lane] = {}
        self.stats = stats
        self.memory_budget = memory_budget
        self._on_first_token = on_first_token
        self._tick = 0
        self._store_bytes = StoreBytes()
        # per depth, in tokens (vLLM's counts): prompt tokens looked up in the prefix cache and
        # those it served; positions run through the model, and the loop passes they took
        self.depths: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.finished: list = []  # (handle, reason, error) of the rows that left: the driver finishes them

    def take_finished(self) -> list:
        """The requests that left since the last call, as (handle, reason, error): the driver
        finishes them once it has published what they changed."""
        out, self.finished = self.finished, []
        return out

    def running(self) -> int:
        """Requests in the batch (all depths)."""
        return sum(len(lane.rows) for lane in self.lanes.values())

    def busy(self) -> bool:
        return any(lane.rows for lane in self.lanes.values())

    def snapshot(self) -> dict:
        """What the driver's `stats()` reports of this side: a copy, made on the loop thread."""
        return dict(self.stats, running=self.running(), lanes=len(self.lanes), memory_bytes=self.memory_bytes(),
                    programs=len(self.runner.programs), compiles_after_warmup=self.runner.compiles_after_warmup,
                    depths={loops: dict(c) for loops, c in self.depths.items()})

    # ---- lanes -------------------------------------------------------------------------------

    def lane(self, loops: int) -> Lane:
        """The lane of depth `loops` (made on first use, with the default store at its depth)."""
        lane = self.lanes.get(loops)
        if lane is None:
            store = self.default_store if loops == (self.default_store.loops if self.default_store else None) \
                else None
            if store is None:
                store = PrefixStore(self.model, max_bytes=self.store_bytes, loops=loops)
                if self.default_store is None and loops == self.model.weights.config.default_loops:
                    self.default_store = store
            lane = Lane(loops, store, self.model.exit_for(loops), PrefixPool(self.limits.slots),
                        self.runner.empty_state(loops))
            self.lanes[loops] = lane
        return lane

    def warmup(self, loops: int) -> int:
        """Run every program of the lane at `loops` once; returns how many were new."""
        if loops not in self.lanes and not self._room(self.runner.pool_nbytes(loops), None, lanes=1):
            raise MemoryBudgetError(f"warmup at loops={loops}: busy lanes hold the memory budget")
        lane = self.lane(loops)
        if lane.rows:
            raise RuntimeError("warmup() runs before requests are served")
        before = len(self.runner.programs)
        self.runner.warmup(lane, self.insert_prompts)
        lane.pool.clear(0)  # warmup wrote into slot 0 (then emptied it)
        return len(self.runner.programs) - before

    def warmup_scratch(self, loops: int) -> int:
        """`warmup` on a lane of its own (same shapes, never served, dropped after): the programs
        land in the process's compile caches while the real lanes serve. Any thread."""
        store = self.default_store if self.default_store is not None and self.default_store.loops == loops else \
            PrefixStore(self.model, max_bytes=self.store_bytes, loops=loops)
        lane = Lane(loops, store, self.model.exit_for(loops), PrefixPool(self.limits.slots),
                    self.runner.empty_state(loops))
        before = len(self.runner.programs)
        self.runner.warmup(lane, self.insert_prompts)
        return len(self.runner.programs) - before

    # ---- memory ------------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Bytes the lanes hold: pools, rows, and stores (the default store even with no lane)."""
        r = self.runner
        stores = {id(lane.store): lane.store for lane in self.lanes.values()}
        if self.default_store is not None:
            stores[id(self.default_store)] = self.default_store
        return (sum(r.pool_nbytes(lane.loops) + r.rows_nbytes(lane.loops, lane.size, lane.cap)
                    for lane in self.lanes.values()) + sum(map(self._store_bytes, stores.values())))

    def least_bytes(self, loops: int, n_prompt: int, max_tokens: int) -> int:
        """The least a request needs to run in a lane of its own: the lane's pool and one row
        (positions for max_tokens, and for the prompt unless it goes into a pool slot). Reads
        shapes only: any thread may ask."""
        lim = self.limits
        pooled = lim.prefix_cache and n_prompt <= lim.prefix_capacity
        need = max_tokens + (0 if pooled else n_prompt)
        cap = lim.row_capacity if need <= lim.row_capacity else lim.max_capacity
        return self.runner.pool_nbytes(loops) + self.runner.rows_nbytes(loops, 1, cap)

    def _make_room(self, extra: int, keep: Lane | None, lanes: int = 0) -> bool:
        """Evict idle lanes (no rows; never `keep`), least recently used first, until `extra`
        more bytes fit the budget and `lanes` more lanes fit max_lanes. False: they do not,
        with every idle lane gone."""
        def full():
            over = len(self.lanes) + lanes > self.max_lanes
            return over or (self.memory_budget is not None and self.memory_bytes() + extra > self.memory_budget)
        while full():
            idle = [lane for lane in self.lanes.values() if not lane.rows and lane is not keep]
            if not idle:
                return False
            gone = min(idle, key=lambda lane: lane.used).loops
            del self.lanes[gone]  # its pool, and its store unless default
            self.runner.forget(gone)  # and its programs
            self.stats["lanes_evicted"] += 1
        return True

    def _room(self, extra: int, keep: Lane | None, lanes: int = 0) -> bool:
        """`_make_room`; when it fails and no lane has rows (nothing will free the room), the
        request cannot run: MemoryBudgetError. False: it waits for rows to leave."""
        if self._make_room(extra, keep, lanes):
            return True
        if not self.busy():
            raise MemoryBudgetError(f"{extra / 2**20:.2f} MiB more does not fit memory_budget="
                                    f"{self.memory_budget} bytes ({self.memory_bytes() / 2**20:.2f} MiB held by "
                                    "the stores and lanes that stay); lower loops or max_tokens, or raise the budget")
        self.stats["memory_waits"] += 1
        return False

    # ---- admission ---------------------------------------------------------------------------

    def place(self, h: Handle) -> bool:
        """Give a request a row (and a pool slot); False: it must wait (for a pool slot, or for
        rows to leave and free memory). MemoryBudgetError: it can never fit."""
        r = self.runner
        if h.loops not in self.lanes:
            if not self._room(self.least_bytes(h.loops, len(h.prompt), h.params.max_tokens), None, lanes=1):
                return False
        lane = self.lane(h.loops)
        p = place(self.limits, lane, len(h.prompt), h.params.max_tokens, *self._prefix(lane, h.prompt))
        if p is None:
            return False
        grow = r.rows_nbytes(lane.loops, p.size, p.cap) - r.rows_nbytes(lane.loops, lane.size, lane.cap)
        if grow > 0 and not self._room(grow, lane):
            return False
        self._tick += 1
        lane.used = self._tick
        try:
            if p.load is not None:
                slot, source, n = p.load
                self._load(lane, slot, source, n)
                if p.shares:  # a store entry now pooled: others may read it too
                    lane.pool.hold(slot, source.prompt, min(len(source), self.limits.prefix_capacity), source)
            if (p.size, p.cap) != (lane.size, lane.cap):
                r.reshape(lane, p.size, p.cap)
        except Exception as e:
            self.fail_lane(lane, e)
            raise
        i = next(i for i in range(lane.size) if i not in lane.rows)
        h.prefix_tokens = p.limit
        depth = self.depths[lane.loops]
        depth["prefix_cache_queries"] += len(h.prompt)
        depth["prefix_cache_hits"] += p.limit
        self.stats["requests_prefix_hit" if p.limit else "requests_prefix_miss"] += 1
        self.stats["prefix_tokens_reused"] += p.limit
        if p.recomputed:  # the store held it, but no pool slot was free to read it from
            self.stats["requests_prefix_no_slot"] += 1
            self.stats["prefix_tokens_recomputed"] += p.recomputed
        lane.rows[i] = row = Row(h, i, p.group, p.limit, p.limit, p.need, p.owner)
        if p.group >= 0:
            entry = lane.pool.acquire(p.group).entry
            if entry is not None:
                lane.store.touch(entry)
        if p.owner:  # the slot holds this prompt once prefilled; until then no one else matches it
            lane.pool.clear(p.group)
        lane.order.append(row)
        return True

    def _prefix(self, lane: Lane, prompt: np.ndarray) -> tuple[int, int, PrefixCache | None]:
        """(pool slot or -1, positions it serves, the store entry to load instead or None) for a
        prompt (`lane.choose_prefix`). At least the prompt's last token is always prefilled (its
        logits)."""
        if not self.limits.prefix_cache:
            return -1, 0, None
        cap = min(len(prompt) - 1, self.limits.prefix_capacity)
        return choose_prefix(lane.pool.match(prompt, cap), lane.store.lookup(prompt), cap, self.limits.chunk)

    def _load(self, lane: Lane, g: int, source, n: int) -> None:
        """Pool slot g <- the first n positions of `source` (see `Runner.load`); it holds nothing
        shareable until the caller says what."""
        self.runner.load(lane, g, source, n)
        lane.pool.clear(g)
        self.stats["prefix_pool_loads"] += 1

    def _fit(self, lane: Lane) -> None:
        """After rows leave: the batch moves to the smallest bucket holding the rows left (a
        bucket at a time, the rows compacted to the front) and back to row_capacity once no row
        needs more; its buffers are released when it has no rows."""
        size, cap = fitted(self.limits, lane)
        if size == 0:
            self.runner.release_rows(lane)
        while (lane.size, lane.cap) != (size, cap):
            step = max([b for b in batch_buckets(self.limits.max_batch) if b < lane.size] + [size])
            order = compaction(lane.rows, step) if step < lane.size else None
            self.runner.reshape(lane, step, cap, order)
            if order is not None:  # row j is old row order[j]
                lane.rows = {j: lane.rows[i] for j, i in enumerate(order) if i >= 0}
                for j, r in lane.rows.items():
                    r.index = j

    # ---- one iteration -----------------------------------------------------------------------

    def step(self) -> None:
        """Per lane: prompt chunks within the iteration's budget, then one decode step. A lane
        whose program fails fails its rows (`fail_lane`); the others go on."""
        for lane in list(self.lanes.values()):
            try:
                for r, n in prefill_turns(lane.order, self.limits.chunk):
                    self._prefill(lane, r, n)
                if lane.inflight is not None or any(r.decoding for r in lane.rows.values()):
                    self._decode(lane)
            except Exception as e:  # noqa: BLE001 - the lane's device state is gone, not the loop
                self.fail_lane(lane, e)

    def _prefill(self, lane: Lane, r: Row, n: int) -> None:
        """The next n tokens of a prompt (the oldest still prefilling); after its last chunk the
        request emits its first token, and a prompt prefilled into its pool slot is shared and
        stored."""
        h, V = r.handle, self.model.weights.config.vocab_size
        tokens = np.zeros((bucket(n),), np.int32)  # a short rest runs a short program
        tokens[:n] = h.prompt[r.fed:r.fed + n]
        final = r.fed + n == len(h.prompt)
        prompt_seen = np.zeros((V,), bool)
        prompt_seen[h.prompt] = True
        if h.policy is not None:
            lane.adaptive = True  # from now on its steps run the adaptive-depth program
        chunk = Chunk.make(r.index, tokens, n, r.fed, r.fed == r.limit, r.group, r.limit, prompt_seen,
                           Request.from_params([h.params], stops=False, logit_bias=True, sampled=True), h.policy)
        tok, logits, states = self.runner.prefill(lane, chunk, into_slot=r.owner)
        self.stats["prefill_chunks"] += 1
        self._computed(lane, n)
        r.fed += n
        if not final:
            return
        lane.order.popleft()
        if h.policy is not None:  # the prompt ran every pass
            h.depths.append(lane.loops)
        if r.owner:  # the slot now holds the whole prompt: the row reads it all, others may share it
            r.limit = len(h.prompt)
            lane.pool.hold(r.group, h.prompt, r.limit)
            self.runner.reset_row(lane, r.index, r.limit)
            if self.insert_prompts:
                lane.pool[r.group].entry = self._insert(lane, r, logits, states, prompt_seen)
        r.decoding = True
        self._tokens(lane, [(r, int(tok))])

    def _insert(self, lane: Lane, r: Row, logits, states, prompt_seen) -> PrefixCache | None:
        """A prompt prefilled into its pool slot, as a store entry (a copy of the slot's positions,
        in the capacity `cache.bucket` gives, as every store entry). None: no room in the memory
        budget (counted)."""
        n = len(r.handle.prompt)
        if not self._make_room(self.runner.entry_nbytes(lane.loops, entry_capacity(n)), lane):
            self.stats["store_inserts_skipped"] += 1
            return None
        seg = self.runner.extract(lane, r.group, n, entry_capacity(n))
        prompt = np.array(r.handle.prompt, np.int32)
        prompt.setflags(write=False)
        entry = PrefixCache(cache=seg, prompt=prompt, loops=lane.loops, cache_window=0, logits=logits,
                            seen=jnp.asarray(prompt_seen), depth_states=states, weights=self.model.weights)
        lane.store.insert(entry)
        return entry

    def _decode(self, lane: Lane) -> None:
        """Dispatch the lane's next decode step, then read the one before it: the host's work on
        step t's tokens (stops, streams, rows leaving) runs while the device computes step t + 1.
        A row that stops at step t has a token chosen at t + 1 too: it is discarded (its row is
        emptied before reuse); max_tokens is known ahead, so length stops waste nothing."""
        prev, lane.inflight = lane.inflight, None
        rows = decode_rows(lane.rows, lane.size, self.limits.slots)
        if rows.active.any():
            tok, passes = self.runner.decode(lane, rows)
            ran = [(lane.rows[i], int(i)) for i in np.flatnonzero(rows.active)]
            for r, _ in ran:
                r.ahead += 1
            self.stats["decode_steps"] += 1
            self.stats["batch_rows"] += len(ran)
            self._computed(lane, len(ran), None if passes is None else 0)  # adaptive: passes counted when read
            if self.overlap:
                lane.inflight = (tok, passes, ran)
            else:
                self._read(lane, (tok, passes, ran))
        if prev is not None:
            self._read(lane, prev)

    def _read(self, lane: Lane, step: tuple) -> None:
        """The tokens of a dispatched decode step (waits for it), emitted for the rows still in."""
        tok, passes, ran = step
        tok = np.asarray(tok)
        for r, _ in ran:
            r.ahead -= 1
        if passes is not None:  # adaptive depth: the passes each row ran
            passes = np.asarray(passes)
            run = int(sum(passes[i] for _, i in ran))
            depth = self.depths[lane.loops]
            depth["passes"] += run
            depth["passes_skipped"] += lane.loops * len(ran) - run
            for r, i in ran:
                if not r.left and r.handle.policy is not None:
                    r.handle.depths.append(int(passes[i]))
        self._tokens(lane, [(r, int(tok[i])) for r, i in ran if not r.left])

    def _computed(self, lane: Lane, n: int, passes: int | None = None) -> None:
        """n positions ran through the model at the lane's depth (padding not counted), taking
        `passes` loop passes (None: every pass, n * loops)."""
        depth = self.depths[lane.loops]
        depth["tokens_computed"] += n
        depth["passes"] += n * lane.loops if passes is None else passes

    def _tokens(self, lane: Lane, new: list) -> None:
        """Emit each row's new token ([(row, token)]); rows that are done leave."""
        for r, t in new:
            if r.left:  # a stop earlier in this list
                continue
            h, s = r.handle, r.handle.params
            h.emit(t)
            self.stats["tokens_out"] += 1
            if len(h.tokens) == 1:
                self._on_first_token(h)
            tail = tuple(h.tokens[-max((len(q) for q in s.stop_sequences), default=0):])
            stop = next((q for q in s.stop_sequences if tail[len(tail) - len(q):] == q and len(q) <= len(tail)), None)
            if stop is not None:
                h.stop_matched = list(stop)
                self.release(lane, r, "stop")
            elif len(h.tokens) >= s.max_tokens:
                self.release(lane, r, "length")

    # ---- leaving -----------------------------------------------------------------------------

    def release(self, lane: Lane, r: Row, reason: str, error: BaseException | None = None, fit: bool = True) -> None:
        """Row r leaves (its request finishes with `reason`); its row and slot are free."""
        r.left = True
        if lane.rows.get(r.index) is r:
            del lane.rows[r.index]
            if r.group >= 0:
                lane.pool.release(r.group)
            if fit:
                self._fit(lane)
        if r in lane.order:
            lane.order.remove(r)
        self.finished.append((r.handle, reason, error))
        self.stats[f"finished_{reason}"] += 1

    def expire(self, now: float) -> None:
        """Cancelled and timed-out rows leave."""
        for lane in self.lanes.values():
            for r in list(lane.rows.values()):
                why = r.handle.overdue(now)
                if why:
                    self.release(lane, r, *why)

    def fail_lane(self, lane: Lane, e: Exception) -> None:
        """A program of the lane failed (after taking its buffers, maybe): every row of the lane
        fails with it, and its device state (rows and pool) is made anew, empty; a lane that
        cannot be made anew is dropped (the next request at its depth makes it again)."""
        err = RuntimeError(f"the batch step failed: {e}")
        for r in list(lane.rows.values()):
            self.release(lane, r, "error", err, fit=False)
        lane.order.clear()
        lane.inflight = None
        lane.pool.reset()
        lane.size = lane.cap = 0
        lane.state = None
        self.stats["step_failures"] += 1
        try:
            lane.state = self.runner.empty_state(lane.loops)
        except Exception:  # noqa: BLE001 - out of memory, say: the lane goes
            self.lanes.pop(lane.loops, None)
            self.runner.forget(lane.loops)

    def fail_all(self, e: Exception) -> None:
        """Something outside a lane's programs failed: every lane fails (`fail_lane`)."""
        for lane in list(self.lanes.values()):
            self.fail_lane(lane, e)

    def close(self, err: BaseException) -> None:
        """The engine stops: running requests end with `err`."""
        for lane in self.lanes.values():
            for r in list(lane.rows.values()):
                r.handle.finish("error", err)
