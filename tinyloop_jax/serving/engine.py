"""`Engine`: continuous batching of independent requests over the prefix store, on one device
loop (a background thread).

    engine = tl.Engine(model, max_batch=16)
    h = engine.submit(prompt_ids, max_tokens=64)      # returns at once
    for tok in h.stream(): ...                        # tokens as they are emitted
    h.result()                                        # == model.generate(prompt_ids, max_tokens=64)

Each iteration of the loop, per depth (a *lane*: requests at one `loops` share programs,
prefixes and a store):

  1. waiting requests join free rows of the batch; each is matched against the prefix pool and
     the store (the longest cached prefix it shares is read, never recomputed);
  2. prompt chunks of the requests still prefilling, oldest first, up to `prefill_chunk` tokens
     (several short prompt rests, or one chunk of a long prompt), so a long prompt delays the
     running rows by one chunk per step, never by its whole length;
     after its last chunk the request emits its first token and its prompt goes into the store;
  3. one decode step for every row past its prompt; rows that hit a stop sequence, their
     max_tokens, a cancel or their deadline leave at once and their row is free.

Stop sequences, max_tokens and the per-request bookkeeping run on the host between steps;
token choice runs on the device with the same `select_tokens` as `generate`, so a greedy
output equals `model.generate` token for token and a seeded sample is reproducible
whatever else is in flight (each row draws with its own seed and token index).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from . import programs as B
from ..model import cache as kvc
from ..api import functional as F
from ..api import validation as check
from ..api.prefix import PrefixCache
from ..decoding.sampling import Request
from ..api.store import PrefixStore


class QueueFull(RuntimeError):
    """`submit` when the engine's queue is full (the server's HTTP 429)."""


class RequestTimeout(RuntimeError):
    """A request that passed its deadline (`timeout`)."""


class Cancelled(RuntimeError):
    """`result()` of a cancelled request."""


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def slot_buckets(slots: int, n: int) -> int:
    """How many pool slots a step reads when its rows read n distinct ones: 1 or 2 (a copy of
    them), else all of them in place (copying more than a quarter of the pool costs more than
    reading all of it)."""
    return n if n <= 2 and 4 * n <= slots else slots


def entry_capacity(n: int) -> int:
    """Capacity of a store entry the engine makes for an n-token prompt: a power of two."""
    return max(16, 1 << (n - 1).bit_length())


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes programs are compiled for: powers of two below max_batch, and max_batch."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})


# ---- a request -------------------------------------------------------------------------------

@dataclass
class Sampling:
    """One request's knobs (checked by `validation`, as `generate` checks them)."""
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    stops: list  # token-id lists
    loops: int


class Handle:
    """A submitted request. `result()` blocks for prompt + emitted tokens (what `generate`
    returns); `stream()` yields emitted token ids as they come; `cancel()` frees its row.
    `aresult()` / `astream()` are the same for asyncio code."""

    _ids = itertools.count()

    def __init__(self, engine: "Engine", prompt: np.ndarray, sampling: Sampling, deadline: float | None):
        self.id = next(Handle._ids)
        self.prompt, self.sampling, self.deadline = prompt, sampling, deadline
        self.tokens: list[int] = []
        self.finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "timeout" | "error"
        self.stop_matched: list[int] | None = None  # the stop sequence that ended it
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.prefix_tokens = 0  # prompt tokens read from a cached prefix
        self._engine = engine
        self._cancel = False
        self._cv = threading.Condition()
        self._wakers: list = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop generating; the row is freed before the next step. No effect once done."""
        self._cancel = True
        self._engine._cancelled(self)

    # engine side
    def _emit(self, tok: int) -> None:
        with self._cv:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.tokens.append(tok)
            self._cv.notify_all()
            wakers = list(self._wakers)
        for w in wakers:
            w()

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        with self._cv:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
            self.finished_at = time.perf_counter()
            self._cv.notify_all()
            wakers = list(self._wakers)
        for w in wakers:
            w()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # caller side
    def result(self, timeout: float | None = None) -> list[int]:
        """prompt + emitted tokens; raises the request's error (Cancelled, RequestTimeout, ...)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} is still running after {timeout} s")
        self._raise()
        return self.prompt.tolist() + list(self.tokens)

    def stream(self):
        """Emitted token ids as they come; ends when the request ends (raising its error, if any,
        except a cancel)."""
        i = 0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: len(self.tokens) > i or self.done)
                new, done = self.tokens[i:], self.done
            i += len(new)
            yield from new
            if done and i == len(self.tokens):
                if not isinstance(self.error, Cancelled):
                    self._raise()
                return

    async def astream(self):
        """`stream()` for asyncio: never blocks the event loop."""
        loop, event = asyncio.get_running_loop(), asyncio.Event()

        def wake():
            loop.call_soon_threadsafe(event.set)

        with self._cv:
            self._wakers.append(wake)
        try:
            i = 0
            while True:
                with self._cv:
                    event.clear()
                    new, done = self.tokens[i:], self.done
                i += len(new)
                for t in new:
                    yield t
                if done and i == len(self.tokens):
                    if not isinstance(self.error, Cancelled):
                        self._raise()
                    return
                if not new:
                    await event.wait()
        finally:
            with self._cv:
                self._wakers.remove(wake)

    async def aresult(self) -> list[int]:
        async for _ in self.astream():
            pass
        return self.result()


