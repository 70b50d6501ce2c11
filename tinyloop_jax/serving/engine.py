"""`Engine`: continuous batching of independent requests over the prefix store, driven by one
loop (a background thread) — on one device, or on the model's ('data', 'model') mesh (pages
split by KV heads over 'model', the step's rows over 'data').

    engine = tl.Engine(model, max_batch=16)
    h = engine.submit(prompt_ids, max_tokens=64)      # returns at once
    for tok in h.stream(): ...                        # tokens as they are emitted
    h.result()                                        # == model.generate(prompt_ids, max_tokens=64)

Each iteration of the loop, per depth (requests at one `loops` share a page pool and programs):

  1. waiting requests join free request rows; each prompt's full pages already in the pool (any
     earlier prompt's, indexed by their tokens) are read, never recomputed; pages for the rest
     and for max_tokens are taken from the free and the cached pages (a request that finds none
     waits at the head of the queue);
  2. one step: the next chunk (up to `prefill_chunk` tokens) of the oldest request still
     prefilling, and one token for every request past its prompt, in one program over the
     pages; a chunk's full pages are shareable at once; after its last chunk a request
     emits its first token;
  2b. a request with draft_loops runs a speculative round instead (drafts at a shallow depth
     over its pages, verified in one chunk), read at once;
  3. rows that hit a stop sequence, their max_tokens, a cancel or their deadline leave at once;
     their pages are free, their prompt's pages stay cached for later prompts.

Stop tokens and max_tokens cut a row in the step, on the device, with the same token choice as
`generate`: a greedy output equals `model.generate` token for token, and a seeded sample is
reproducible whatever else is in flight (each row draws with its own seed and token index).

The parts: this module is the driver (the thread, the queue, the public face); `batcher` places
requests into request rows and pages (`api.pages.PageBook`) and runs an iteration; `step` holds
its device programs over a page pool (`model.paged`); `handles` is what a caller holds; `app`
serves it over HTTP.
"""

from __future__ import annotations

import collections
import threading
import time

import jax

from .handles import Cancelled, Handle, MemoryBudgetError, QueueFull, RequestTimeout
from . import step as S
from .batcher import Batcher
from .budget import AUTO_REQUEST_TOKENS, auto_budget
from ..api import request as R
from ..api import validation as check
from ..api.store import PrefixStore
from ..decoding.sampling import StopSpec
from ..model.cache import free_bytes

__all__ = ["Engine", "Handle", "MemoryBudgetError", "QueueFull", "RequestTimeout", "Cancelled"]

DECODE_STEPS = 4  # decode steps per dispatch when nothing waits: see docs/benchmarks.md (bench_engine)
# with work waiting, no loop iteration for this long is a stalled engine (a cold compile takes < 1 min)
STALL_S = 600.0


