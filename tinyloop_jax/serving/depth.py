"""What the batcher keeps per depth (`Depth`: its pool, `PageBook`, request rows) and per
request (`Row`: its request row, pages and progress)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from . import step as S
from .handles import Handle
from ..api.pages import PageBook
from ..model import page_pool


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
