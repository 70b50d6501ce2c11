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

Its rooms, objects it holds: `Budget` (sizes and memory, a value), `Plan` (the programs' shapes
and warmup, over the budget), a `Depth` per depth (its pool, book and rows, and the local and
pass slots its rows hold), `Output` (`reading.py`: a step's tokens back, the stop the step
found, rows leaving). `admission.py` (`place`) is a module over its state. Here: the depths, one
iteration's dispatch (steps and speculative rounds) and failures.
"""

from __future__ import annotations

import collections
from typing import Callable

import jax
import numpy as np

from . import step as S
from .. import settings
from ..decoding import compiled
from ..decoding import grammar as G
from .admission import Admission
from .budget import Budget
from .depth import Depth, Row, namespace
from .handles import Handle, MemoryBudgetError
from .plan import MIN_TABLE, Plan, batch_buckets, chunk_buckets, pow2
from .reading import Output
from ..model import page_pool
from ..model.cache import bucket


class Batcher(Admission):
    """Request rows of every depth over one model. max_batch: request rows per depth (and the
    decode group's largest bucket); chunk: prompt tokens per step; page_size: tokens per page;
    memory_budget: bytes for every depth's pool and rows (None: each pool holds max_batch rows
    at the whole context); overlap: a step's tokens are read after the next step is dispatched;
    decode_steps: decode steps in one program when no prompt is prefilling or waiting (the
    host's work per dispatch spread over that many tokens; stops are found when read)."""

    def __init__(self, model, max_batch: int, chunk: int, stats: collections.Counter,
                 on_first_token: Callable[[Handle], None], memory_budget: int | None = None, overlap: bool = True,
                 max_depths: int = 8, page_size: int = page_pool.PAGE_SIZE, prefix_cache: bool = True, store=None,
                 decode_steps: int = 1):
        self.model, self.cfg, self.max_batch, self.chunk = model, model.weights.config, max_batch, bucket(chunk)
        self.decode_steps = decode_steps  # decode steps per dispatch when no prompt waits
        self.budget = Budget(self.cfg, max_batch, self.chunk, page_size, memory_budget, decode_steps)
        self.plan = Plan(model, self.budget)
        self.waiting = False  # requests wait in the engine's queue (set by the engine each iteration)
        self.prefix_cache = prefix_cache  # False: no prompt reads another's pages
        self.store = store  # a PrefixStore whose entries are loaded into pages when they serve a prompt
        self.stats = stats
        self.overlap, self.page_size = overlap, page_size
        self.max_depths = max_depths
        self.depths: dict[int, Depth] = {}
        self._jits: dict[int, compiled.Programs] = {}  # loops -> its programs (`compiled.programs`), dropped with it
        self.programs: set = set()  # shape keys of the programs run
        self.warm = False
        self.compiles_after_warmup = 0
        self._tick = 0
        self.depth_counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.output = Output(self.cfg, stats, self.depth_counts, on_first_token, prefix_cache)  # tokens back, rows out

    # ---- depths ------------------------------------------------------------------------------

    def running(self) -> int:
        return sum(len(d.rows) for d in self.depths.values())

    def busy(self) -> bool:
        return any(d.rows for d in self.depths.values())

    def _evict_idle(self, extra: int, keep: int | None, depths: int) -> bool:
        """Drop idle depths (least recently used first) until `extra` bytes and `depths` more
        depths fit. False: they do not, with every idle depth gone."""
        def full():
            over = len(self.depths) + depths > self.max_depths
            budget = self.budget.memory_budget
            return over or (budget is not None and self.budget.memory_bytes(self.depths.values()) + extra > budget)
        while full():
            idle = [d for d in self.depths.values() if not d.rows and d.loops != keep]
            if not idle:
                return False
            self.forget(min(idle, key=lambda d: d.used).loops)
            self.stats["depths_evicted"] += 1
        return True

    def jits(self, loops: int) -> compiled.Programs:
        """The depth's programs (made on first use)."""
        if loops not in self._jits:
            self._jits[loops] = compiled.programs()
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
        b = self.budget
        need = b.depth_nbytes(loops)
        if not self._evict_idle(need, None, 1):
            if not self.busy():
                raise MemoryBudgetError(f"a pool at loops={loops} ({need / 2**20:.2f} MiB) does not fit "
                                        f"memory_budget={b.memory_budget} bytes beside the depths that stay; lower "
                                        "loops, or raise the budget")
            self.stats["memory_waits"] += 1
            return None
        n_pages, jits = b.pool_pages(loops), self.jits(loops)
        d = Depth(loops, self.model.exit_for(loops), b.empty_pool(loops, n_pages, jits.empty_pool), b.book(n_pages),
                  b.empty_rows())
        self.depths[loops] = d
        return d

    # ---- pass slots (a compact kv_share) -----------------------------------------------------

    def _collapse(self, d: Depth, r: Row) -> None:
        """Row r's prompt is done: its pages' compact loop layers filled from their pass slots
        (`page_pool.collapse_pages`), then the slots dropped."""
        n = len(r.passes)
        pages = np.full((pow2(n, MIN_TABLE),), d.book.n_pages, np.int32)
        pages[:n] = r.passes
        d.pool = self._run(("collapse", d.loops, len(pages)), self.jits(d.loops)["collapse_pages"], d.pool, pages,
                           loops=d.loops)
        d.drop_passes(r)

    def warmup(self, loops: int, adaptive: bool = False, speculation=(), grammar: bool = False) -> int:
        """Compile every program of a depth's steps (`Plan.warmup`); returns how many were new."""
        new = self.plan.warmup(loops, self.jits(loops), self.programs, self.store, loops not in self.depths, adaptive,
                               speculation, grammar)
        self.programs |= new
        self.warm = True
        if new:
            settings.release_free_memory()
        return len(new)

    def _run(self, key: tuple, program, *args, **kw):
        late = self.warm and key not in self.programs  # a compile past the warmup
        self.programs.add(key)
        self.compiles_after_warmup += late
        out = program(*args, **kw)  # (compiled before it is dispatched)
        if late:  # (a served model's compile frees ~0.25 GiB)
            settings.release_free_memory()
        return out

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
        # a grammar's next mask needs the token before it: a plain decode-only step dispatches its
        # forward first and reads the step before while it runs (`_choose`); any other step reads it now
        piped = not d.prefilling and not d.adaptive
        if prev is not None and not piped and any(r.handle.matcher is not None for r, *_ in prev):
            self.output.read(d, prev)
            prev = None
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
            # structured output: every row of the step gets a mask (all ones for free rows), one step a dispatch;
            # a prompt chunk beside decode rows always takes them (one program set, grammar or not)
            masked = any(r.handle.matcher is not None for r in decoding) or (
                chunk is not None and chunk[2] and chunk[0].handle.matcher is not None) or (
                chunk is not None and not d.adaptive and not chunk[0].handle.in_prefill)
            burst = chunk is None  # decode rows alone: 1 step or a burst (nothing to admit: n in one program)
            many = self.decode_steps if burst and not self.waiting and not masked else 1
            R = self.plan.table_len(max(lengths) + many - 1)
            chunks = decodes = None
            T = bd = 0
            if chunk is not None:
                r, n, final = chunk
                T = next(t for t in (self.plan.exit_lengths() if r.handle.in_prefill else self.plan.chunk_sizes())
                         if t >= n)
                chunks = S.make_chunks([r.pages], [r.handle.prompt[r.fed:r.fed + n]], [r.fed], [r.slot], [final], T,
                                       R, 1, [r.handle.cache_window],
                                       self._masks([r.handle.matcher if final else None], 1) if masked else None)
            if decoding or not d.adaptive:  # (a chunk alone: beside one filler decode row, one program fewer)
                joint = chunk is not None and not d.adaptive and not chunk[0].handle.in_prefill  # one forward
                bd = next(b for b in (chunk_buckets if joint else batch_buckets)(self.max_batch) if b >= len(decoding))
                starts = [r.fed + len(r.handle.tokens) + r.ahead - 1 for r in decoding]
                left = [r.handle.params.max_tokens - len(r.handle.tokens) - r.ahead for r in decoding]
                decodes = S.make_decodes([r.pages for r in decoding], starts, [r.slot for r in decoding],
                                         [len(r.handle.tokens) + r.ahead for r in decoding], R, bd,
                                         [r.handle.cache_window for r in decoding], left,
                                         self._masks([r.handle.matcher for r in decoding], bd)
                                         if masked and not (piped and chunk is None) else None)
            if chunk is not None:
                d.window(chunk[0], chunk[0].fed, chunk[1])
            for r, q in zip(decoding, starts if decodes is not None else ()):
                d.window(r, q, many)
            d.sync()
            w, jits = self.model.weights, self.jits(d.loops)
            dtok = passes = cdepth = None
            exits = chunk is not None and chunk[0].handle.in_prefill
            if chunk is not None and (d.adaptive or exits):  # the prompt's chunk alone
                pool = page_pool.swap(d.pool) if d.compact else d.pool  # (a compact kv_share: on the pass slots)
                if exits:  # the prompt exits as a whole: its passes read now (once a request)
                    ctok, _, pool, d.state = self._run(("in_prefill", d.loops, T, R) + masked * ("masked",),
                                                       jits["step"], w.params, w.config, pool, d.state, chunks, None,
                                                       loops=d.loops, in_prefill=True)
                    cdepth = int(np.asarray(ctok.passes)[0])
                else:
                    ctok, _, pool, d.state = self._run(("step", d.loops, 0, T, R) + masked * ("masked",),
                                                       jits["step"], w.params, w.config, pool, d.state, chunks,
                                                       None, loops=d.loops, exit=d.exit)
                d.pool = page_pool.swap(pool) if d.compact else pool
            elif chunk is not None:  # the chunk and the decode rows in one forward
                ctok, dtok, d.pool, d.state = self._run(("step", d.loops, bd, T, R),  # (masks always)
                                                        jits["step"], w.params, w.config, d.pool, d.state, chunks,
                                                        decodes, loops=d.loops, exit=d.exit)
            if decoding and dtok is None and masked and piped:  # forward, the step before read, masks, choice
                dtok, prev = self._choose(d, decoding, decodes, R, bd, prev), None
            elif decoding and dtok is None:  # `decode_steps`: plain, or adaptive (each row's passes stop at its exit)
                got, d.pool, d.state = self._run(("steps", d.loops, bd, R, d.adaptive) + masked * ("masked",),
                                                 jits["decode_steps"], w.params, w.config, d.pool, d.state, decodes,
                                                 np.int32(many), loops=d.loops,
                                                 n_max=1 if masked else self.decode_steps, exit=d.exit,
                                                 adaptive=d.adaptive)
                dtok, passes = got.out, got.passes
            self.stats["steps"] += 1
            counts = self.depth_counts[d.loops]
            if chunk is not None:
                r, n, final = chunk
                r.fed += n
                if self.prefix_cache and not exits:  # its full pages (and at its end its partial last one):
                    # shareable now
                    d.book.insert(r.handle.prompt[:r.fed], r.pages, partial=final, ns=namespace(self.cfg, r.handle))
                self.stats["prefill_chunks"] += 1
                counts["tokens_computed"] += n
                counts["passes"] += n * (d.loops if cdepth is None else cdepth)
                counts["passes_skipped"] += 0 if cdepth is None else n * (d.loops - cdepth)
                if final:
                    if d.compact:  # decode steps read the prompt compact from now on
                        self._collapse(d, r)
                    d.prefilling.popleft()
                    r.decoding = True
                    r.ahead += 1
                    if r.handle.policy is not None:  # the prompt ran every pass, or exited as a whole
                        r.handle.passes.append(d.loops if cdepth is None else cdepth)
                    ran.append((r, 0, ctok, None))
            fed = 0
            for i, r in enumerate(decoding):
                if r.left:  # (ended by the step before, read in `_choose`)
                    continue
                k = min(many, r.handle.params.max_tokens - len(r.handle.tokens) - r.ahead)
                r.ahead += k
                fed += k
                ran.append((r, i, dtok, passes, k))
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
                self.output.read(d, ran)
        self._speculate(d)
        if prev is not None:
            self.output.read(d, prev)

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
            R = self.plan.table_len(max(starts) + k + 1)
            bd = next(b for b in batch_buckets(self.max_batch) if b >= len(rows))
            left = [r.handle.params.max_tokens - len(r.handle.tokens) for r in rows]
            # structured output: the first position's masks from the matchers (which took every token
            # read), the drafts' asked of them in the round (`grammar.draft_masks`), rolled back after
            matchers = [r.handle.matcher for r in rows] + [None] * (bd - len(rows))
            call = G.register(matchers, reads=True) if any(m is not None for m in matchers) else None
            decodes = S.make_decodes([r.pages for r in rows], starts, [r.slot for r in rows],
                                     [len(r.handle.tokens) for r in rows], R, bd, [r.handle.cache_window for r in rows],
                                     left, None if call is None else G.fill_masks(matchers, self.cfg.vocab_size))
            for r, q in zip(rows, starts):
                d.window(r, q, k + 1)
            d.sync()
            w = self.model.weights
            try:
                got, d.pool, d.state = self._run(
                    ("speculate", d.loops, k, bd, R) + ("masked",) * (call is not None),
                    self.jits(d.loops)["decode_steps"], w.params, w.config, d.pool, d.state, decodes, np.int32(1),
                    loops=d.loops, n_max=k + 1, exit=d.exit, draft_loops=np.int32(spec.draft_loops), lookahead=k,
                    grammar=None if call is None else np.int32(call))
                got = jax.tree.map(np.asarray, got)
            finally:
                if call is not None:
                    G.release(call)
            self.stats["speculative_rounds"] += 1
            self.stats["batch_rows"] += len(rows)
            counts["tokens_computed"] += len(rows) * (k + 1)
            counts["passes"] += len(rows) * (k * spec.draft_loops + (k + 1) * d.loops)
            for i, r in enumerate(rows):  # d_1 .. d_a and the next token, cut at a stop, at max_tokens and
                # where the grammar ends
                r.handle.drafted += k
                r.handle.accepted += int(got.accepted[i])
                for t, stop in zip(got.out.tokens[i, :got.n[i]], got.out.stops[i]):
                    if not r.left:
                        self.output.emit(d, r, int(t), int(stop))

    def _choose(self, d: Depth, decoding: list, decodes, R: int, bd: int, prev: list | None):
        """A decode-only step with grammar rows, in two dispatches: the forward
        (`step.decode_forward`), then — while it runs — the step before it read (its tokens
        taken by the matchers), then the choice with the masks (`step.decode_choose`); a row the
        read ended has fed one token for nothing and chooses none (its slot a filler).
        Returns the tokens (`Emitted` [bd])."""
        w, jits = self.model.weights, self.jits(d.loops)
        logits, d.pool = self._run(("forward", d.loops, bd, R), jits["decode_forward"], w.params, w.config, d.pool,
                                   d.state, decodes, loops=d.loops, exit=d.exit)
        if prev is not None:
            self.output.read(d, prev)
        kept = np.pad(np.array([not r.left for r in decoding], bool), (0, bd - len(decoding)))
        choice = decodes.replace(rows=decodes.rows.replace(pages=decodes.rows.pages[:, :1]),  # (the choice reads
                                 # no pages: one program per row bucket)
                                 slot=np.where(kept, decodes.slot, S.FILLER).astype(np.int32),
                                 mask=self._masks([r.handle.matcher if k else None for r, k in zip(decoding, kept)],
                                                  bd))
        dtok, d.state = self._run(("choose", d.loops, bd, "masked"), jits["decode_choose"], d.state, choice, logits)
        return dtok

    def _masks(self, matchers: list, rows: int) -> np.ndarray:
        """Grammar masks [rows, W] of a step's rows (None or padding: every token)."""
        return G.fill_masks(list(matchers) + [None] * (rows - len(matchers)), self.cfg.vocab_size)

    # ---- leaving -----------------------------------------------------------------------------

    def release(self, d: Depth, r: Row, reason: str, error: BaseException | None = None) -> None:
        self.output.release(d, r, reason, error)

    def take_finished(self) -> list:
        return self.output.take_finished()

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

    def snapshot(self) -> dict:
        return dict(self.stats, running=self.running(), depths_held=len(self.depths),
                    memory_bytes=self.budget.memory_bytes(self.depths.values()),
                    programs=len(self.programs), compiles_after_warmup=self.compiles_after_warmup,
                    depths={loops: dict(c) for loops, c in self.depth_counts.items()},
                    pages={loops: dict(total=d.book.n_pages, free=d.book.free, cached=d.book.cached(),
                                       **({} if d.book.local is None else dict(
                                           local_slots=d.book.local.n_slots, local_free=d.book.local.free,
                                           local_idle=d.book.local.idle, local_reclaimed=d.book.local.reclaimed)),
                                       **({} if d.book.prompts is None else dict(
                                           pass_slots=d.book.prompts.n_slots, pass_free=d.book.prompts.free,
                                           pass_idle=d.book.prompts.idle,
                                           pass_reclaimed=d.book.prompts.reclaimed)))
                           for loops, d in self.depths.items()})