class Engine:
    """Continuous batching over page pools with shared prefixes, thread-safe, one device loop.

    max_batch: request rows per depth (the decode step's largest batch). max_queue: requests
    waiting beyond the running ones (then `submit` raises `QueueFull`). timeout: default
    per-request deadline in seconds (None: none). prefill_chunk: prompt tokens per step.
    page_size: tokens per page (a power of two, 16-256). prefix_cache=False: no prompt reads
    another's pages (every prompt prefilled whole; the baseline of scripts/bench_serve.py).

    Bounds: max_loops, the deepest `loops` a request may ask (default 64, or 16 x the model's
    default depth if more): each depth has its own pool and programs. max_depths: depths held at
    once (default 8): a new depth evicts the least recently used idle one. memory_budget: bytes
    for every depth's pages and request rows ("auto": `auto_budget` — 80% of what a GPU has
    free once the weights are loaded, a quarter of a CPU's at most 4 GiB, never below one
    2,048-token request at the default depth; `capacity()` says what it holds; None: each pool
    holds max_batch requests at the whole context); a request waits
    while its pages are not free (cached pages are evicted, least recently used first, to make
    room), and one that cannot fit even alone is refused at `submit` (`MemoryBudgetError`).
    overlap: the loop dispatches step t + 1 before it reads step t's tokens, so stop checks,
    streaming and HTTP run while the device computes (False: the device waits for the host
    every step). decode_steps: decode steps run by one program when no prompt is prefilling or
    waiting (the host's work per dispatch spread over them; a request that arrives meanwhile
    waits at most that many steps; 1: one step per dispatch). store: a `PrefixStore` at the
    model's default depth whose entries serve prompts
    (each loaded into pages once, then read there).
    """

    def __init__(self, model, max_batch: int = 16, store: PrefixStore | None = None, *, max_queue: int = 256,
                 timeout: float | None = None, prefill_chunk: int = 64, page_size: int = 16,
                 prefix_cache: bool = True, max_loops: int | None = None,
                 memory_budget: int | str | None = "auto", max_depths: int = 8, overlap: bool = True,
                 decode_steps: int = DECODE_STEPS):
        self.model = model
        c = model.weights.config
        max_loops = max(64, 16 * c.default_loops) if max_loops is None else max_loops
        for name, v in dict(max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                            max_loops=max_loops, max_depths=max_depths, decode_steps=decode_steps).items():
            if check.integer(v, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if check.integer(page_size, "page_size") < 16 or page_size > 256 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two in 16..256, got {page_size}")
        auto = memory_budget == "auto"
        if auto:
            memory_budget = None  # (sized below, by the batcher's arithmetic)
        elif memory_budget is not None and check.integer(memory_budget, "memory_budget") < 1:
            raise ValueError(f"memory_budget must be >= 1 bytes or None, got {memory_budget}")
        self.max_loops, self.memory_budget = max_loops, memory_budget
        if store is not None:
            if not isinstance(store, PrefixStore) or store.model is not model:
                raise ValueError("store must be a PrefixStore of this model")
            if store.cache_window != 0:
                raise ValueError(f"the engine serves full-context prefixes; store has cache_window="
                                 f"{store.cache_window}")
        self.max_batch, self.max_queue, self.timeout = max_batch, max_queue, timeout
        self.prefix_cache = prefix_cache
        self._queue: collections.deque[Handle] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._jobs: list = []  # work for the loop thread
        self.warming = False  # a background warmup is running
        self._stats = collections.Counter()  # this side's counters (under _cv)
        self._ttft: collections.deque = collections.deque(maxlen=2048)
        # the batch side, on the loop thread only (other threads read its published `_view`)
        self.batcher = Batcher(model, max_batch, prefill_chunk, collections.Counter(), self._first_token,
                               memory_budget, overlap, max_depths, page_size, prefix_cache, store, decode_steps)
        self.budget = self.batcher.budget  # the sizes (`Budget`): pages, bytes, what fits
        if auto:
            b = self.budget
            one = b.need_pages(min(AUTO_REQUEST_TOKENS, c.max_seq_len), 0)
            floor = b.rows_nbytes() + b.pages_nbytes(c.default_loops, one)
            self.memory_budget = b.memory_budget = auto_budget(free_bytes(), jax.default_backend(), floor)
        self._view: dict = {}
        self._programs: frozenset = frozenset()
        self._publish()
        self._started = self._beat = time.perf_counter()  # _beat: the loop's last iteration
        self._thread = threading.Thread(target=self._loop, name="tinyloop-engine", daemon=True)
        self._thread.start()

    # ---- public ------------------------------------------------------------------------------

    def submit(self, request=None, timeout: float | None = None, **keywords) -> Handle:
        """Queue a request — a `Request`, or a prompt with the keywords of `model.generate` (its
        two values params, a `SamplingParams`, and plan, a `DepthPlan`, or their fields: sugar
        over them) — and return its `Handle` at once. The engine serves each depth's default
        exit pick (no exit_at_step / early_exit_threshold per request).
        cache_window > 0: every query attends to the last cache_window positions only, as
        `generate(cache_window=...)` (the pages outside the window are kept).
        A `Speculative` plan (draft_loops=d): self-speculative decoding as `generate`'s —
        `lookahead` tokens drafted at depth d over the request's pages, verified at `loops` in
        one chunk (greedy: the same tokens); `handle.drafted` / `handle.accepted` count them.
        An `Adaptive` plan (exit_criterion, `model.adaptive`): its tokens stop looping at their
        exits, the prompt runs every pass (exit_in_prefill=True: the whole prompt is one chunk
        that exits as a whole, as `generate`'s; it shares no pages), and `handle.passes` gives
        the passes run per emitted token. timeout (seconds; default the engine's): the
        request's deadline from now, unless the Request has one.
        Bad arguments raise here (ValueError / RuntimeError) and nothing is queued; a full
        queue raises `QueueFull`; a request whose pages cannot fit the memory budget even
        alone, `MemoryBudgetError`."""
        c = self.model.weights.config
        if "prompt" in keywords:  # submit(prompt=ids, ...)
            if request is not None and not isinstance(request, R.Request):
                raise ValueError("give the prompt once: as the first argument or as prompt=")
            request = keywords.pop("prompt")
        req = R.checked(R.from_keywords(request, **keywords), c)
        if req.exit_pick != (None, None):
            raise ValueError("the engine serves each depth's default exit pick: no exit_at_step / "
                             "early_exit_threshold per request")
        prompt, params, loops = req.prompt, req.params, req.loops
        StopSpec.make([[list(q) for q in params.stop_sequences]], S.STOPS)  # what a request row holds
        if loops > self.max_loops:
            raise ValueError(f"loops={loops} is above this engine's max_loops={self.max_loops}")
        spec = req.speculation
        if spec is not None and not c.share.full:
            raise ValueError(f"kv_share={c.kv_share!r}: speculative decoding with it is not served yet "
                             "(its verify chunk would read the drafts at every pass)")
        if not c.share.full:
            c.share.check(loops)
        if spec is not None and params.response_format is not None and c.mesh is not None:  # (a round asks the
            # host for its drafts' masks: no callback in a program split over devices)
            raise ValueError("the engine does not take response_format with draft_loops (speculative decoding) on a "
                             "mesh yet")
        ahead = 0 if spec is None else spec.lookahead  # a verify chunk writes this far past the last token
        if len(prompt) + params.max_tokens + ahead > c.max_seq_len:
            raise RuntimeError(f"prompt + max_tokens{' + lookahead' if ahead else ''} is "
                               f"{len(prompt) + params.max_tokens + ahead} tokens, longer than "
                               f"max_seq_len={c.max_seq_len}")
        b = self.budget
        need, have = b.need_pages(len(prompt), params.max_tokens + ahead), b.pool_pages(loops)
        slots = b.prompt_slots(have)  # (a compact kv_share: the prompt's pages in pass slots, + a partial page)
        if slots is not None and b.need_pages(len(prompt), 0) + 1 > slots:
            raise MemoryBudgetError(
                f"a prompt of {len(prompt)} tokens at loops={loops} needs {b.need_pages(len(prompt), 0) + 1} pass "
                f"slots of {b.pass_nbytes(loops) / 2**10:.1f} KiB (kv_share={c.kv_share!r}); memory_budget="
                f"{self.memory_budget} bytes holds {slots}; shorten the prompt or raise the budget")
        if need > have or (self.memory_budget is not None and b.depth_nbytes(loops) > self.memory_budget):
            raise MemoryBudgetError(
                f"a request of {len(prompt)} + {params.max_tokens} tokens at loops={loops} needs {need} pages "
                f"({need * b.page_size} tokens) of {b.page_nbytes(loops) / 2**10:.1f} KiB; memory_budget="
                f"{self.memory_budget} bytes holds {have} pages ({have * b.page_size} tokens) at that depth; lower "
                "loops or max_tokens, or raise the budget (tinyloop serve --memory-budget, Engine(memory_budget=...))")
        timeout = self.timeout if timeout is None else timeout
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if req.deadline is None and timeout is not None:
            req = R.with_deadline(req, time.perf_counter() + timeout)
        h = Handle(req, self._cancelled)
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

    def capacity(self, loops: int | None = None) -> dict:
        """What the memory budget holds at `loops` (default: the model's depth): the budget's
        bytes, the pages and tokens of that depth's pool, and how many requests of
        `AUTO_REQUEST_TOKENS` tokens fit at once (at most max_batch)."""
        b, loops = self.budget, self.model.weights.config.default_loops if loops is None else loops
        pages = b.pool_pages(loops)
        one = b.need_pages(min(AUTO_REQUEST_TOKENS, self.model.weights.config.max_seq_len), 0)
        return dict(memory_budget=self.memory_budget, loops=loops, pages=pages, tokens=pages * b.page_size,
                    rows=min(self.max_batch, pages // one), row_tokens=one * b.page_size)

    def generate(self, request, **kw) -> list[int]:
        """submit(...).result(): blocking, like `model.generate`."""
        return self.submit(request, **kw).result()

    def warmup(self, loops: int | None = None, background: bool = False, adaptive: bool = False,
               speculation=(), grammar: bool = False) -> int:
        """Compile every step program at `loops` (default depth) now, ahead of time (nothing is
        allocated or run), so serving compiles nothing for them later. adaptive=True: the
        adaptive-depth programs too (exit_criterion requests, exit_in_prefill prompts of any
        length); speculation: the speculative rounds of these (draft_loops, lookahead) pairs (a
        `Speculative` plan's; one program per lookahead serves every draft depth); grammar=True:
        the masked programs a step with a structured-output row runs. Returns the
        number of programs compiled. background=True returns at once (0) and compiles on a
        thread of its own while requests are served; `warming` says whether it still runs."""
        loops = self.model.weights.config.default_loops if loops is None else check.loops(loops)
        if loops > self.max_loops:
            raise ValueError(f"loops={loops} is above this engine's max_loops={self.max_loops}")
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {adaptive!r}")
        pairs = []
        for pair in speculation:  # checked as a request's (draft_loops <= loops, lookahead >= 1)
            d, k = (pair.draft_loops, pair.lookahead) if isinstance(pair, R.Speculative) else pair
            pairs.append(tuple(check.speculation(d, k, loops)))
        if not isinstance(grammar, bool):
            raise ValueError(f"grammar must be True or False, got {grammar!r}")
        run = lambda: self.batcher.warmup(loops, adaptive, tuple(pairs), grammar)  # noqa: E731
        if not background:
            n = run()
            self._publish_programs()
            return n

        def in_background():
            try:
                run()
            finally:
                self.warming = False
                self._publish_programs()

        self.warming = True
        threading.Thread(target=in_background, name="tinyloop-warmup", daemon=True).start()
        return 0

    def stats(self) -> dict:
        """Counters: requests (submitted, finished by reason, rejected, failed), tokens in/out,
        prefix hits and tokens reused, queue depth, running rows, batch size per step, time to
        first token (p50/p99 of recent requests), tokens per second, compiles after warmup,
        depths held (`depths_held`, `depths_evicted`) and the bytes they hold against the memory budget, pages
        per depth (total, free, cached); per depth (`depths`: loops -> counters, in tokens, as
        vLLM counts them) prefix-cache queries and hits, positions computed and the loop passes
        they took, and their sums over depths (with `passes_per_token`). Any thread may call it:
        the batch side is a copy the loop thread publishes after each iteration."""
        with self._cv:
            s = dict(self._view)
            for k, v in self._stats.items():
                s[k] = s.get(k, 0) + v
            s["queue_depth"] = len(self._queue)
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
        s["memory_budget"] = self.memory_budget
        s["budget_tokens"] = self.capacity()["tokens"]
        depths = s.get("depths", {})
        s["depths"] = depths
        for name in ("prefix_cache_queries", "prefix_cache_hits", "tokens_computed", "passes"):
            s[name] = sum(d.get(name, 0) for d in depths.values())
        s["passes_per_token"] = s["passes"] / s["tokens_computed"] if s["tokens_computed"] else 0.0
        return s

    @property
    def programs(self) -> set:
        """The shape keys of the device programs run so far, e.g. ("step", loops, decode rows,
        chunk length, page-table length)."""
        with self._cv:
            return set(self._programs)

    @property
    def store(self) -> PrefixStore | None:
        """The PrefixStore given to the engine (its entries serve prompts, loaded into pages once)."""
        return self.batcher.store

    def stalled(self, after_s: float | None = None) -> str | None:
        """Why this engine no longer serves, or None: its loop has ended, or it has had work and
        no iteration for `after_s` (default STALL_S) seconds — /health's 503, Ray's `check_health`."""
        if not self._thread.is_alive():
            return "the engine's loop has stopped" + (" (closed)" if self._closed else "")
        with self._cv:
            busy = bool(self._queue or self._jobs or self._view.get("running"))
        idle_s = time.perf_counter() - self._beat
        late = idle_s > (STALL_S if after_s is None else after_s)
        return f"the engine has had work and no step for {idle_s:.0f} s" if busy and late else None

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

    def _cancelled(self, h: Handle) -> None:
        """A queued request leaves the queue at once (its place is free); a running one leaves the
        batch before the next step."""
        with self._cv:
            if h in self._queue:
                self._queue.remove(h)
                h.finish("cancelled", Cancelled(f"request {h.id} was cancelled"))
                self._stats["finished_cancelled"] += 1
            self._cv.notify_all()

    def _first_token(self, h: Handle) -> None:
        with self._cv:
            self._ttft.append(h.first_token_at - h.submitted)

    def _publish_programs(self) -> None:
        programs = frozenset(self.batcher.programs)
        with self._cv:
            self._programs = programs

    def _publish(self) -> None:
        """The loop thread's copy of the batch side, for `stats()` and `programs` (other threads
        never read the structures the loop mutates)."""
        view = self.batcher.snapshot()
        if view["programs"] != len(self._programs):
            self._publish_programs()
        with self._cv:
            self._view = view

    # ---- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._queue or self._jobs or self.batcher.busy())
                if self._closed:
                    break
                jobs, self._jobs = self._jobs, []
            self._beat = time.perf_counter()
            for job in jobs:
                job()
            try:
                self._expire()
                self._admit()
                with self._cv:
                    self.batcher.waiting = bool(self._queue)
                self.batcher.step()  # a failed program fails its depth's rows there
            except Exception as e:  # noqa: BLE001 - anything else fails every row, never the loop
                self.batcher.fail_all(e)
            self._publish()
            self._finish()
            self._beat = time.perf_counter()
        err = RuntimeError("engine is closed")
        with self._cv:
            pending, self._queue = list(self._queue), collections.deque()
        for h in pending:
            h.finish("error", err)
        self._finish()
        self.batcher.close(err)

    def _finish(self) -> None:
        """Requests that left the batch end now (after `_publish`: a caller woken by its result
        reads stats that count it)."""
        for h, reason, error in self.batcher.take_finished():
            h.finish(reason, error)

    def _expire(self) -> None:
        """Cancelled and timed-out requests leave (queued or running)."""
        now = time.perf_counter()
        with self._cv:
            keep = collections.deque()
            for h in self._queue:
                why = h.overdue(now)
                if why:
                    h.finish(*why)
                    self._stats[f"finished_{why[0]}"] += 1
                else:
                    keep.append(h)
            self._queue = keep
        self.batcher.expire(now)

    def _admit(self) -> None:
        """Queued requests join the batch, oldest first, while there is room."""
        while True:
            with self._cv:
                if not self._queue:
                    return
                h = self._queue.popleft()
            try:
                if self.batcher.running() >= self.max_batch or not self.batcher.place(h):  # it waits, at the head
                    with self._cv:
                        self._queue.appendleft(h)
                    return
            except Exception as e:  # noqa: BLE001 - this request fails alone
                h.finish("error", e)
                with self._cv:
                    self._stats["requests_failed"] += 1

