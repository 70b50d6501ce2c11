"""The host's record of a page pool (`model.paged`): free pages, reference counts, and a radix
index of the full pages written so far — plain data, no JAX.

    book = PageBook(n_pages=64, page_size=16)
    shared = book.match(prompt)              # pages already holding the prompt's first full pages
    book.retain(shared)                      # the request reads them (never writes them)
    own = book.alloc(pages_needed)           # None: not now (the request waits)
    ...                                      # the step writes the rest of the prompt into `own`
    book.insert(prompt, shared + own)        # its full pages are shareable from now on
    book.release(shared + own)               # the request is done; indexed pages stay cached

Every holder of a page counts one reference: a request reading or writing it, a pinned
`PrefixStore` entry, and the index itself (one, while the page is indexed). A page with no
reference is free. A page only the index holds is *cached*: it serves later matches and is
evicted, least recently used first and leaves before their parents, when `alloc` needs room.
A request writes only pages it allocated and no one else holds, so a shared page is never
written; a request that continues from a partial page copies it first (`fork`, `match_tail`:
the partial last page of a finished request is indexed too, so a chat's next turn reads the
previous one to the token).
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterable, Sequence


class _Node:
    __slots__ = ("page", "parent", "children", "used", "key")

    def __init__(self, page: int, parent: "_Node | None", key: tuple):
        self.page, self.parent, self.key = page, parent, key
        self.children: dict[tuple, _Node] = {}
        self.used = 0


class LocalSlots:
    """The slots of a pool's local layers (layers with a window of their own: `model.paged`'s
    `local_map`): a page has a slot while a row whose window covers it holds it, and keeps it
    idle afterwards (an indexed page's local K/V serve later matches) until a row needs the slot.

    Rows hold slots against credits promised when they are admitted (`promise`): each `hold`
    spends one, each `drop` gives it back, so slots free or idle always cover what is promised
    and a row never waits for a slot once admitted. A page whose slot was taken back has no
    local K/V: only queries past its window may read it (`PageBook.windowed`)."""

    def __init__(self, n_slots: int, n_pages: int):
        if n_slots < 1:
            raise ValueError(f"n_slots={n_slots} must be >= 1")
        self.n_slots = n_slots
        self.slot = [-1] * n_pages  # page -> its slot (-1: none)
        self.holders = [0] * n_pages
        self._free = list(range(n_slots - 1, -1, -1))
        self._idle: collections.OrderedDict = collections.OrderedDict()  # pages with a slot no row holds, LRU first
        self.promised = 0  # credits promised and not yet spent
        self.changed = True  # the map differs from the device's copy
        self.reclaimed = 0  # idle slots taken back for another page

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def available(self) -> int:
        """Slots that can still be promised."""
        return self.free + self.idle - self.promised

    def promise(self, n: int) -> bool:
        if n > self.available():
            return False
        self.promised += n
        return True

    def unpromise(self, n: int) -> None:
        if n > self.promised:
            raise RuntimeError(f"{n} local credits given back, only {self.promised} promised")
        self.promised -= n

    def has(self, page: int) -> bool:
        return self.slot[page] >= 0

    def hold(self, page: int) -> None:
        """A row's window reaches `page` (spends one of its credits): the page gets a slot (a
        free one, else the least recently idle page's) unless it has one."""
        if self.promised < 1:
            raise RuntimeError("a local slot held without a credit")
        self.promised -= 1
        if self.holders[page] == 0:
            if self.slot[page] >= 0:
                del self._idle[page]
            else:
                if self._free:
                    s = self._free.pop()
                else:
                    old, _ = self._idle.popitem(last=False)
                    s, self.slot[old] = self.slot[old], -1
                    self.reclaimed += 1
                self.slot[page] = s
                self.changed = True
        self.holders[page] += 1

    def drop(self, page: int) -> None:
        """A row's window has passed `page` (its credit back)."""
        if self.holders[page] <= 0:
            raise RuntimeError(f"page {page}'s local slot dropped more often than it was held")
        self.holders[page] -= 1
        self.promised += 1
        if self.holders[page] == 0:
            self._idle[page] = None

    def forget(self, page: int) -> None:
        """The page is free: so is its slot."""
        if self.slot[page] >= 0:
            if self.holders[page]:
                raise RuntimeError(f"page {page} freed while a row holds its local slot")
            del self._idle[page]
            self._free.append(self.slot[page])
            self.slot[page] = -1
            self.changed = True


class PageBook:
    """Pages 0 .. n_pages - 1 of one pool of `page_size`-token pages (with n_local: and the
    `LocalSlots` of its local layers, whose window is `window` positions; with n_prompt: the
    pass slots of a compact `kv_share` pool, `prompts`, kept as local slots are: held by the
    pages of a prompt in flight, idle afterwards — an indexed page serves a later prompt only
    while it keeps its slot)."""

    def __init__(self, n_pages: int, page_size: int, n_local: int | None = None, window: int = 0,
                 n_prompt: int | None = None):
        if n_pages < 1:
            raise ValueError(f"n_pages={n_pages} must be >= 1")
        self.n_pages, self.page_size = n_pages, page_size
        self.local = None if n_local is None else LocalSlots(n_local, n_pages)
        self.prompts = None if n_prompt is None else LocalSlots(n_prompt, n_pages)
        self.window = window
        self.refs = [0] * n_pages
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: low ids first
        self._roots: dict = {}  # namespace -> the root of its tree
        self._nodes: dict[int, _Node] = {}  # indexed page -> its node
        self._clock = itertools.count(1)

    # ---- counts ----------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return len(self._free)

    def free_pages(self) -> set[int]:
        return set(self._free)

    def indexed(self) -> set[int]:
        return set(self._nodes)

    def cached(self) -> int:
        """Pages eviction can free: indexed pages only the index holds, with nothing held below
        them (a child still read keeps its parents)."""
        order, stack = [], list(self._roots.values())
        while stack:  # parents before children; walked backwards, children come first
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        whole, n = {}, 0
        for node in reversed(order):
            ok = all(whole[id(c)] for c in node.children.values())
            ok = ok and (node.parent is None or self.refs[node.page] == 1)
            whole[id(node)] = ok
            n += ok and node.parent is not None
        return n

    def available(self) -> int:
        """Pages `alloc` could hand out now: free ones and every cached page."""
        return self.free + self.cached()

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    # ---- references --------------------------------------------------------------------------

    def retain(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p} is free: it cannot be retained")
            self.refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p} released more often than it was held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
                for slots in (self.local, self.prompts):
                    if slots is not None:
                        slots.forget(p)

    def alloc(self, n: int) -> list[int] | None:
        """n pages held once by the caller, evicting cached pages if needed; None (nothing
        changed) if not even eviction frees enough."""
        if n > self.available():
            return None
        while self.free < n:
            self.evict(n - self.free)
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self.refs[p] = 1
        return out

    def windowed(self, pages: Sequence[int], tail: int | None = None, extra: int = 0) -> int:
        """How many of `pages` (a match: positions from 0) a request can start after, reading
        its local layers: the most m whose last window (of a first query at m P + extra, the
        partial page `tail` after them copied in) has local slots. Without local slots: all."""
        if self.local is None:
            return len(pages)
        P, W = self.page_size, self.window
        for m in range(len(pages), -1, -1):
            q = m * P + (extra if m == len(pages) and tail is not None else 0)
            need = list(pages[max(0, q - W + 1) // P:m]) + ([tail] if q > m * P else [])
            if all(self.local.has(p) for p in need):
                return m
        return 0

    # ---- the index ---------------------------------------------------------------------------

    def _chunks(self, tokens: Sequence[int]) -> list[tuple]:
        P = self.page_size
        t = [int(x) for x in tokens]
        return [tuple(t[i:i + P]) for i in range(0, len(t) - P + 1, P)]

    def _root(self, ns) -> _Node:
        if ns not in self._roots:
            self._roots[ns] = _Node(-1, None, ())
        return self._roots[ns]

    def match(self, tokens: Sequence[int], ns=None) -> list[int]:
        """The pages holding the longest run of tokens' full pages the index knows (not retained:
        the caller retains what it keeps). Marks them used. `ns`: the namespace (pages whose
        contents depend on more than the tokens, e.g. a seed, are indexed under it)."""
        node, out, now = self._root(ns), [], next(self._clock)
        for c in self._chunks(tokens):
            node = node.children.get(c)
            if node is None:
                break
            node.used = now
            out.append(node.page)
        return out

    def match_tail(self, tokens: Sequence[int], n_full: int, ns=None) -> tuple[int, int] | None:
        """After the first n_full pages of tokens (a `match`), the indexed page (partial, or full
        but matching only in part) whose tokens share the longest start with the rest of
        `tokens`: (its page, how many of its tokens match); None if none matches a token. A
        reader copies the page before writing after it (it is shared)."""
        P = self.page_size
        node = self._root(ns)
        for c in self._chunks(tokens)[:n_full]:
            node = node.children.get(c)
            if node is None:
                return None
        rest, best = [int(x) for x in tokens[n_full * P:(n_full + 1) * P]], None
        for key, child in node.children.items():
            k = next((i for i, (a, b) in enumerate(zip(key, rest)) if a != b), min(len(key), len(rest)))
            if k and (best is None or k > best[1]):
                best = (child, k)
        if best is None:
            return None
        best[0].used = next(self._clock)
        return best[0].page, best[1]

    def insert(self, tokens: Sequence[int], pages: Sequence[int], partial: bool = False, ns=None) -> int:
        """Index tokens' full pages: pages[i] holds tokens[i P:(i + 1) P] (held by the caller);
        with `partial`, the last page too if it is partial (its tokens are never written again;
        later readers copy the page before writing after them; a page indexed partial whose
        holder wrote on is indexed again under its longer tokens). A chunk already indexed keeps
        its page; a new one is indexed with a reference of the index's own. Returns how many
        pages were newly indexed."""
        node, now, added = self._root(ns), next(self._clock), 0
        chunks = self._chunks(tokens)
        if partial and len(tokens) % self.page_size and len(pages) > len(chunks):
            chunks.append(tuple(int(x) for x in tokens[len(chunks) * self.page_size:]))
        for c, p in zip(chunks, pages):
            child = node.children.get(c)
            grown = self._nodes.get(p)
            if child is None and grown is not None and grown.parent is node and len(grown.key) < len(c) \
                    and c[:len(grown.key)] == grown.key:
                # indexed partial (a prompt's last page) and written on since (its answer): the key grows
                del node.children[grown.key]
                grown.key, child = c, grown
                node.children[c] = grown
            if child is None:
                if p in self._nodes:  # a page indexed elsewhere cannot hold these tokens too
                    raise RuntimeError(f"page {p} is already indexed under other tokens")
                if self.refs[p] <= 0:
                    raise RuntimeError(f"page {p} is free: only a held page can be indexed")
                child = node.children[c] = _Node(p, node, c)
                self._nodes[p] = child
                self.refs[p] += 1
                added += 1
            child.used = now
            node = child
            if len(c) < self.page_size:
                break
        return added

    def evict(self, n: int) -> int:
        """Free up to n cached pages, least recently used leaves first. Returns how many."""
        done = 0
        while done < n:
            leaves = [x for x in self._nodes.values() if not x.children and self.refs[x.page] == 1]
            if not leaves:
                break
            for x in sorted(leaves, key=lambda x: x.used)[:n - done]:
                del x.parent.children[x.key]
                del self._nodes[x.page]
                self.release([x.page])
                done += 1
        return done

    def fork(self, pages: Sequence[int], length: int) -> tuple[list[int], tuple[int, int] | None] | None:
        """A new holder of the first `length` positions of `pages` (a request's n > 1, a fork):
        the full pages are retained (shared), a partial last page is copied into a new page.
        Returns (the new table, (src, dst) page copy or None), or None when no page is free."""
        full, part = divmod(length, self.page_size)
        if part:
            new = self.alloc(1)
            if new is None:
                return None
            self.retain(pages[:full])
            return list(pages[:full]) + new, (pages[full], new[0])
        self.retain(pages[:full])
        return list(pages[:full]), None
