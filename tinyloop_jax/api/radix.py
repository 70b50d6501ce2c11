"""Prefix bookkeeping as plain data (no JAX): a radix index over token sequences and an LRU
order with pins. The `PrefixStore` and the serving engine's prefix pool both match prompts
through a `RadixIndex`; the store evicts through a `Recency`.

    index = RadixIndex()
    index.insert(7, [1, 2, 3, 4])
    index.insert(9, [1, 2, 5])
    index.match([1, 2, 3, 9])      # -> (7, 3): entry 7 holds the first 3 tokens
    index.holders([1, 2])          # -> {7, 9}

The tree's edges are chunks of at most `CHUNK` token ids; inside the first chunk that differs
the match continues token by token, so a match is exact to the token. A node knows every
sequence that runs through it, so any of them serves the matched prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Iterator

CHUNK = 32


class _Node:
    __slots__ = ("children", "keys")

    def __init__(self):
        self.children: dict[tuple, _Node] = {}
        self.keys: set = set()  # the sequences that run through this node


def chunks(tokens: Iterable[int]) -> list[tuple[int, ...]]:
    """tokens cut into the tree's edges: tuples of CHUNK ids, the last one shorter."""
    t = [int(x) for x in tokens]
    return [tuple(t[i:i + CHUNK]) for i in range(0, len(t), CHUNK)]


def common_length(a, b) -> int:
    """How many leading ids two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixIndex:
    """Token sequences under hashable keys (equal sequences under two keys are two entries)."""

    def __init__(self):
        self._root = _Node()
        self._tokens: dict[Hashable, tuple[tuple[int, ...], ...]] = {}  # key -> its chunks

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, key) -> bool:
        return key in self._tokens

    def insert(self, key, tokens) -> None:
        """Index `tokens` (1-D ids) under `key`, a key not held yet."""
        if key in self._tokens:
            raise ValueError(f"key {key!r} is already in the index")
        parts = chunks(tokens)
        self._tokens[key] = tuple(parts)
        node = self._root
        node.keys.add(key)
        for c in parts:
            node = node.children.setdefault(c, _Node())
            node.keys.add(key)

    def remove(self, key) -> None:
        """Forget `key` (a held key); nodes no key runs through any more are dropped."""
        if key not in self._tokens:
            raise ValueError(f"key {key!r} is not in the index")
        node = self._root
        node.keys.discard(key)
        for c in self._tokens.pop(key):
            child = node.children[c]
            child.keys.discard(key)
            if not child.keys:  # its whole subtree held only this key
                del node.children[c]
                break
            node = child

    def _walk(self, tokens) -> tuple[int, _Node]:
        """(tokens matched, the deepest node reached): whole chunks, then the child sharing the
        most of the first chunk that differs."""
        node, k = self._root, 0
        for c in chunks(tokens):
            child = node.children.get(c)
            if child is not None:
                node, k = child, k + len(c)
                continue
            best, best_child = 0, None
            for edge, ch in node.children.items():
                n = common_length(edge, c)
                if n > best:
                    best, best_child = n, ch
            if best_child is not None:
                node, k = best_child, k + best
            break
        return k, node

    def match(self, tokens, prefer: Callable | None = None) -> tuple[object | None, int]:
        """(a key whose sequence shares the most leading tokens with `tokens`, how many), or
        (None, 0). Among the keys at the matched node, the one with the largest `prefer(key)`
        (default: any one of them, the smallest).

            index.match([1, 2, 3, 9])  # -> (7, 3)
        """
        k, node = self._walk(tokens)
        if k == 0 or not node.keys:
            return None, 0
        return (max(node.keys, key=prefer) if prefer is not None else min(node.keys)), k

    def holders(self, tokens) -> set:
        """The keys whose sequence starts with `tokens` (every key, for no tokens)."""
        parts = chunks(tokens)
        node = self._root
        for c in parts[:-1]:
            node = node.children.get(c)
            if node is None:
                return set()
        if not parts:
            return set(node.keys)
        last = parts[-1]
        out = set()
        for edge, child in node.children.items():
            if edge[:len(last)] == last:
                out |= child.keys
        return out


class Recency:
    """Keys in least-recently-used order, with pin counts (a pinned key is not evictable).

        lru = Recency(); lru.touch("a"); lru.touch("b"); lru.touch("a")
        list(lru)                 # -> ["b", "a"]
        lru.pin("b", +1); lru.oldest_unpinned()   # -> "a"
    """

    def __init__(self):
        self._order: OrderedDict = OrderedDict()  # key -> tick of its last use; LRU first
        self._pins: dict = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator:
        """Keys, least recently used first."""
        return iter(list(self._order))

    def __contains__(self, key) -> bool:
        return key in self._order

    def touch(self, key) -> None:
        """`key` just used: added if new, moved to the most recent end."""
        self._tick += 1
        self._order[key] = self._tick
        self._order.move_to_end(key)

    def last_used(self, key) -> int:
        """A number that grows with each use (for ranking keys by recency)."""
        return self._order[key]

    def remove(self, key) -> None:
        """Forget `key` and its pins."""
        del self._order[key]
        self._pins.pop(key, None)

    def pin(self, key, delta: int) -> None:
        """Add delta (+1 / -1) to key's pin count; pins never go below zero."""
        n = self._pins.get(key, 0) + delta
        if n < 0:
            raise ValueError(f"key {key!r} is unpinned more often than pinned")
        if n:
            self._pins[key] = n
        else:
            self._pins.pop(key, None)

    def pinned(self, key) -> bool:
        return self._pins.get(key, 0) > 0

    def oldest_unpinned(self):
        """The least recently used key with no pin, or None."""
        return next((k for k in self._order if not self.pinned(k)), None)
