"""`Batcher`: the engine's loop over page pools, on the loop thread only — requests placed into
request rows with page tables, one step per iteration mixing a prompt chunk with every decode
row, tokens read back and rows leaving. One `Depth` per `loops` (its pool, its `PageBook`, its
request rows); the device work is `step`'s programs.

    admission   the prompt's full pages already in the pool are read (`PageBook.match`), pages
                for the rest and for max_tokens are allocated (cached pages evicted, least
                recently used first); none free: the request waits at the head of the queue
    a step      the oldest prefilling row's next chunk (up to `chunk` tokens) + every decoding
                row's next token, one program; a chunk's full pages are indexed as soon as the
                step is dispatched, so the next request with that prefix reads them
    leaving     a row's pages are released; the full pages of its prompt and output stay cached
                (a chat's next turn reads them)

Memory: every depth's pool and request rows count against one `memory_budget`; a new depth
first evicts idle depths (least recently used), and a request waits while busy depths hold
the room (or fails with `MemoryBudgetError` when nothing can free it).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np

from . import step as S
from .handles import Handle, MemoryBudgetError
from ..api.pages import PageBook
from ..decoding.sampling import Knobs, SamplingParams
from ..model import adaptive as ad
from ..model import paged
from ..model import recurrence as rec
from ..model import cache as kvc
from ..model.cache import bucket

MIN_TABLE = 4  # page-table entries of the smallest program (64 tokens at P = 16)


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def batch_buckets(max_batch: int) -> list[int]:
    """Row counts programs are compiled for: powers of two below max_batch, and max_batch."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})


@dataclass
class Row:
    handle: Handle
    slot: int  # its request row
    pages: list  # its page table: shared pages first, then its own
    fed: int  # prompt positions in the pages
    decoding: bool = False
    ahead: int = 0  # tokens a dispatched step chose for it that the host has not read yet
    left: bool = False  # it left (a step still in flight chose a token for it: discarded)
    credits: int = 0  # local slots promised to it (`LocalSlots`)
    held: set = field(default_factory=set)  # indices of its pages whose local slot it holds


@dataclass
class Depth:
    """One depth's pool, pages and rows (`pool` and `state` are the device side)."""

    loops: int
    exit: object  # tf.Exit or None
    pool: paged.PagedKV
    book: PageBook
    state: S.Requests
    rows: dict = field(default_factory=dict)  # request row -> Row
    prefilling: collections.deque = field(default_factory=collections.deque)  # rows with prompt left, FIFO
    used: int = 0  # tick of its last admission
    inflight: tuple | None = None  # the dispatched step not read yet
    adaptive: bool = False  # a request with an exit rule came in: decode rows take the adaptive-depth step


