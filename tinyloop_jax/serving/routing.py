"""Which engine replica serves a request (issue 61): the policies a router in front of several
engines picks by, as plain data — no Ray, no JAX; the Ray Serve request router calls them.

A replica caches what it served, in full pages of token ids (the engine's prefix index shares
whole pages, token-exact). So a request is routed by the chained hashes of its rendered
prompt's full pages (`page_chain`: hash i covers the first i + 1 pages), against what this
router sent each replica, kept per replica in LRU order up to the pages its pool holds:

    prefix        the replica holding the longest leading run of the request's page hashes,
                  among those whose load is within `imbalance` of the least loaded (a hot
                  prefix spreads once its replica falls behind); no match: the least loaded
    round_robin   in turn
    power_of_two  the less loaded of two drawn at random (Ray Serve's default)
    oracle        a consistent hash (rendezvous) of the prompt's first `ORACLE_PAGES` pages:
                  every request of one system prompt on one replica, whatever the load

The router learns only from its own decisions (`routed`); a replica that restarts empty is
`forget`-ten. Ray's own `PrefixCacheAffinityRouter` matches prompt text by characters, not the
engines' pages of token ids (docs/engine-plan.md, issue 61).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Hashable, Sequence

import numpy as np

from ..model.page_pool import PAGE_SIZE

POLICIES = ("prefix", "round_robin", "power_of_two", "oracle")
ORACLE_PAGES = 8  # the oracle's key: the first 128 tokens at 16 a page (a system prompt's start)


def page_chain(tokens: Sequence[int], page_size: int = PAGE_SIZE) -> list[int]:
    """Chained 64-bit hashes of the full pages of `tokens` (the same in every process)."""
    ids = np.asarray(tokens, np.int32)
    out, h = [], b""
    for i in range(len(ids) // page_size):
        h = hashlib.blake2b(h + ids[i * page_size:(i + 1) * page_size].tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return out


class Router:
    """One policy's choices over a changing set of replicas (any hashable ids).

    `rank(chain, loads)` -> the replicas, most preferred first (loads: each candidate's queue);
    `routed(replica, chain)` after a request was sent; `forget(replica)` when it died."""

    def __init__(self, policy: str = "prefix", capacity_pages: int = 4096, imbalance: int = 4, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if capacity_pages < 1 or imbalance < 0:
            raise ValueError(f"capacity_pages must be >= 1 and imbalance >= 0, got {capacity_pages}, {imbalance}")
        self.policy, self.capacity, self.imbalance = policy, capacity_pages, imbalance
        self.cached: dict[Hashable, OrderedDict] = {}  # replica -> its page hashes, least recent first
        self.turn = 0
        self.rng = random.Random(seed)

    def match(self, replica: Hashable, chain: list[int]) -> int:
        """Leading pages of `chain` this router sent `replica` (and it has not evicted)."""
        have, n = self.cached.get(replica, {}), 0
        while n < len(chain) and chain[n] in have:
            n += 1
        return n

    def rank(self, chain: list[int], loads: dict) -> list:
        """The candidates of `loads` (replica -> requests queued or running), best first."""
        if not loads:
            raise ValueError("no replica to route to")
        ids = sorted(loads, key=str)  # (a stable order: ties go the same way in every process)
        by_load = sorted(ids, key=lambda r: loads[r])
        if self.policy == "round_robin":
            self.turn += 1
            return ids[self.turn % len(ids):] + ids[:self.turn % len(ids)]
        if self.policy == "power_of_two":
            two = sorted(self.rng.sample(ids, min(2, len(ids))), key=lambda r: loads[r])
            return two + [r for r in by_load if r not in two]
        if self.policy == "oracle":
            key = chain[min(len(chain), ORACLE_PAGES) - 1] if chain else 0
            return sorted(ids, key=lambda r: _score(key, r), reverse=True)
        least = loads[by_load[0]]
        near = [r for r in by_load if loads[r] <= least + self.imbalance]
        best = sorted(near, key=lambda r: (-self.match(r, chain), loads[r]))  # (stable: least loaded first on ties)
        return best + [r for r in by_load if r not in near]

    def routed(self, replica: Hashable, chain: list[int]) -> None:
        """`replica` now caches `chain`'s pages, the most recent; past capacity the least recent
        go, a chain's last pages before its first (as the engine's index drops leaves first)."""
        have = self.cached.setdefault(replica, OrderedDict())
        for h in reversed(chain):
            have[h] = None
            have.move_to_end(h)
        while len(have) > self.capacity:
            have.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        self.cached.pop(replica, None)


def _score(key: int, replica: Hashable) -> int:
    """Rendezvous hashing: each replica's score for a key; the highest wins (a replica that
    leaves moves only its own keys)."""
    return int.from_bytes(hashlib.blake2b(f"{key}:{replica}".encode(), digest_size=8).digest(), "little")
