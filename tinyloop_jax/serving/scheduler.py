"""`Scheduler`: the batch side of the engine's loop, on its thread only — the lanes (one per
depth), queued requests placed into rows, one iteration of prompt chunks and decode steps, and
rows leaving. It decides with the pure functions of `lane` and the records of `pool`, and runs
device programs through `runner.Runner`; it knows nothing of threads or the queue.
"""

from __future__ import annotations

import collections
from typing import Callable

import jax.numpy as jnp
import numpy as np

from .handles import Handle
from .lane import Lane, Limits, Row, choose_prefix, decode_rows, entry_capacity, place, prefill_turns, shrinks
from .pool import PrefixPool
from .programs import Chunk
from .runner import Runner
from ..api.prefix import PrefixCache
from ..api.store import PrefixStore
from ..decoding.sampling import Request
from ..model.kv_modes import KVMode
from ..model.cache import bucket


class Scheduler:
    """The rows of every depth over one model. `stats`: the engine's counters (this side counts
    prefix hits, chunks, steps, tokens out, finished requests); `on_first_token(handle)`: told
    when a request emits its first token."""

    def __init__(self, model, limits: Limits, store: PrefixStore | None, store_bytes: int, insert_prompts: bool,
                 work_mode: KVMode, stats: collections.Counter, on_first_token: Callable[[Handle], None]):
        self.model, self.limits = model, limits
        self.default_store, self.store_bytes = store, store_bytes
        self.insert_prompts = insert_prompts
        self.runner = Runner(model.weights, limits, work_mode)
        self.lanes: dict[int, Lane] = {}
        self.stats = stats
        self._on_first_token = on_first_token

    def running(self) -> int:
        """Requests in the batch (all depths)."""
        return sum(len(lane.rows) for lane in self.lanes.values())

    def busy(self) -> bool:
        return any(lane.rows for lane in self.lanes.values())

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
        lane = self.lane(loops)
        if lane.rows:
            raise RuntimeError("warmup() runs before requests are served")
        before = len(self.runner.programs)
        self.runner.warmup(lane, self.insert_prompts)
        lane.pool.clear(0)  # warmup wrote into slot 0 (then emptied it)
        return len(self.runner.programs) - before

    # ---- admission ---------------------------------------------------------------------------

    def place(self, h: Handle) -> bool:
        """Give a request a row (and a pool slot); False: it must wait for a slot to free up."""
        lane = self.lane(h.loops)
        p = place(self.limits, lane, len(h.prompt), h.params.max_tokens, *self._prefix(lane, h.prompt))
        if p is None:
            return False
        if p.load is not None:
            slot, source, n = p.load
            self._load(lane, slot, source, n)
            if p.shares:  # a store entry now pooled: others may read it too
                lane.pool.hold(slot, source.prompt, min(len(source), self.limits.prefix_capacity), source)
        if (p.size, p.cap) != (lane.size, lane.cap):
            self.runner.reshape(lane, p.size, p.cap)
        i = next(i for i in range(lane.size) if i not in lane.rows)
        h.prefix_tokens = p.limit
        self.stats["requests_prefix_hit" if p.limit else "requests_prefix_miss"] += 1
        self.stats["prefix_tokens_reused"] += p.limit
        lane.rows[i] = r = Row(h, i, p.group, p.limit, p.limit, p.need, p.owner)
        if p.group >= 0:
            entry = lane.pool.acquire(p.group).entry
            if entry is not None:
                lane.store.touch(entry)
        if p.owner:  # the slot holds this prompt once prefilled; until then no one else matches it
            lane.pool.clear(p.group)
        lane.order.append(r)
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
        """Move the batch back to row_capacity once no row needs more; release it when empty."""
        if not lane.rows:
            self.runner.release_rows(lane)
        elif shrinks(self.limits, lane):
            self.runner.reshape(lane, lane.size, self.limits.row_capacity)

    # ---- one iteration -----------------------------------------------------------------------

    def step(self) -> None:
        """Per lane: prompt chunks within the iteration's budget, then one decode step."""
        for lane in list(self.lanes.values()):
            for r, n in prefill_turns(lane.order, self.limits.chunk):
                self._prefill(lane, r, n)
            if any(r.decoding for r in lane.rows.values()):
                self._decode(lane)

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
        try:
            chunk = Chunk.make(r.index, tokens, n, r.fed, r.fed == r.limit, r.group, r.limit, prompt_seen,
                               Request.from_params([h.params], stops=False))
            tok, logits, states = self.runner.prefill(lane, chunk, into_slot=r.owner)
            self.stats["prefill_chunks"] += 1
            r.fed += n
            if not final:
                return
            lane.order.popleft()
            if r.owner:  # the slot now holds the whole prompt: the row reads it all, others may share it
                r.limit = len(h.prompt)
                lane.pool.hold(r.group, h.prompt, r.limit)
                self.runner.reset_row(lane, r.index, r.limit)
                if self.insert_prompts:
                    lane.pool[r.group].entry = self._insert(lane, r, logits, states, prompt_seen)
            r.decoding = True
            self._tokens(lane, {r.index: int(tok)})
        except Exception as e:  # noqa: BLE001 - one request's prompt failed
            if lane.order and lane.order[0] is r:
                lane.order.popleft()
            self.release(lane, r, "error", e)
            self.stats["requests_failed"] += 1
            if self.runner.lost(lane):
                raise

    def _insert(self, lane: Lane, r: Row, logits, states, prompt_seen) -> PrefixCache:
        """A prompt prefilled into its pool slot, as a store entry (a copy of the slot's positions,
        in a power-of-two capacity: few programs)."""
        n = len(r.handle.prompt)
        seg = self.runner.extract(lane, r.group, n, entry_capacity(n))
        prompt = np.array(r.handle.prompt, np.int32)
        prompt.setflags(write=False)
        entry = PrefixCache(cache=seg, prompt=prompt, loops=lane.loops, cache_window=0, logits=logits,
                            seen=jnp.asarray(prompt_seen), depth_states=states, weights=self.model.weights)
        lane.store.insert(entry)
        return entry

    def _decode(self, lane: Lane) -> None:
        rows = decode_rows(lane.rows, lane.size, self.limits.slots)
        tok = self.runner.decode(lane, rows)
        self.stats["decode_steps"] += 1
        self.stats["batch_rows"] += int(rows.active.sum())
        self._tokens(lane, {i: int(tok[i]) for i in np.flatnonzero(rows.active)})

    def _tokens(self, lane: Lane, new: dict) -> None:
        """Emit each row's new token; rows that are done leave."""
        for i, t in new.items():
            r = lane.rows[i]
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
        if lane.rows.get(r.index) is r:
            del lane.rows[r.index]
            if r.group >= 0:
                lane.pool.release(r.group)
            if fit:
                self._fit(lane)
        if r in lane.order:
            lane.order.remove(r)
        r.handle.finish(reason, error)
        self.stats[f"finished_{reason}"] += 1

    def expire(self, now: float) -> None:
        """Cancelled and timed-out rows leave."""
        for lane in self.lanes.values():
            for r in list(lane.rows.values()):
                why = r.handle.overdue(now)
                if why:
                    self.release(lane, r, *why)

    def fail_all(self, e: Exception) -> None:
        """A step failed: every row fails with it, the buffers are released (a lost pool is made
        anew, empty)."""
        for lane in list(self.lanes.values()):
            for r in list(lane.rows.values()):
                self.release(lane, r, "error", RuntimeError(f"the batch step failed: {e}"), fit=False)
            if self.runner.recover(lane):
                lane.pool.reset()

    def close(self, err: BaseException) -> None:
        """The engine stops: running requests end with `err`."""
        for lane in self.lanes.values():
            for r in list(lane.rows.values()):
                r.handle.finish("error", err)