class Batcher:
    """Request rows of every depth over one model. max_batch: request rows per depth (and the
    decode group's largest bucket); chunk: prompt tokens per step; page_size: tokens per page;
    memory_budget: bytes for every depth's pool and rows (None: each pool holds max_batch rows
    at the whole context); overlap: a step's tokens are read after the next step is dispatched;
    decode_steps: decode steps in one program when no prompt is prefilling or waiting (the
    host's work per dispatch spread over that many tokens; stops are found when read)."""

    def __init__(self, model, max_batch: int, chunk: int, stats: collections.Counter,
                 on_first_token: Callable[[Handle], None], memory_budget: int | None = None, overlap: bool = True,
                 max_lanes: int = 8, page_size: int = paged.PAGE_SIZE, prefix_cache: bool = True, store=None,
                 decode_steps: int = 1):
        self.model, self.max_batch, self.chunk = model, max_batch, bucket(chunk)
        self.decode_steps = decode_steps  # decode steps per dispatch when no prompt waits
        self.waiting = False  # requests wait in the engine's queue (set by the engine each iteration)
        self.prefix_cache = prefix_cache  # False: no prompt reads another's pages
        self.store = store  # a PrefixStore whose entries are loaded into pages when they serve a prompt
        self.stats, self._on_first_token = stats, on_first_token
        self.memory_budget, self.overlap, self.max_lanes, self.page_size = memory_budget, overlap, max_lanes, page_size
        self.depths: dict[int, Depth] = {}
        self._jits: dict[int, dict] = {}  # loops -> its programs (`step.programs`), dropped with the depth
        self.programs: set = set()  # shape keys of the programs run
        self.warm = False
        self.compiles_after_warmup = 0
        self._tick = 0
        self.depth_counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.finished: list = []

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def cfg(self):
        return self.model.weights.config

    def page_nbytes(self, loops: int, layers: int | None = None) -> int:
        """Bytes of a page (of `layers` of its cache layers; default every layer on the pages)."""
        c = self.cfg
        layers = c.n_cache_layers(loops) - len(self.local) if layers is None else layers
        return paged.page_nbytes(c.storage, layers, c.n_kv_heads, self.page_size, c.head_dim, c.d_model)

    @property
    def local(self) -> tuple:
        """The pre layers kept in local slots (`paged.local_layers`)."""
        return paged.local_layers(self.cfg)

    @property
    def local_window(self) -> int:
        return paged.local_window(self.cfg)

    def credits(self, n_pages: int, lookahead: int = 0, chunk: int | None = None) -> int:
        """Local slots a row of n_pages pages holds at most: the pages of its last window and of
        the most positions one step writes."""
        P, W = self.page_size, self.local_window
        T = max(self.chunk if chunk is None else chunk, self.decode_steps, lookahead + 1)
        return min(n_pages, -(-(W - 1) // P) + -(-T // P) + 3)  # (+1: a speculative round rolled back)

    def local_slots(self, n_pages: int) -> int:
        """Local slots beside n_pages pages: half as many, and at least every row's window."""
        return min(n_pages, max(n_pages // 2, self.max_batch * self.credits(n_pages)))

    def _empty_rows(self) -> S.Requests:
        c = self.cfg
        return S.empty_rows(self.max_batch, c.vocab_size, c.d_model, c.compute_dtype)

    def rows_nbytes(self) -> int:
        """Bytes of a depth's request rows (`step.Requests`)."""
        if not hasattr(self, "_rows_nbytes"):
            shapes = jax.eval_shape(self._empty_rows)
            self._rows_nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
        return self._rows_nbytes

    def max_pages(self) -> int:
        """Pages that hold every request row at the whole context: more is never needed."""
        return self.max_batch * -(-self.cfg.max_seq_len // self.page_size)

    def need_pages(self, n_prompt: int, max_tokens: int) -> int:
        return -(-(n_prompt + max_tokens) // self.page_size)

    def pool_pages(self, loops: int) -> int:
        """Pages of a depth's pool: what the budget holds beside the request rows, up to
        `max_pages` (the same for every engine of this model and budget, so warmup's programs
        are the ones serving runs)."""
        if self.memory_budget is None:
            return self.max_pages()
        room = self.memory_budget - self.rows_nbytes()
        if not self.local:
            return max(0, min(self.max_pages(), room // self.page_nbytes(loops)))
        g, l = self.page_nbytes(loops), self.page_nbytes(loops, len(self.local))  # noqa: E741
        n = min(self.max_pages(), room // (g + l // 2))
        while n > 0 and n * g + self.local_slots(n) * l > room:  # the rows' windows take more than half
            n -= max(1, n // 64)
        return max(0, n)

    def depth_nbytes(self, loops: int) -> int:
        n = self.pool_pages(loops)
        local = self.local_slots(n) * self.page_nbytes(loops, len(self.local)) if self.local and n else 0
        return n * self.page_nbytes(loops) + local + self.rows_nbytes()

    def empty_pool(self, loops: int, n_pages: int) -> paged.PagedKV:
        """A depth's pool (its local layers in `local_slots` slots)."""
        return paged.empty(self.cfg, loops, n_pages, self.page_size,
                           n_local=self.local_slots(n_pages) if self.local else None)

    def memory_bytes(self) -> int:
        return sum(d.pool.nbytes + self.rows_nbytes() for d in self.depths.values())

    # ---- depths ------------------------------------------------------------------------------

    def running(self) -> int:
        return sum(len(d.rows) for d in self.depths.values())

    def busy(self) -> bool:
        return any(d.rows for d in self.depths.values())

    def _evict_idle(self, extra: int, keep: int | None, lanes: int) -> bool:
        """Drop idle depths (least recently used first) until `extra` bytes and `lanes` more
        depths fit. False: they do not, with every idle depth gone."""
        def full():
            over = len(self.depths) + lanes > self.max_lanes
            return over or (self.memory_budget is not None and self.memory_bytes() + extra > self.memory_budget)
        while full():
            idle = [d for d in self.depths.values() if not d.rows and d.loops != keep]
            if not idle:
                return False
            self.forget(min(idle, key=lambda d: d.used).loops)
            self.stats["lanes_evicted"] += 1
        return True

    def jits(self, loops: int) -> dict:
        """The depth's programs (made on first use)."""
        if loops not in self._jits:
            self._jits[loops] = S.programs()
        return self._jits[loops]

    def forget(self, loops: int) -> None:
        """Drop a depth: its pool, rows and programs (what they compiled is freed; a depth that
        returns loads them from the persistent compilation cache, or compiles)."""
        self.depths.pop(loops, None)
        self._jits.pop(loops, None)

    def depth(self, loops: int) -> Depth | None:
        """The depth's pool and rows (made on first use, `pool_pages` pages); None: busy depths
        hold the room (the request waits). MemoryBudgetError: it can never fit."""
        d = self.depths.get(loops)
        if d is not None:
            return d
        need = self.depth_nbytes(loops)
        if not self._evict_idle(need, None, 1):
            if not self.busy():
                raise MemoryBudgetError(f"a pool at loops={loops} ({need / 2**20:.2f} MiB) does not fit "
                                        f"memory_budget={self.memory_budget} bytes beside the depths that stay; lower "
                                        "loops, or raise the budget")
            self.stats["memory_waits"] += 1
            return None
        n_pages = self.pool_pages(loops)
        pool = jax.jit(lambda: self.empty_pool(loops, n_pages))()
        book = PageBook(n_pages, self.page_size, self.local_slots(n_pages) if self.local else None, self.local_window)
        d = Depth(loops, self.model.exit_for(loops), pool, book, jax.jit(self._empty_rows)())
        self.depths[loops] = d
        return d

    # ---- admission ---------------------------------------------------------------------------

    def place(self, h: Handle) -> bool:
        """Give a request a request row and its pages; False: it waits (no pages free now)."""
        n, max_tokens = len(h.prompt), h.params.max_tokens
        d = self.depth(h.loops)
        if d is None:
            return False
        slot = next((i for i in range(self.max_batch) if i not in d.rows), None)
        if slot is None:
            return False
        need = self.need_pages(n, max_tokens + (h.speculation.lookahead if h.speculation else 0))
        credits = self.credits(need, h.speculation.lookahead if h.speculation else 0, n if h.in_prefill else None)
        if need > d.book.n_pages or (d.book.local is not None and credits + 1 > d.book.local.n_slots):
            if d.rows:
                return False
            raise MemoryBudgetError(f"a request of {n} + {max_tokens} tokens needs {need} pages; the pool at "
                                    f"loops={h.loops} holds {d.book.n_pages} within memory_budget="
                                    f"{self.memory_budget} bytes")
        # at least the last token is computed (its logits); a prompt that may exit is computed whole
        # (one chunk exiting as a whole) and shares no pages: its K/V depend on where it exited
        share = self.prefix_cache and not h.in_prefill
        ns = self.namespace(h)
        shared = d.book.match(h.prompt[:n - 1], ns) if share else []
        if share and self._written_soon(d, h, ns, len(shared)):
            self.stats["prefix_waits"] += 1
            return False
        d.book.retain(shared)
        try:
            shared = self._from_store(d, h, shared)
        except Exception as e:
            self.fail_depth(d, e)  # its donated pool is gone: the depth is made anew for the next request
            raise
        tail = d.book.match_tail(h.prompt[:n - 1], len(shared), ns) if share else None
        if tail is not None and d.book.windowed(shared, *tail) < len(shared):
            tail = None  # its local layers' window is gone (it is recomputed)
        keep = d.book.windowed(shared)
        d.book.release(shared[keep:])  # their local layers' window is gone
        shared = shared[:keep]
        if tail is not None:
            d.book.retain([tail[0]])  # not evicted for this request's own pages: it is copied into the first
        own = d.book.alloc(need - len(shared))
        if own is not None and d.book.local is not None and not d.book.local.promise(credits + 1):
            d.book.release(own)
            own = None
        if own is None:
            d.book.release(shared + ([tail[0]] if tail else []))
            self.stats["memory_waits"] += 1
            return False
        row = Row(h, slot, shared + own, 0, credits=credits)
        extra = 0
        if d.book.local is not None:  # the tail's slot first (its copy's source), then the first window
            if tail is not None:
                d.book.local.hold(tail[0])
            self._window(d, row, len(shared) * self.page_size + (tail[1] if tail else 0), 1)
        if tail is not None:  # a partial page that begins the rest: copied, then continued
            try:
                self._sync(d)
                d.pool = self._run(("copy", d.loops), self.jits(d.loops)["copy_pages"], d.pool,
                                   np.asarray([tail[0]], np.int32), np.asarray([own[0]], np.int32))
            except Exception as e:
                self._unhold(d, row)
                d.book.release(shared + own + [tail[0]])
                self.fail_depth(d, e)
                raise
            if d.book.local is not None:
                d.book.local.drop(tail[0])
            d.book.release([tail[0]])
            extra = tail[1]
        if d.book.local is not None:
            d.book.local.unpromise(1)  # the tail's credit
        seen = np.zeros((self.cfg.vocab_size,), bool)
        seen[h.prompt] = True
        req = Knobs.from_params([h.params], logit_bias=True, sampled=True, stop_shape=S.STOPS)
        pol = jax.tree.map(np.asarray, ad.EVERY_PASS if h.policy is None else h.policy)
        try:
            d.state = self._run(("admit", d.loops), self.jits(d.loops)["admit"], d.state, np.int32(slot), seen, req,
                                pol)
        except Exception as e:
            self._unhold(d, row)
            d.book.release(shared + own)
            self.fail_depth(d, e)
            raise
        self._tick += 1
        d.used = self._tick
        hit = len(shared) * self.page_size + extra
        h.prefix_tokens = hit
        counts = self.depth_counts[d.loops]
        counts["prefix_cache_queries"] += n
        counts["prefix_cache_hits"] += hit
        self.stats["requests_prefix_hit" if hit else "requests_prefix_miss"] += 1
        self.stats["prefix_tokens_reused"] += hit
        row.fed = hit
        d.rows[slot] = row
        d.prefilling.append(row)
        d.adaptive |= h.policy is not None
        return True

    def _written_soon(self, d: Depth, h: Handle, ns, have: int) -> bool:
        """A request being prefilled shares more of this prompt's full pages than the index holds
        (`have`): they are not written yet. The request waits for them, to read them rather than
        compute them again: its own chunks would run after that request's anyway (prompts are
        prefilled one after the other), so waiting costs it nothing."""
        prompt = h.prompt[:len(h.prompt) - 1]
        if len(prompt) // self.page_size <= have:
            return False
        for r in d.prefilling:
            if r.handle.in_prefill:  # its pages are never indexed
                continue
            other = r.handle.prompt
            m = min(len(other), len(prompt))
            common = int(np.argmin(np.append(other[:m] == prompt[:m], False)))
            if common // self.page_size > have and self.namespace(r.handle) == ns:
                return True
        return False

    def namespace(self, h: Handle):
        """Under which name a request's pages are indexed: what its K/V depend on beside the
        tokens — its seed (Huginn's initial loop states are drawn from it) and its cache_window
        (the attention every layer's input went through) — or None (shared by all)."""
        c = self.cfg
        seed = h.params.seed if rec.injected(c) and rec.state_std(c) > 0 else None
        return (seed, h.cache_window) if h.cache_window else seed

    def _from_store(self, d: Depth, h: Handle, shared: list) -> list:
        """`shared` (retained pages of the prompt's first full pages), extended with pages loaded
        from the store's entry when it holds more of the prompt (then indexed: later prompts read
        them in the pool)."""
        store, prompt = self.store, h.prompt
        if store is None or not self.prefix_cache or store.loops != d.loops or h.in_prefill:
            return shared
        if h.cache_window:  # store entries attend to the whole context
            return shared
        entry, k = store.lookup(prompt)
        if entry is not None and entry.seed != (self.namespace(h) or 0) and self.namespace(h) is not None:
            return shared  # its states were drawn from another seed
        full = min(k, len(prompt) - 1) // self.page_size
        if entry is None or full <= len(shared) or entry.cache.kv_mode != self.cfg.storage:
            return shared
        P, W = self.page_size, self.local_window
        if entry.cache.rings and (d.book.local is None or not kvc.holds(entry.cache, full * P, 0, W)):
            return shared  # its local layers hold only the last window of a longer prompt
        first = max(0, full * P - W + 1) // P  # the first page the first query's window reads
        if d.book.local is not None and not all(d.book.local.has(p) for p in shared[first:]):
            return shared  # a shared page of that window lost its local K/V (the load writes no shared page)
        new = d.book.alloc(full - len(shared))
        if new is None:
            return shared
        pages = shared + new
        window = pages[first:] if d.book.local is not None else []
        if window and not d.book.local.promise(len(window)):
            d.book.release(new)
            return shared
        for p in window:  # slots for the pages the first query's window reads, filled by the load
            d.book.local.hold(p)
        R = pow2(len(pages), MIN_TABLE)
        table = np.zeros((R,), np.int32)
        table[:len(pages)] = pages
        self._sync(d)
        d.pool = self._run(("load", d.loops, entry.cache.capacity, R), self.jits(d.loops)["load_entry"], d.pool,
                           entry.cache, table, np.int32(len(shared) * P), np.int32(full * P))
        for p in window:  # idle now, their K/V kept: the request holds them again at once
            d.book.local.drop(p)
        if window:
            d.book.local.unpromise(len(window))
        d.book.insert(prompt[:full * P], pages, ns=self.namespace(h))
        store.touch(entry)
        self.stats["prefix_pool_loads"] += 1
        return pages

    # ---- local slots ---------------------------------------------------------------------------

    def _window(self, d: Depth, r: Row, q0: int, T: int) -> None:
        """Row r's next program queries positions q0 .. q0 + T - 1: its local slots follow its
        window there (pages wholly before it are dropped: no later query of the row reads them)."""
        if d.book.local is None:
            return
        P = self.page_size
        first, last = max(0, q0 - self.local_window + 1) // P, min((q0 + T - 1) // P, len(r.pages) - 1)
        for i in sorted(i for i in r.held if i < first):
            d.book.local.drop(r.pages[i])
            r.held.discard(i)
        for i in range(first, last + 1):
            if i not in r.held:
                d.book.local.hold(r.pages[i])
                r.held.add(i)

    def _unhold(self, d: Depth, r: Row) -> None:
        """Row r's slots and credits back (it leaves)."""
        if d.book.local is None or r.credits == 0:
            return
        for i in r.held:
            d.book.local.drop(r.pages[i])
        r.held.clear()
        d.book.local.unpromise(r.credits)
        r.credits = 0

    def _sync(self, d: Depth) -> None:
        """The device's page -> slot map brought up to the book's."""
        local = d.book.local
        if local is not None and local.changed:
            d.pool = d.pool.replace(slot_of=jax.device_put(np.asarray(local.slot, np.int32)))
            local.changed = False

    def _run(self, key: tuple, program, *args, **kw):
        if key not in self.programs:
            self.programs.add(key)
            if self.warm:
                self.compiles_after_warmup += 1
        return program(*args, **kw)

    # ---- one iteration -----------------------------------------------------------------------

    def step(self) -> None:
        """Per depth: one step (a prompt chunk and every decode row). A depth whose program fails
        fails its rows (`fail_depth`); the others go on."""
        for d in list(self.depths.values()):
            try:
                self._step(d)
            except Exception as e:  # noqa: BLE001 - the depth's device state is gone, not the loop
                self.fail_depth(d, e)

    def _step(self, d: Depth) -> None:
        prev, d.inflight = d.inflight, None
        chunk = None
        if d.prefilling:
            r = d.prefilling[0]
            n = len(r.handle.prompt) - r.fed  # (exit_in_prefill: the whole prompt, one chunk)
            n = n if r.handle.in_prefill else min(self.chunk, n)
            chunk = (r, n, r.fed + n == len(r.handle.prompt))
        decoding = [r for r in d.rows.values() if r.decoding and r.handle.speculation is None
                    and len(r.handle.tokens) + r.ahead < r.handle.params.max_tokens]
        ran = []
        if chunk is not None or decoding:
            lengths = [r.fed + len(r.handle.tokens) + r.ahead for r in decoding]  # positions after the step
            if chunk is not None:
                lengths.append(chunk[0].fed + chunk[1])
            burst = chunk is None and not d.adaptive  # decode rows alone: `decode_steps`, 1 step or a burst
            many = self.decode_steps if burst and not self.waiting else 1  # (nothing to admit: n in one program)
            R = self.table_len(max(lengths) + many - 1)
            chunks = decodes = None
            T = bd = 0
            if chunk is not None:
                r, n, final = chunk
                T = bucket(n) if r.handle.in_prefill else next(t for t in self.chunk_sizes() if t >= n)
                chunks = S.make_chunks([r.pages], [r.handle.prompt[r.fed:r.fed + n]], [r.fed], [r.slot], [final], T,
                                       R, 1, [r.handle.cache_window])
            if decoding or not d.adaptive:  # (a chunk alone: beside one filler decode row, one program fewer)
                bd = next(b for b in batch_buckets(self.max_batch) if b >= len(decoding))
                starts = [r.fed + len(r.handle.tokens) + r.ahead - 1 for r in decoding]
                left = [r.handle.params.max_tokens - len(r.handle.tokens) - r.ahead for r in decoding]
                decodes = S.make_decodes([r.pages for r in decoding], starts, [r.slot for r in decoding],
                                         [len(r.handle.tokens) + r.ahead for r in decoding], R, bd,
                                         [r.handle.cache_window for r in decoding], left if burst else None)
            if chunk is not None:
                self._window(d, chunk[0], chunk[0].fed, chunk[1])
            for r, q in zip(decoding, starts if decodes is not None else ()):
                self._window(d, r, q, many)
            self._sync(d)
            w, jits = self.model.weights, self.jits(d.loops)
            dtok = passes = cdepth = None
            exits = chunk is not None and chunk[0].handle.in_prefill
            if burst:
                dtok, d.pool, d.state = self._run(("steps", d.loops, bd, R), jits["decode_steps"], w.params,
                                                  w.config, d.pool, d.state, decodes, np.int32(many), loops=d.loops,
                                                  n_max=self.decode_steps, exit=d.exit)
            elif d.adaptive and (decoding or exits):  # the decode rows' passes stop at their exits
                if exits:  # the prompt exits as a whole: its passes read now (once a request)
                    ctok, cdepth, d.pool, d.state = self._run(("chunk_adaptive", d.loops, T, R), jits["chunk_adaptive"],
                                                              w.params, w.config, d.pool, d.state, chunks,
                                                              loops=d.loops)
                    cdepth = int(np.asarray(cdepth)[0])
                elif chunks is not None:
                    ctok, _, d.pool, d.state = self._run(("step", d.loops, 0, T, R), jits["step"], w.params, w.config,
                                                         d.pool, d.state, chunks, None, loops=d.loops, exit=d.exit)
                if decoding:
                    dtok, passes, d.pool, d.state = self._run(("step_adaptive", d.loops, bd, R),
                                                              jits["step_adaptive"], w.params, w.config, d.pool,
                                                              d.state, decodes, loops=d.loops)
            else:
                ctok, dtok, d.pool, d.state = self._run(("step", d.loops, bd, T, R), jits["step"], w.params, w.config,
                                                        d.pool, d.state, chunks, decodes, loops=d.loops, exit=d.exit)
            self.stats["steps"] += 1
            counts = self.depth_counts[d.loops]
            if chunk is not None:
                r, n, final = chunk
                r.fed += n
                if self.prefix_cache and not exits:  # its full pages (and at its end its partial last one):
                    # shareable now
                    d.book.insert(r.handle.prompt[:r.fed], r.pages, partial=final, ns=self.namespace(r.handle))
                self.stats["prefill_chunks"] += 1
                counts["tokens_computed"] += n
                counts["passes"] += n * (d.loops if cdepth is None else cdepth)
                counts["passes_skipped"] += 0 if cdepth is None else n * (d.loops - cdepth)
                if final:
                    d.prefilling.popleft()
                    r.decoding = True
                    r.ahead += 1
                    if r.handle.policy is not None:  # the prompt ran every pass, or exited as a whole
                        r.handle.depths.append(d.loops if cdepth is None else cdepth)
                    ran.append((r, 0, ctok, None))
            fed = 0
            for i, r in enumerate(decoding):
                k = min(many, r.handle.params.max_tokens - len(r.handle.tokens) - r.ahead)
                r.ahead += k
                fed += k
                ran.append((r, i, dtok, passes) if not burst else (r, i, dtok, passes, k))
            if decoding:
                self.stats["decode_steps"] += many
                self.stats["batch_rows"] += fed
                counts["tokens_computed"] += fed
                if passes is None:  # adaptive: counted when read
                    counts["passes"] += fed * d.loops
        if ran:
            if self.overlap:
                d.inflight = ran
            else:
                self._read(d, ran)
        self._speculate(d)
        if prev is not None:
            self._read(d, prev)

    def _speculate(self, d: Depth) -> None:
        """One speculative round for every speculating row whose last token is read (rows with the
        same draft depth and lookahead in one program), read at once: how many tokens a round
        emits decides where the next one starts."""
        groups = collections.defaultdict(list)
        for r in d.rows.values():
            if r.decoding and r.handle.speculation is not None and r.ahead == 0 and not r.left:
                groups[r.handle.speculation].append(r)
        counts = self.depth_counts[d.loops]
        for spec, rows in groups.items():
            k = spec.lookahead
            starts = [r.fed + len(r.handle.tokens) - 1 for r in rows]  # where the last token is fed
            R = self.table_len(max(starts) + k + 1)
            bd = next(b for b in batch_buckets(self.max_batch) if b >= len(rows))
            decodes = S.make_decodes([r.pages for r in rows], starts, [r.slot for r in rows],
                                     [len(r.handle.tokens) for r in rows], R, bd, [r.handle.cache_window for r in rows])
            for r, q in zip(rows, starts):
                self._window(d, r, q, k + 1)
            self._sync(d)
            w = self.model.weights
            tokens, kept, d.pool, d.state = self._run(
                ("speculate", d.loops, spec, bd, R), self.jits(d.loops)["step_speculative"], w.params, w.config,
                d.pool, d.state, decodes, loops=d.loops, draft_loops=spec.draft_loops, lookahead=k, exit=d.exit)
            tokens, kept = jax.tree.map(np.asarray, tokens), np.asarray(kept)
            self.stats["speculative_rounds"] += 1
            self.stats["batch_rows"] += len(rows)
            counts["tokens_computed"] += len(rows) * (k + 1)
            counts["passes"] += len(rows) * (k * spec.draft_loops + (k + 1) * d.loops)
            for i, r in enumerate(rows):
                r.handle.drafted += k
                r.handle.accepted += int(kept[i])
                for t, stop in zip(tokens.tokens[i, :kept[i] + 1], tokens.stops[i]):
                    if r.left:  # a stop or max_tokens cut the round: the rest is discarded
                        break
                    self._emit(d, r, int(t), int(stop))

    def _read(self, d: Depth, ran: list) -> None:
        """The tokens of a dispatched step (waits for it), emitted for the rows still in; with
        adaptive depth the passes each decode row ran are counted and kept."""
        host = {}

        def get(a):  # an `Emitted` on the host
            if id(a) not in host:
                host[id(a)] = jax.tree.map(np.asarray, a)
            return host[id(a)]

        counts = self.depth_counts[d.loops]
        for r, i, tok, passes, *many in ran:
            if many:  # (`decode_steps`) its k tokens, up to a stop; its readers woken once
                r.ahead -= many[0]
                got = get(tok)
                for t, stop in zip(got.tokens[i, :many[0]], got.stops[i]):
                    if r.left:
                        break
                    self._emit(d, r, int(t), int(stop), wake=False)
                r.handle.wake()
                continue
            r.ahead -= 1
            if passes is not None:
                p = int(get(passes)[i])
                counts["passes"] += p
                counts["passes_skipped"] += d.loops - p
                if not r.left and r.handle.policy is not None:
                    r.handle.depths.append(p)
            if not r.left:
                got = get(tok)
                self._emit(d, r, int(got.tokens[i]), int(got.stops[i]))

    def _emit(self, d: Depth, r: Row, t: int, stop: int, wake: bool = True) -> None:
        """Token t of row r, which the step found to end its stop sequence `stop` (-1: none)."""
        h, s = r.handle, r.handle.params
        h.emit(t, wake)
        self.stats["tokens_out"] += 1
        if len(h.tokens) == 1:
            self._on_first_token(h)
        if stop >= 0:
            h.stop_matched = list(s.stop_sequences[stop])
            self.release(d, r, "stop")
        elif len(h.tokens) >= s.max_tokens:
            self.release(d, r, "length")

    # ---- leaving -----------------------------------------------------------------------------

    def release(self, d: Depth, r: Row, reason: str, error: BaseException | None = None) -> None:
        """Row r leaves (its request finishes with `reason`): its pages and request row are free
        (its prompt's pages stay cached in the index)."""
        if r.left:
            return
        r.left = True
        if d.rows.get(r.slot) is r:
            del d.rows[r.slot]
            if r.decoding and self.prefix_cache and not r.handle.in_prefill:  # prompt and output whose K/V
                # are written (each emitted token but the last was fed): a later turn of the chat reads them
                d.book.insert(list(r.handle.prompt) + r.handle.tokens[:-1], r.pages, partial=True,
                              ns=self.namespace(r.handle))
            self._unhold(d, r)
            d.book.release(r.pages)
        if r in d.prefilling:
            d.prefilling.remove(r)
        self.finished.append((r.handle, reason, error))
        self.stats[f"finished_{reason}"] += 1

    def take_finished(self) -> list:
        out, self.finished = self.finished, []
        return out

    def expire(self, now: float) -> None:
        for d in self.depths.values():
            for r in list(d.rows.values()):
                why = r.handle.overdue(now)
                if why:
                    self.release(d, r, *why)

    def fail_depth(self, d: Depth, e: Exception) -> None:
        """A program of the depth failed (after taking its donated buffers, maybe): its rows fail
        and the depth is dropped (the next request at its depth makes it anew)."""
        err = RuntimeError(f"the batch step failed: {e}")
        for r in list(d.rows.values()):
            self.release(d, r, "error", err)
        self.forget(d.loops)
        self.stats["step_failures"] += 1

    def fail_all(self, e: Exception) -> None:
        for d in list(self.depths.values()):
            self.fail_depth(d, e)

    def close(self, err: BaseException) -> None:
        for d in self.depths.values():
            for r in list(d.rows.values()):
                r.handle.finish("error", err)
        self.depths.clear()
        self._jits.clear()

    # ---- warmup ------------------------------------------------------------------------------

    def table_len(self, positions: int) -> int:
        """Page-table entries of a step whose longest row holds `positions`: the whole context's
        when attention reads only live pages (a kernel: one program for every length),
        else a power of two (the XLA reference reads every entry)."""
        whole = -(-self.cfg.max_seq_len // self.page_size)
        if paged.attention_kernel(self.cfg) != "xla":
            return whole
        return min(pow2(-(-positions // self.page_size), MIN_TABLE), pow2(whole, MIN_TABLE))

    def step_shapes(self, loops: int) -> list[tuple[int, int, int]]:
        """Every (decode rows, chunk length, page-table length) a depth's steps can have."""
        whole = -(-self.cfg.max_seq_len // self.page_size)
        tables = sorted({self.table_len(n * self.page_size) for n in range(1, whole + 1)})
        return [(bd, T, R) for R in tables for bd in batch_buckets(self.max_batch) for T in [0] + self.chunk_sizes()]

    def chunk_sizes(self) -> list[int]:
        """A prompt chunk's padded lengths: 32 and the whole chunk (a question after a cached
        system prompt pays for 32 tokens, a longer rest for the chunk: each length is a program
        for every decode bucket, so few lengths keep warmup short)."""
        return sorted({min(32, self.chunk), self.chunk})

    def warmup(self, loops: int) -> int:
        """Compile every program of a depth's steps (ahead of time: nothing is allocated or run,
        so any thread may call it while the loop serves); returns how many were new."""
        w, c, P = self.model.weights, self.cfg, self.page_size
        n_pages = self.pool_pages(loops)
        pool = jax.eval_shape(lambda: self.empty_pool(loops, n_pages))
        state = jax.eval_shape(self._empty_rows)
        new = set()
        for bd, T, R in self.step_shapes(loops):
            key = ("step", loops, bd, T, R)
            if key in self.programs or (bd and not T):  # (decode rows alone run `decode_steps`)
                continue
            chunks = S.make_chunks([], [], [], [], [], T, R, 1) if T else None
            decodes = S.make_decodes([], [], [], [], R, bd) if bd else None
            self.jits(loops)["step"].lower(w.params, c, pool, state, chunks, decodes, loops=loops,
                                     exit=self.model.exit_for(loops)).compile()
            new.add(key)
        for bd, T, R in self.step_shapes(loops):  # decode rows alone: `decode_steps`
            key = ("steps", loops, bd, R)
            if T or not bd or key in self.programs:
                continue
            decodes = S.make_decodes([], [], [], [], R, bd, left=[])
            self.jits(loops)["decode_steps"].lower(w.params, c, pool, state, decodes, np.int32(1), loops=loops,
                                                   n_max=self.decode_steps, exit=self.model.exit_for(loops)).compile()
            new.add(key)
        if ("admit", loops) not in self.programs:
            req = Knobs.from_params([SamplingParams()], logit_bias=True, sampled=True, stop_shape=S.STOPS)
            pol = jax.tree.map(np.asarray, ad.EVERY_PASS)
            self.jits(loops)["admit"].lower(state, np.int32(0), np.zeros((c.vocab_size,), bool), req, pol).compile()
            new.add(("admit", loops))
        if ("copy", loops) not in self.programs:
            one = np.zeros((1,), np.int32)
            self.jits(loops)["copy_pages"].lower(pool, one, one).compile()
            new.add(("copy", loops))
        if self.store is not None and self.store.loops == loops:  # loads of the store's entries
            for e in (e for e in self.store.entries() if self.local or not e.cache.rings):
                R = pow2(-(-len(e.prompt) // P), MIN_TABLE)
                key = ("load", loops, e.cache.capacity, R)
                if key not in self.programs and key not in new:
                    self.jits(loops)["load_entry"].lower(pool, e.cache, np.zeros((R,), np.int32), np.int32(0),
                                                         np.int32(0)).compile()
                    new.add(key)
        self.programs |= new
        self.warm = True
        return len(new)

    def snapshot(self) -> dict:
        return dict(self.stats, running=self.running(), lanes=len(self.depths), memory_bytes=self.memory_bytes(),
                    programs=len(self.programs), compiles_after_warmup=self.compiles_after_warmup,
                    depths={loops: dict(c) for loops, c in self.depth_counts.items()},
                    pages={loops: dict(total=d.book.n_pages, free=d.book.free, cached=d.book.cached(),
                                       **({} if d.book.local is None else dict(
                                           local_slots=d.book.local.n_slots, local_free=d.book.local.free,
                                           local_idle=d.book.local.idle, local_reclaimed=d.book.local.reclaimed)))
                           for loops, d in self.depths.items()})
