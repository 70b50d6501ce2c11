"""What the batcher keeps per depth (`Depth`: its pool, `PageBook`, request rows, and the local
and pass slots its rows hold) and per request (`Row`: its request row, pages and progress)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import jax
import numpy as np

from . import step as S
from .handles import Handle
from ..api.pages import PageBook
from ..model import page_pool
from ..model import recurrence as rec


def namespace(cfg, h: Handle):
    """Under which name a request's pages are indexed: what its K/V depend on beside the tokens
    — its seed (Huginn's initial loop states are drawn from it) and its cache_window (the
    attention every layer's input went through) — or None (shared by all)."""
    seed = h.params.seed if rec.injected(cfg) and rec.state_std(cfg) > 0 else None
    return (seed, h.cache_window) if h.cache_window else seed


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
    passes: list = field(default_factory=list)  # its prompt's pages, whose pass slots it holds (a compact
    # kv_share, until its prompt ends)


@dataclass
class Depth:
    """One depth's pool, pages and rows (`pool` and `state` are the device side)."""

    loops: int
    exit: object  # exits.Exit or None
    pool: page_pool.PagedKV
    book: PageBook
    state: S.Requests
    rows: dict = field(default_factory=dict)  # request row -> Row
    prefilling: collections.deque = field(default_factory=collections.deque)  # rows with prompt left, FIFO
    used: int = 0  # tick of its last admission
    inflight: tuple | None = None  # the dispatched step not read yet
    adaptive: bool = False  # a request with an exit rule came in: decode rows take the adaptive-depth step

    @property
    def compact(self) -> bool:
        """Its pool keeps the loop layers compact (a `kv_share` other than full), prompts in pass slots."""
        return self.book.prompts is not None

    def leave(self, r: Row, index: bool, ns) -> None:
        """Row r's request row, pages and slots back (it leaves). index: the full pages of its
        prompt and output stay indexed under ns (a later turn of the chat reads them; a compact
        kv_share keeps output compact only, which no prompt reads: its prompt's alone)."""
        if self.rows.get(r.slot) is r:
            del self.rows[r.slot]
            if index and r.decoding and not r.handle.in_prefill and not self.compact:  # (each emitted token
                # but the last was fed: its K/V are written)
                self.book.insert(list(r.handle.prompt) + r.handle.tokens[:-1], r.pages, partial=True, ns=ns)
            self.unhold(r)
            if self.compact:
                self.drop_passes(r)
            self.book.release(r.pages)
        if r in self.prefilling:
            self.prefilling.remove(r)

    # ---- local slots (a model with windowed layers: `PagedKV.local`) ----------------------------

    def window(self, r: Row, q0: int, T: int) -> None:
        """Row r's next program queries positions q0 .. q0 + T - 1: its local slots follow its
        window there (pages wholly before it are dropped: no later query of the row reads them)."""
        local = self.book.local
        if local is None:
            return
        P = self.book.page_size
        first, last = max(0, q0 - self.book.window + 1) // P, min((q0 + T - 1) // P, len(r.pages) - 1)
        for i in sorted(i for i in r.held if i < first):
            local.drop(r.pages[i])
            r.held.discard(i)
        for i in range(first, last + 1):
            if i not in r.held:
                local.hold(r.pages[i])
                r.held.add(i)

    def unhold(self, r: Row) -> None:
        """Row r's slots and credits back (it leaves)."""
        if self.book.local is None or r.credits == 0:
            return
        for i in r.held:
            self.book.local.drop(r.pages[i])
        r.held.clear()
        self.book.local.unpromise(r.credits)
        r.credits = 0

    def sync(self) -> None:
        """The device's page -> slot maps brought up to the book's (local and pass slots)."""
        local, prompts = self.book.local, self.book.prompts
        if local is not None and local.changed:
            self.pool = self.pool.replace(slot_of=jax.device_put(np.asarray(local.slot, np.int32)))
            local.changed = False
        if prompts is not None and prompts.changed:
            self.pool = self.pool.replace(aside_of=jax.device_put(np.asarray(prompts.slot, np.int32)))
            prompts.changed = False

    # ---- pass slots (a compact kv_share) -----------------------------------------------------

    def hold_passes(self, r: Row, pages: list) -> None:
        """Row r's prompt pages get pass slots (against credits promised at admission)."""
        for p in pages:
            self.book.prompts.hold(p)
        r.passes = list(pages)

    def drop_passes(self, r: Row) -> None:
        """Row r's pass slots back (its prompt ended, or it left): idle, their K/V kept for
        later prompts that read its pages, until another prompt needs the slot."""
        if not r.passes:
            return
        for p in r.passes:
            self.book.prompts.drop(p)
        self.book.prompts.unpromise(len(r.passes))
        r.passes = []