# ---- a lane: the rows and prefixes of one depth -----------------------------------------------

@dataclass
class _Row:
    handle: Handle
    index: int
    group: int  # pool slot, -1: none
    limit: int  # prompt positions read from the pool slot
    fed: int  # prompt positions in place (limit + prefilled)
    need: int  # positions its own segment must hold
    owner: bool = False  # its prompt is prefilled into its pool slot (a long prompt)
    decoding: bool = False


@dataclass
class _Lane:
    loops: int
    store: PrefixStore
    exit: object
    size: int = 0  # rows allocated (a bucket)
    cap: int = 0  # positions per row (Co)
    own: object = None  # KVCache [size]
    seen: object = None  # [size, V] bool
    pool: object = None  # KVCache [G]
    pool_entries: list = field(default_factory=list)  # the store's PrefixCache of each slot, if any
    pool_prompt: list = field(default_factory=list)  # the prompt each slot holds (None: free)
    pool_len: list = field(default_factory=list)  # positions held per slot
    pool_refs: list = field(default_factory=list)  # rows reading each slot
    pool_used: list = field(default_factory=list)  # tick of last use
    rows: dict = field(default_factory=dict)  # index -> _Row
    order: collections.deque = field(default_factory=collections.deque)  # rows still prefilling, FIFO
    req: dict = field(default_factory=dict)  # numpy [size] Request fields
    last: object = None  # numpy [size] int32


