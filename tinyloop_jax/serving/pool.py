"""`PrefixPool`: the host's record of a lane's G pool slots (plain data, no JAX).

The device holds the slots' K/V (`programs.BatchState.pool`, G x Cp positions); this record says
what each slot holds and who reads it, so admission can match a prompt against the pooled
prefixes and pick a slot to reuse:

    pool = PrefixPool(2)
    pool.hold(0, prompt_a, len(prompt_a))      # slot 0 now holds prompt_a
    pool.match(prompt_b, cap=len(prompt_b) - 1)  # -> (0, k): slot 0 serves b's first k tokens
    pool.acquire(0); ...; pool.release(0)       # a row reads slot 0 meanwhile
    pool.lru_free()                             # -> the least recently used slot no row reads

A slot being filled by its owner row (a long prompt prefilled into it) holds no prompt until its
last chunk is in: no one else matches it meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..api.radix import RadixIndex


@dataclass
class Slot:
    """One pool slot's record."""

    prompt: np.ndarray | None = None  # the tokens it holds (None: empty, or being filled)
    length: int = 0  # positions held: prompt[:length]
    refs: int = 0  # rows reading it
    used: int = 0  # tick of its last acquire (0: never)
    entry: object = None  # the store entry it holds (touched when the slot is used), if any


class PrefixPool:
    """G slots, matched through a radix index of what they hold."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"a pool needs >= 1 slots, got {slots}")
        self.slots = [Slot() for _ in range(slots)]
        self._index = RadixIndex()  # slot -> prompt[:length], for the slots that hold a prompt
        self._tick = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, g: int) -> Slot:
        return self.slots[g]

    def match(self, prompt, cap: int) -> tuple[int, int]:
        """(slot, k): the slot sharing the most leading tokens with `prompt`, at most `cap` of
        them (the lowest slot among those sharing k), or (-1, 0)."""
        _, k = self._index.match(prompt)
        k = min(k, cap)
        if k <= 0:
            return -1, 0
        return min(self._index.holders(prompt[:k])), k

    def hold(self, g: int, prompt: np.ndarray, length: int, entry=None) -> None:
        """Slot g now holds prompt[:length] (from `entry`, a store entry, if given): others may
        share it."""
        self.clear(g)
        s = self.slots[g]
        s.prompt, s.length, s.entry = prompt, int(length), entry
        self._index.insert(g, prompt[:length])

    def clear(self, g: int) -> None:
        """Slot g holds nothing shareable (emptied, or being loaded or filled); its readers stay."""
        if g in self._index:
            self._index.remove(g)
        s = self.slots[g]
        s.prompt, s.length, s.entry = None, 0, None

    def acquire(self, g: int) -> Slot:
        """A row starts reading slot g (its most recent use)."""
        self._tick += 1
        s = self.slots[g]
        s.refs += 1
        s.used = self._tick
        return s

    def release(self, g: int) -> None:
        """A row stops reading slot g."""
        s = self.slots[g]
        if s.refs < 1:
            raise ValueError(f"slot {g} is released more often than acquired")
        s.refs -= 1

    def lru_free(self) -> int | None:
        """The least recently used slot no row reads (lowest first among never used), or None."""
        free = [g for g, s in enumerate(self.slots) if s.refs == 0]
        return min(free, key=lambda g: self.slots[g].used) if free else None

    def reset(self) -> None:
        """Every slot empty and unread (the device pool was lost)."""
        for g in range(len(self.slots)):
            self.clear(g)
            self.slots[g].refs = 0
