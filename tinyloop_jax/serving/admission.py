"""Admission: a request placed into a request row of its depth, with page tables — its prompt's
full pages already in the pool read in place (or loaded from a `PrefixStore` entry), pages for
the rest and max_tokens allocated, its row packed once (`step.admit`). A base of `Batcher`.
"""

from __future__ import annotations

import jax
import numpy as np

from . import step as S
from .handles import Handle, MemoryBudgetError
from ..decoding.sampling import Knobs
from ..model import adaptive as ad
from ..model import cache as kvc
from .depth import Depth, Row, namespace
from .plan import MIN_TABLE, pow2


class Admission:
    """`Batcher.place` and what it asks (`Batcher`'s base)."""

    def place(self, h: Handle) -> bool:
        """Give a request a request row and its pages; False: it waits (no pages free now)."""
        n, max_tokens = len(h.prompt), h.params.max_tokens
        d = self.depth(h.loops)
        if d is None:
            return False
        slot = next((i for i in range(self.max_batch) if i not in d.rows), None)
        if slot is None:
            return False
        ahead = h.speculation.lookahead if h.speculation else 0
        need = self.budget.need_pages(n, max_tokens + ahead)
        credits = self.budget.credits(need, ahead, n if h.in_prefill else None)
        if need > d.book.n_pages or (d.book.local is not None and credits + 1 > d.book.local.n_slots):
            if d.rows:
                return False
            raise MemoryBudgetError(f"a request of {n} + {max_tokens} tokens needs {need} pages; the pool at "
                                    f"loops={h.loops} holds {d.book.n_pages} within memory_budget="
                                    f"{self.budget.memory_budget} bytes")
        # at least the last token is computed (its logits); a prompt that may exit is computed whole
        # (one chunk exiting as a whole) and shares no pages: its K/V depend on where it exited
        share = self.prefix_cache and not h.in_prefill
        ns = self.namespace(h)
        shared = d.book.match(h.prompt[:n - 1], ns) if share else []
        if d.compact:  # (a compact kv_share) a prompt reads every pass of what it shares: the pages that kept them
            shared = shared[:next((i for i, p in enumerate(shared) if not d.book.prompts.has(p)), len(shared))]
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
        if tail is not None and d.compact and not d.book.prompts.has(tail[0]):
            tail = None  # its passes are gone
        keep = d.book.windowed(shared)
        d.book.release(shared[keep:])  # their local layers' window is gone
        shared = shared[:keep]
        if tail is not None:
            d.book.retain([tail[0]])  # not evicted for this request's own pages: it is copied into the first
        own = d.book.alloc(need - len(shared))
        if own is not None and d.book.local is not None and not d.book.local.promise(credits + 1):
            d.book.release(own)
            own = None
        n_prompt = d.book.pages_for(n)  # (a compact kv_share: the prompt's pages hold pass slots, + the tail's)
        if own is not None and d.compact and not d.book.prompts.promise(n_prompt + 1):
            if d.book.local is not None:
                d.book.local.unpromise(credits + 1)
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
            d.window(row, len(shared) * self.page_size + (tail[1] if tail else 0), 1)
        if d.compact:  # the tail's pass slot first (its copy's source), then the prompt's pages'
            if tail is not None:
                d.book.prompts.hold(tail[0])
            d.hold_passes(row, row.pages[:n_prompt])
        if tail is not None:  # a partial page that begins the rest: copied, then continued
            try:
                d.sync()
                d.pool = self._run(("copy", d.loops), self.jits(d.loops)["copy_pages"], d.pool,
                                   np.asarray([tail[0]], np.int32), np.asarray([own[0]], np.int32))
            except Exception as e:
                self.fail_depth(d, e)  # (the depth and its book are dropped)
                raise
            for slots in (d.book.local, d.book.prompts):
                if slots is not None:
                    slots.drop(tail[0])
            d.book.release([tail[0]])
            extra = tail[1]
        for slots in (d.book.local, d.book.prompts):
            if slots is not None:
                slots.unpromise(1)  # the tail's credit
        seen = np.zeros((self.cfg.vocab_size,), bool)
        seen[h.prompt] = True
        req = Knobs.from_params([h.params], logit_bias=True, sampled=True, stop_shape=S.STOPS)
        pol = jax.tree.map(np.asarray, ad.EVERY_PASS if h.policy is None else h.policy)
        try:
            d.state = self._run(("admit", d.loops), self.jits(d.loops)["admit"], d.state, np.int32(slot), seen, req,
                                pol)
        except Exception as e:
            self.fail_depth(d, e)  # (the depth and its book are dropped)
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
        return namespace(self.cfg, h)

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
        P, W = self.page_size, self.budget.local_window
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
        if d.compact and not d.book.prompts.promise(len(new)):  # pass slots for the pages the load fills
            if window:
                d.book.local.unpromise(len(window))
            d.book.release(new)
            return shared
        for p in window:  # slots for the pages the first query's window reads, filled by the load
            d.book.local.hold(p)
        for p in new if d.compact else ():
            d.book.prompts.hold(p)
        R = pow2(len(pages), MIN_TABLE)
        table = np.zeros((R,), np.int32)
        table[:len(pages)] = pages
        d.sync()
        d.pool = self._run(("load", d.loops, entry.cache.capacity, R), self.jits(d.loops)["load_segment"], d.pool,
                           entry.cache, table, np.int32(len(shared) * P), np.int32(full * P))
        for p in window:  # idle now, their K/V kept: the request holds them again at once
            d.book.local.drop(p)
        if window:
            d.book.local.unpromise(len(window))
        for p in new if d.compact else ():
            d.book.prompts.drop(p)
        if d.compact:
            d.book.prompts.unpromise(len(new))
        d.book.insert(prompt[:full * P], pages, ns=self.namespace(h))
        store.touch(entry)
        self.stats["prefix_pool_loads"] += 1
        return pages