class Engine:
    """Continuous batching over a `PrefixStore`, thread-safe, one device loop.

    max_batch: rows decoded together (all depths). store: the PrefixStore at the model's
    default depth (default: a new one of `store_bytes`); other depths get their own. max_queue:
    requests waiting beyond the running ones (then `submit` raises `QueueFull`). timeout:
    default per-request deadline in seconds (None: none). prefill_chunk: prompt tokens per
    chunk. prefix_slots / prefix_capacity: the pool of shared prefixes a step reads (G slots of
    Cp positions; default Cp: the model's context); a prompt whose uncached rest is longer
    than 32 tokens (or a chunk, if smaller) is prefilled into a free slot. row_capacity:
    positions of a row's own segment (default min(context, 256)); the batch moves to the
    model's whole context while a row needs more, and back. insert_prompts: add the prompts
    prefilled into a pool slot to the store. prefix_cache=False: no store
    and no pool (every prompt prefilled whole into its row; the baseline of
    scripts/bench_serve.py).
    """

    def __init__(self, model, max_batch: int = 16, store: PrefixStore | None = None, *, max_queue: int = 256,
                 timeout: float | None = None, prefill_chunk: int = 64, prefix_slots: int = 8,
                 prefix_capacity: int | None = None, row_capacity: int | None = None, store_bytes: int = 512 << 20,
                 insert_prompts: bool = True, prefix_cache: bool = True):
        self.model = model
        c = model.weights.config
        if c.mesh is not None:
            raise ValueError("Engine runs on one device; this model is placed on a mesh")
        for name, v in dict(max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                            prefix_slots=prefix_slots).items():
            if check.integer(v, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if store is not None:
            if not isinstance(store, PrefixStore) or store.model is not model:
                raise ValueError("store must be a PrefixStore of this model")
            if store.cache_window != 0:
                raise ValueError(f"the engine serves full-context prefixes; store has cache_window="
                                 f"{store.cache_window}")
        self.max_batch, self.max_queue, self.timeout = max_batch, max_queue, timeout
        self.chunk = kvc.bucket(prefill_chunk)
        self.chunk_sizes = sorted({kvc.bucket(n) for n in range(1, self.chunk + 1)})  # 16, 32, 64, ...
        # a prompt rest longer than this is prefilled into a pool slot (and stored); shorter ones
        # on top of a cached prefix go into the row
        self.long_rest = min(self.chunk, 32)
        self.slots = prefix_slots
        self.max_capacity = kvc.bucket(c.max_seq_len)
        self.row_capacity = min(self.max_capacity, kvc.bucket(row_capacity or 256))
        self.prefix_capacity = kvc.bucket(prefix_capacity or c.max_seq_len)
        self.work_mode = c.storage.working
        # h modes: rows hold float32 K/V, which cannot be stored back in h form; such an engine
        # reads the store but does not add to it
        self.insert_prompts = insert_prompts and prefix_cache and self.work_mode == c.storage
        self.prefix_cache = prefix_cache  # False: every prompt is prefilled whole (a baseline)
        self.store_bytes = store_bytes
        self._default_store = store
        self._lanes: dict[int, _Lane] = {}
        self._queue: collections.deque[Handle] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._jobs: list = []  # work for the loop thread (warmup)
        self._programs: set = set()
        self._warm = False
        self._tick = 0
        self._stats = collections.Counter()
        self._ttft: collections.deque = collections.deque(maxlen=2048)
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="tinyloop-engine", daemon=True)
        self._thread.start()

    # ---- public ------------------------------------------------------------------------------

    def submit(self, prompt, max_tokens: int = 32, temperature: float = 0.0, top_k: int = 50, top_p: float = 1.0,
               repetition_penalty: float = 1.0, stop_sequences=(), seed: int = 0, loops: int | None = None,
               timeout: float | None = None) -> Handle:
        """Queue a request (the arguments of `model.generate`); returns its `Handle` at once.
        Bad arguments raise here (ValueError / RuntimeError) and nothing is queued; a full
        queue raises `QueueFull`."""
        c = self.model.weights.config
        prompt = check.tokens(prompt, c.vocab_size)
        req = check.request(1, c.vocab_size, dict(locals()), batch=False)
        loops = c.default_loops if loops is None else check.loops(loops)
        if len(prompt) + max_tokens > c.max_seq_len:
            raise RuntimeError(f"prompt + max_tokens is {len(prompt) + max_tokens} tokens, longer than "
                               f"max_seq_len={c.max_seq_len}")
        timeout = self.timeout if timeout is None else timeout
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        stops = [s[s >= 0].tolist() for s, n in zip(req.stop.tokens[0], req.stop.lengths[0]) if n > 0]
        sampling = Sampling(int(req.max_tokens[0]), float(req.temperature[0]), int(req.top_k[0]), float(req.top_p[0]),
                            float(req.repetition_penalty[0]), int(req.seed[0]), stops, loops)
        h = Handle(self, prompt, sampling, None if timeout is None else time.perf_counter() + timeout)
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            if len(self._queue) >= self.max_queue:
                self._stats["requests_rejected"] += 1
                raise QueueFull(f"the engine's queue is full ({self.max_queue} requests waiting); retry later")
            self._queue.append(h)
            self._stats["requests"] += 1
            self._stats["tokens_in"] += len(prompt)
            self._cv.notify_all()
        return h

    def generate(self, prompt, **kw) -> list[int]:
        """submit(...).result(): blocking, like `model.generate`."""
        return self.submit(prompt, **kw).result()

    def warmup(self, loops: int | None = None) -> int:
        """Compile the step programs of every batch bucket at `loops` (default depth) now, so
        serving compiles nothing for them later. Returns the number of programs compiled."""
        loops = self.model.weights.config.default_loops if loops is None else check.loops(loops)
        done = threading.Event()
        box: dict = {}

        def job():
            try:
                box["n"] = self._warmup(loops)
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                box["e"] = e
            done.set()

        with self._cv:
            self._jobs.append(job)
            self._cv.notify_all()
        done.wait()
        if "e" in box:
            raise box["e"]
        return box["n"]

    def stats(self) -> dict:
        """Counters: requests (submitted, finished by reason, rejected, failed), tokens in/out,
        prefix hits / tokens reused, queue depth, running rows, batch size per step, time to
        first token (p50/p99 of recent requests), tokens per second, compiles after warmup."""
        with self._cv:
            s = dict(self._stats)
            s["queue_depth"] = len(self._queue)
            s["running"] = sum(len(lane.rows) for lane in self._lanes.values())
            ttft = sorted(self._ttft)
        up = time.perf_counter() - self._started
        s["uptime_s"] = up
        s["tokens_per_second"] = s.get("tokens_out", 0) / up if up > 0 else 0.0
        steps = s.get("decode_steps", 0)
        s["mean_batch_size"] = s.get("batch_rows", 0) / steps if steps else 0.0
        n = s.get("requests_prefix_hit", 0) + s.get("requests_prefix_miss", 0)
        s["prefix_hit_rate"] = s.get("requests_prefix_hit", 0) / n if n else 0.0
        s["ttft_p50_s"] = ttft[len(ttft) // 2] if ttft else 0.0
        s["ttft_p99_s"] = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else 0.0
        s["programs"] = len(self._programs)
        return s

    def close(self) -> None:
        """Stop the loop; queued and running requests fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _cancelled(self, h: Handle) -> None:
        """A queued request leaves the queue at once (its place is free); a running one leaves the
        batch before the next step."""
        with self._cv:
            if h in self._queue:
                self._queue.remove(h)
                h._finish("cancelled", Cancelled(f"request {h.id} was cancelled"))
                self._stats["finished_cancelled"] += 1
            self._cv.notify_all()

    # ---- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._queue or self._jobs
                                  or any(lane.rows for lane in self._lanes.values()))
                if self._closed:
                    break
                jobs, self._jobs = self._jobs, []
            for job in jobs:
                job()
            try:
                self._expire()
                self._admit()
                for lane in list(self._lanes.values()):
                    budget = self.chunk  # prompt tokens per iteration: several short rests, or one chunk
                    while lane.order and budget > 0:
                        budget -= self._prefill(lane)
                    if any(r.decoding for r in lane.rows.values()):
                        self._decode(lane)
            except Exception as e:  # noqa: BLE001 - a failed step fails its rows, never the loop
                self._fail_all(e)
        err = RuntimeError("engine is closed")
        with self._cv:
            pending, self._queue = list(self._queue), collections.deque()
        for h in pending:
            h._finish("error", err)
        for lane in self._lanes.values():
            for r in list(lane.rows.values()):
                r.handle._finish("error", err)

    def _fail_all(self, e: Exception) -> None:
        for lane in list(self._lanes.values()):
            for r in list(lane.rows.values()):
                self._release(lane, r, "error", RuntimeError(f"the batch step failed: {e}"))
            lane.size, lane.cap, lane.req = 0, 0, {}  # reallocated on the next request
            lane.own = lane.seen = lane.last = None
        self._stats["step_failures"] += 1

    def _expire(self) -> None:
        """Cancelled and timed-out requests leave (queued or running)."""
        now = time.perf_counter()

        def gone(h: Handle):
            if h._cancel:
                return "cancelled", Cancelled(f"request {h.id} was cancelled")
            if h.deadline is not None and now > h.deadline:
                return "timeout", RequestTimeout(f"request {h.id} passed its deadline "
                                                 f"({h.deadline - h.submitted:.3g} s)")
            return None

        with self._cv:
            keep = collections.deque()
            for h in self._queue:
                why = gone(h)
                if why:
                    h._finish(*why)
                    self._stats[f"finished_{why[0]}"] += 1
                else:
                    keep.append(h)
            self._queue = keep
        for lane in self._lanes.values():
            for r in list(lane.rows.values()):
                why = gone(r.handle)
                if why:
                    self._release(lane, r, *why)

    # ---- admission ---------------------------------------------------------------------------

    def _running(self) -> int:
        return sum(len(lane.rows) for lane in self._lanes.values())

    def _admit(self) -> None:
        while self._running() < self.max_batch:
            with self._cv:
                if not self._queue:
                    return
                h = self._queue.popleft()
            try:
                if not self._place(h):  # it waits for a pool slot, at the head of the queue
                    with self._cv:
                        self._queue.appendleft(h)
                    return
            except Exception as e:  # noqa: BLE001 - this request fails alone
                h._finish("error", e)
                self._stats["requests_failed"] += 1

    def _lane(self, loops: int) -> _Lane:
        lane = self._lanes.get(loops)
        if lane is None:
            store = self._default_store if loops == (self._default_store.loops if self._default_store else None) \
                else None
            if store is None:
                store = PrefixStore(self.model, max_bytes=self.store_bytes, loops=loops)
                if self._default_store is None and loops == self.model.weights.config.default_loops:
                    self._default_store = store
            lane = _Lane(loops, store, self.model._exit(None, None, loops))
            w = self.model.weights
            lane.pool = F.empty_cache(w, self.prefix_capacity * self.slots, loops, kv_mode=self.work_mode)
            lane.pool_entries, lane.pool_prompt = [None] * self.slots, [None] * self.slots
            lane.pool_len = [0] * self.slots
            lane.pool_refs, lane.pool_used = [0] * self.slots, [0] * self.slots
            self._lanes[loops] = lane
        return lane

    @property
    def store(self) -> PrefixStore | None:
        """The store of the default depth (created with the first request if none was given)."""
        return self._default_store

    def _reshape(self, lane: _Lane, size: int, cap: int) -> None:
        """The lane's rows as `size` rows (a batch bucket) of `cap` positions, keeping the rows
        in use (at their indices)."""
        w, c = self.model.weights, self.model.weights.config
        if lane.own is None:
            lane.own = F.empty_cache(w, cap, lane.loops, kv_mode=self.work_mode, batch=size)
            lane.seen = jnp.zeros((size, c.vocab_size), bool)
        elif (size, cap) != (lane.size, lane.cap):
            self._count("reshape", lane.loops, lane.size, lane.cap, size, cap)
            idx = jnp.asarray(np.minimum(np.arange(size), lane.size - 1), jnp.int32)
            lane.own, lane.seen = B.reshape_rows(lane.own, lane.seen, idx, capacity=cap)
        old = lane.req
        fresh = dict(temperature=np.zeros(size, np.float32), top_k=np.zeros(size, np.int32),
                     top_p=np.ones(size, np.float32), repetition_penalty=np.ones(size, np.float32),
                     seed=np.zeros(size, np.uint32), max_tokens=np.ones(size, np.int32))
        for k, v in old.items():
            fresh[k][:len(v)] = v[:size]
        lane.req = fresh
        last = np.zeros(size, np.int32)
        if lane.last is not None:
            last[:min(size, len(lane.last))] = lane.last[:size]
        lane.last, lane.size, lane.cap = last, size, cap

    def _fit(self, lane: _Lane) -> None:
        """Move the batch back to row_capacity once no row needs more; release it when empty."""
        if not lane.rows:
            lane.own = lane.seen = lane.last = None
            lane.size, lane.cap, lane.req = 0, 0, {}
        elif lane.cap > self.row_capacity and max(r.need for r in lane.rows.values()) <= self.row_capacity:
            self._reshape(lane, lane.size, self.row_capacity)

    def _place(self, h: Handle) -> bool:
        """Give a request a row (and a pool slot); False: it must wait for a slot to free up."""
        s, n = h.sampling, len(h.prompt)
        lane = self._lane(s.loops)
        group, limit, source = self._prefix(lane, h.prompt)
        owner = False
        if n - limit > self.long_rest and n <= self.prefix_capacity and self.prefix_cache:  # into a pool slot
            slot = self._free_slot(lane)
            if slot is None and n - limit + s.max_tokens > self.row_capacity:
                return False  # rather than moving every row to the whole context (rows hold slots: one frees)
            if slot is not None:
                self._load(lane, slot, source if source is not None else group, limit)
                group, owner = slot, True
        elif source is not None and group < 0:  # a cached prefix not pooled yet
            slot = self._free_slot(lane)
            if slot is not None:
                self._load(lane, slot, source, len(source))
                lane.pool_prompt[slot], lane.pool_len[slot] = source.prompt, min(len(source), self.prefix_capacity)
                lane.pool_entries[slot] = source
                group = slot
        if group < 0:
            limit = 0
        need = s.max_tokens + (0 if owner else n - limit)
        free = [i for i in range(lane.size) if i not in lane.rows]
        size = lane.size if free else next(b for b in batch_buckets(self.max_batch) if b > len(lane.rows))
        cap = max(lane.cap, self.row_capacity if need <= self.row_capacity else self.max_capacity)
        if (size, cap) != (lane.size, lane.cap):
            self._reshape(lane, size, cap)
        i = next(i for i in range(lane.size) if i not in lane.rows)
        h.prefix_tokens = limit
        self._stats["requests_prefix_hit" if limit else "requests_prefix_miss"] += 1
        self._stats["prefix_tokens_reused"] += limit
        lane.rows[i] = r = _Row(h, i, group, limit, limit, need, owner)
        if group >= 0:
            lane.pool_refs[group] += 1
            self._tick += 1
            lane.pool_used[group] = self._tick
            if lane.pool_entries[group] is not None:
                lane.store.touch(lane.pool_entries[group])
        if owner:  # the slot holds this prompt once prefilled; until then no one else matches it
            lane.pool_prompt[group], lane.pool_len[group], lane.pool_entries[group] = None, 0, None
        lane.order.append(r)
        for k, v in dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                         repetition_penalty=s.repetition_penalty, seed=s.seed, max_tokens=s.max_tokens).items():
            lane.req[k][i] = v
        return True

    def _prefix(self, lane: _Lane, prompt: np.ndarray) -> tuple[int, int, PrefixCache | None]:
        """(pool slot or -1, positions it serves, the store entry to load instead or None) for a
        prompt: the pooled prefix sharing the most of it, unless the store holds one longer by
        more than a chunk. At least the prompt's last token is always prefilled (its logits)."""
        if not self.prefix_cache:
            return -1, 0, None
        cap = min(len(prompt) - 1, self.prefix_capacity)
        best_g, best_k = -1, 0
        for g, p in enumerate(lane.pool_prompt):
            if p is not None:
                k = min(common_prefix(p, prompt), lane.pool_len[g], cap)
                if k > best_k:
                    best_g, best_k = g, k
        entry, k = lane.store.lookup(prompt)
        k = min(k, cap) if entry is not None else 0
        if k > best_k + self.chunk or (k > best_k and best_g < 0):
            return -1, k, entry
        return best_g, best_k, None

    def _free_slot(self, lane: _Lane) -> int | None:
        """The least recently used pool slot no row reads, if any."""
        free = [g for g in range(self.slots) if lane.pool_refs[g] == 0]
        return min(free, key=lambda j: lane.pool_used[j]) if free else None

    def _load(self, lane: _Lane, g: int, source, n: int) -> None:
        """Pool slot g <- the first n positions of `source` (a store entry, or -1 / None: the
        slot emptied; an int: another pool slot)."""
        w = self.model.weights
        cp = self.prefix_capacity
        if isinstance(source, PrefixCache) and n > 0:
            src, mat = source.cache, self.work_mode != w.config.storage
        else:  # empty the slot, or copy from a slot that holds a prefix already in working form
            src, mat, n = B.pool_slot(lane.pool, cp, jnp.int32(max(source if isinstance(source, int) else g, 0))), \
                False, n if isinstance(source, int) else 0
        self._count("load", lane.loops, src.capacity, mat)
        lane.pool = B.load_slot(w.params, w.config, lane.pool, jnp.int32(g), src, jnp.int32(min(n, cp)),
                                passes=lane.loops, materialize=mat, slot_len=cp)
        lane.pool_entries[g], lane.pool_prompt[g], lane.pool_len[g] = None, None, 0
        self._stats["prefix_pool_loads"] += 1

    # ---- device steps ------------------------------------------------------------------------

    def _count(self, *key) -> None:
        if key not in self._programs:
            self._programs.add(key)
            if self._warm:
                self._stats["compiles_after_warmup"] += 1

    def _request(self, lane: _Lane, rows=None) -> Request:
        r = lane.req if rows is None else {k: v[rows] for k, v in lane.req.items()}
        n = len(r["seed"])
        stop = Request.make(n).stop  # stops are checked on the host
        return Request(temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"],
                       repetition_penalty=r["repetition_penalty"], seed=r["seed"], max_tokens=r["max_tokens"],
                       stop=stop)

    def _prefill(self, lane: _Lane) -> int:
        """One chunk of the oldest prompt still prefilling; returns its (padded) length."""
        r = lane.order[0]
        h, w = r.handle, self.model.weights
        c = w.config
        n = len(h.prompt)
        todo = h.prompt[r.fed:r.fed + self.chunk]
        tokens = np.zeros((kvc.bucket(len(todo)),), np.int32)  # a short rest runs a short program
        tokens[:len(todo)] = todo
        final = r.fed + len(todo) == n
        prompt_seen = np.zeros((c.vocab_size,), bool)
        prompt_seen[h.prompt] = True
        try:
            if r.owner:
                self._count("prefill_slot", lane.loops, lane.size, len(tokens))
                tok, logits, states, lane.pool, lane.seen = B.prefill_slot(
                    w.params, c, lane.pool, lane.seen, jnp.int32(r.index), jnp.int32(r.group), jnp.asarray(tokens),
                    jnp.int32(len(todo)), jnp.int32(r.fed), jnp.asarray(prompt_seen), self._request(lane, [r.index]),
                    loops=lane.loops, slot_len=self.prefix_capacity, exit=lane.exit)
            else:
                self._count("prefill", lane.loops, lane.size, lane.cap, len(tokens))
                tok, logits, states, lane.own, lane.seen = B.prefill_chunk(
                    w.params, c, lane.pool, lane.own, jnp.int32(r.index), jnp.asarray(tokens), jnp.int32(len(todo)),
                    jnp.int32(r.fed), jnp.bool_(r.fed == r.limit), jnp.int32(r.group), jnp.int32(r.limit), lane.seen,
                    jnp.asarray(prompt_seen), self._request(lane, [r.index]), loops=lane.loops,
                    slot_len=self.prefix_capacity, exit=lane.exit)
            self._stats["prefill_chunks"] += 1
            r.fed += len(todo)
            if not final:
                return len(tokens)
            lane.order.popleft()
            if r.owner:  # the slot now holds the whole prompt: the row reads it all, others may share it
                r.limit = n
                lane.pool_prompt[r.group], lane.pool_len[r.group] = h.prompt, n
                self._fresh_row(lane, r)
            if self.insert_prompts and r.owner:
                self._insert(lane, r, logits, states, prompt_seen)
            r.decoding = True
            self._tokens(lane, {r.index: int(tok)})
            return len(tokens)
        except Exception as e:  # noqa: BLE001 - one request's prompt failed
            if lane.order and lane.order[0] is r:
                lane.order.popleft()
            self._release(lane, r, "error", e)
            self._stats["requests_failed"] += 1
            if lane.own is None or any(a.is_deleted() for a in jax.tree.leaves(lane.own)):
                raise
            return len(tokens)

    def _fresh_row(self, lane: _Lane, r: _Row) -> None:
        self._count("reset", lane.size, lane.cap)
        lane.own = B.reset_row(lane.own, jnp.int32(r.index), jnp.int32(r.limit))

    def _insert(self, lane: _Lane, r: _Row, logits, states, prompt_seen) -> None:
        """A prompt prefilled into its pool slot, as a store entry (a copy of the slot's positions,
        in a power-of-two capacity: few programs)."""
        h, w = r.handle, self.model.weights
        cap = entry_capacity(len(h.prompt))
        self._count("extract", lane.loops, cap)
        seg = B.slot_prefix(lane.pool, jnp.int32(r.group), jnp.int32(len(h.prompt)), capacity=cap,
                            slot_len=self.prefix_capacity)
        prompt = np.array(h.prompt, np.int32)
        prompt.setflags(write=False)
        entry = PrefixCache(cache=seg, prompt=prompt, loops=lane.loops, cache_window=0, logits=logits,
                            seen=jnp.asarray(prompt_seen), depth_states=states, weights=w)
        lane.store.insert(entry)
        lane.pool_entries[r.group] = entry

    def _decode(self, lane: _Lane) -> None:
        w = self.model.weights
        active = np.zeros((lane.size,), bool)
        group, limit, steps = (np.zeros(lane.size, np.int32) for _ in range(3))
        decoding = [r for r in lane.rows.values() if r.decoding]
        read = sorted({r.group for r in decoding if r.group >= 0}) or [0]
        if slot_buckets(self.slots, len(read)) == self.slots:
            read = list(range(self.slots))
        ids = np.array(read, np.int32)
        for r in decoding:  # a row reads only its slot of the step's slots (masked by position)
            i = r.index
            active[i], steps[i] = True, len(r.handle.tokens)
            group[i], limit[i] = (read.index(r.group), r.limit) if r.group >= 0 else (-1, 0)
        self._count("decode", lane.loops, lane.size, lane.cap, len(ids))
        tok, lane.own, lane.seen = B.decode_step(w.params, w.config, lane.pool, jnp.asarray(ids), lane.own,
                                                 jnp.asarray(lane.last), jnp.asarray(group), jnp.asarray(limit),
                                                 jnp.asarray(active), lane.seen, self._request(lane),
                                                 jnp.asarray(steps), loops=lane.loops, slot_len=self.prefix_capacity,
                                                 exit=lane.exit)
        tok = np.asarray(tok)
        self._stats["decode_steps"] += 1
        self._stats["batch_rows"] += int(active.sum())
        self._tokens(lane, {i: int(tok[i]) for i in np.flatnonzero(active)})

    def _tokens(self, lane: _Lane, new: dict) -> None:
        """Emit each row's new token; rows that are done leave."""
        for i, t in new.items():
            r = lane.rows[i]
            h, s = r.handle, r.handle.sampling
            h._emit(t)
            lane.last[i] = t
            self._stats["tokens_out"] += 1
            if len(h.tokens) == 1:
                with self._cv:
                    self._ttft.append(h.first_token_at - h.submitted)
            stop = next((q for q in s.stops if len(q) <= len(h.tokens) and h.tokens[-len(q):] == q), None)
            if stop is not None:
                h.stop_matched = stop
                self._release(lane, r, "stop")
            elif len(h.tokens) >= s.max_tokens:
                self._release(lane, r, "length")

    def _release(self, lane: _Lane, r: _Row, reason: str, error: BaseException | None = None) -> None:
        if lane.rows.get(r.index) is r:
            del lane.rows[r.index]
            if r.group >= 0:
                lane.pool_refs[r.group] -= 1
            if r.owner and lane.pool_prompt[r.group] is None:  # left before its prompt was in place
                lane.pool_len[r.group] = 0
            self._fit(lane)
        if r in lane.order:
            lane.order.remove(r)
        r.handle._finish(reason, error)
        self._stats[f"finished_{reason}"] += 1

    def _warmup(self, loops: int) -> int:
        lane = self._lane(loops)
        if lane.rows:
            raise RuntimeError("warmup() runs before requests are served")
        w, c = self.model.weights, self.model.weights.config
        before = len(self._programs)
        cap, z = self.row_capacity, jnp.int32(0)
        self._fit(lane)
        for size in batch_buckets(self.max_batch):  # grown as serving grows it (the growth copies too)
            self._reshape(lane, size, cap)
            req, no_seen = self._request(lane, [0]), jnp.zeros((c.vocab_size,), bool)
            for t in self.chunk_sizes:
                self._count("prefill", loops, size, cap, t)
                out = B.prefill_chunk(w.params, c, lane.pool, lane.own, z, jnp.zeros((t,), jnp.int32), jnp.int32(1),
                                      z, jnp.bool_(True), jnp.int32(-1), z, lane.seen, no_seen, req, loops=loops,
                                      slot_len=self.prefix_capacity, exit=lane.exit)
                lane.own, lane.seen = out[3], out[4]
                self._count("prefill_slot", loops, size, t)
                out = B.prefill_slot(w.params, c, lane.pool, lane.seen, z, z, jnp.zeros((t,), jnp.int32),
                                     jnp.int32(1), z, no_seen, req, loops=loops, slot_len=self.prefix_capacity,
                                     exit=lane.exit)
                lane.pool, lane.seen = out[3], out[4]
            zeros = jnp.zeros((size,), jnp.int32)
            for n in sorted({slot_buckets(self.slots, n) for n in range(1, self.slots + 1)}):
                self._count("decode", loops, size, cap, n)
                _, lane.own, lane.seen = B.decode_step(w.params, c, lane.pool, jnp.zeros((n,), jnp.int32), lane.own,
                                                       zeros, zeros, zeros, jnp.zeros((size,), bool), lane.seen,
                                                       self._request(lane), zeros, loops=loops,
                                                       slot_len=self.prefix_capacity, exit=lane.exit)
            self._count("reset", size, cap)
            lane.own = B.reset_row(lane.own, z, z)
            jax.block_until_ready(lane.own)
        self._fit(lane)
        self._load(lane, 0, None, 0)  # (the slot warmup wrote into; also the slot-to-slot copy)
        cap = 16
        while cap <= self.prefix_capacity:  # the store entries the engine makes, and their loads
            self._count("extract", loops, cap)
            seg = B.slot_prefix(lane.pool, z, jnp.int32(0), capacity=cap, slot_len=self.prefix_capacity)
            if self.insert_prompts:
                self._count("load", loops, cap, False)
                lane.pool = B.load_slot(w.params, c, lane.pool, z, seg, z, passes=loops, materialize=False,
                                        slot_len=self.prefix_capacity)
            cap *= 2
        self._warm = True
        return len(self._programs) - before
