"""`PrefixStore`: many cached prefixes, longest-prefix match, extension, LRU eviction, persistence.

    store = tl.PrefixStore(model, max_bytes=256 << 20)
    out = store.generate(system_prompt + question, max_tokens=64)   # == model.generate(...)

A request's prompt is matched against every cached entry through a radix tree
(`radix.RadixIndex`: edges of at most 32 token ids, the match exact to the token); of the
entries holding the matched prefix the most recently used serves it (an entry serves every
shorter prefix of itself). The matched positions are copied out of that entry
(into the new prefix's pages, no model compute: `functional.extend_prefix`), the unmatched
rest of the prompt is prefilled on top of them, the result is inserted as a new entry, and the
request decodes from it. Entries are immutable; eviction is LRU by count and by bytes
(`radix.Recency`), and an entry a running call holds (pins) is never evicted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading

import numpy as np

from . import functional as F
from ..model import cache as kvc
from ..model import page_pool
from . import request as R
from . import validation as check
from .prefix import PrefixCache
from .radix import RadixIndex, Recency
from ..decoding.sampling import SamplingParams


class PrefixStore:
    """Cached prefixes of one model at one depth and window. Thread-safe."""

    def __init__(self, model, max_entries: int | None = None, max_bytes: int | None = None, loops: int | None = None,
                 cache_window: int = 0):
        if max_entries is not None and check.integer(max_entries, "max_entries") < 1:
            raise ValueError(f"max_entries must be >= 1 or None, got {max_entries}")
        if max_bytes is not None and check.integer(max_bytes, "max_bytes") < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.model = model
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.loops = model.config()["default_loops"] if loops is None else check.loops(loops)
        self.cache_window = check.cache_window(cache_window)
        self._index = RadixIndex()  # entry id -> its prompt
        self._lru = Recency()  # entry ids, LRU first, and the pins of running calls
        self._entries: dict[int, PrefixCache] = {}
        self._by_prompt: dict[bytes, int] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._stats = dict(hits=0, misses=0, tokens_reused=0, tokens_prefilled=0, evictions=0)

    # ---- the index ---------------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats, entries=len(self._entries), bytes=self._bytes())

    def entries(self) -> list[PrefixCache]:
        """The cached prefixes, least recently used first."""
        with self._lock:
            return [self._entries[i] for i in self._lru]

    def _bytes(self) -> int:
        """What the entries hold per device (`max_bytes` budgets a device; one device: the total)."""
        return sum(e.nbytes_per_device for e in self._entries.values())

    def _match(self, prompt: np.ndarray) -> tuple[int, int | None]:
        """(matched tokens, id of the most recently used entry that holds them)."""
        i, k = self._index.match(prompt, prefer=self._lru.last_used)
        return k, i

    def _insert(self, entry: PrefixCache) -> int:
        key = entry.prompt.tobytes()
        if key in self._by_prompt:  # an equal entry was inserted meanwhile (another thread)
            return self._by_prompt[key]
        i, self._next_id = self._next_id, self._next_id + 1
        self._entries[i] = entry
        self._by_prompt[key] = i
        self._touch(i)
        self._index.insert(i, entry.prompt)
        return i

    def _remove(self, i: int) -> None:
        entry = self._entries.pop(i)
        del self._by_prompt[entry.prompt.tobytes()]
        self._lru.remove(i)
        self._index.remove(i)

    def _evict(self) -> None:
        def over():
            return ((self.max_entries is not None and len(self._entries) > self.max_entries)
                    or (self.max_bytes is not None and self._bytes() > self.max_bytes))
        for i in self._lru:  # LRU first
            if not over():
                break
            if not self._lru.pinned(i):
                self._remove(i)
                self._stats["evictions"] += 1

    def _touch(self, i: int) -> None:
        self._lru.touch(i)

    def _pin(self, i: int, delta: int) -> None:
        self._lru.pin(i, delta)

    # ---- serving -----------------------------------------------------------------------------

    def lookup(self, prompt) -> tuple[PrefixCache | None, int]:
        """(the entry that would serve `prompt`, how many of its tokens match) — no side effects."""
        prompt = check.tokens(prompt, self.model.config()["vocab_size"])
        with self._lock:
            k, i = self._match(prompt)
            return (self._entries[i] if i is not None else None), k

    def insert(self, entry: PrefixCache) -> None:
        """Add a prefix built elsewhere (the serving engine's prompts) as the most recently used
        entry; an entry of the same prompt already held is kept and touched instead."""
        if not isinstance(entry, PrefixCache):
            raise ValueError(f"insert takes a PrefixCache, got {type(entry).__name__}")
        if (entry.loops, entry.cache_window) != (self.loops, self.cache_window):
            raise ValueError(f"the entry was built at loops={entry.loops}, cache_window={entry.cache_window}; "
                             f"this store holds loops={self.loops}, cache_window={self.cache_window}")
        with self._lock:
            self._touch(self._insert(entry))
            self._evict()

    def touch(self, entry: PrefixCache) -> None:
        """Mark a held entry as just used (LRU); an entry no longer held is ignored."""
        with self._lock:
            i = self._by_prompt.get(entry.prompt.tobytes())
            if i is not None and self._entries[i] is entry:
                self._touch(i)

    def prefix_for(self, prompt) -> PrefixCache:
        """The PrefixCache of exactly `prompt`: reused, extended from the longest cached
        prefix, or built; inserted (most recently used) either way."""
        prefix, i = self._acquire(check.tokens(prompt, self.model.config()["vocab_size"]))
        with self._lock:
            self._pin(i, -1)
            self._evict()
        return prefix

    def _acquire(self, prompt: np.ndarray) -> tuple[PrefixCache, int]:
        """Find or make the entry for `prompt` and pin it (the caller unpins)."""
        with self._lock:
            k, src = self._match(prompt)
            if src is not None:
                k = self._usable(self._entries[src], k, len(prompt))
            if src is not None and k == len(prompt) == len(self._entries[src]):  # exact hit
                self._touch(src)
                self._pin(src, +1)
                self._stats["hits"] += 1
                self._stats["tokens_reused"] += k
                return self._entries[src], src
            source = self._entries[src] if k > 0 else None
            if source is not None:
                self._touch(src)
                self._pin(src, +1)
        try:
            if source is None:
                entry = self.model.build_prefix_cache(prompt, loops=self.loops, cache_window=self.cache_window)
            else:
                entry = F.extend_prefix(source, k, prompt)
        finally:
            if source is not None:
                with self._lock:
                    self._pin(src, -1)
        with self._lock:
            self._stats["hits" if k > 0 else "misses"] += 1
            self._stats["tokens_reused"] += k
            self._stats["tokens_prefilled"] += len(prompt) - k
            i = self._insert(entry)
            self._touch(i)
            self._pin(i, +1)
            return self._entries[i], i

    def _usable(self, entry: PrefixCache, k: int, n_prompt: int) -> int:
        """How many of the k matched positions this entry can hand over: the next-token logits
        are stored only for an entry's last position, so a full-prompt match inside a longer
        entry re-runs its last token; a ring buffer (the window, or a layer's own) must still hold
        the last W of them."""
        if k == n_prompt and len(entry) > k:
            k -= 1
        c = self.model.weights.config
        if k > 0 and (self.cache_window > 0 or entry.cache.rings) and not kvc.holds(
                entry.cache, k, self.cache_window, page_pool.local_window(c, self.cache_window)):
            return 0
        return k

    def generate(self, prompt, max_tokens: int = 32, temperature: float = 0.0, top_k: int = 50, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, stop_sequences=(), seed: int = 0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, logit_bias=None,
                 params: SamplingParams | None = None) -> list[int]:
        """`model.generate(prompt, ...)` at the store's depth and window, prefilling only the part
        of `prompt` that no cached entry holds. params: the sampling knobs as one value (the
        keywords are sugar over it)."""
        # checked before the store is touched: a bad argument inserts nothing
        params = R.params_of(params, dict(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            repetition_penalty=repetition_penalty, stop_sequences=stop_sequences, seed=seed,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias))
        req = R.checked(R.Request(prompt, params, R.Fixed(loops=self.loops), self.cache_window),
                        self.model.weights.config)
        prompt = req.prompt
        prefix, i = self._acquire(prompt)
        try:
            return self.model.generate_from_prefix_cache(prefix, **dataclasses.asdict(req.params))
        finally:
            with self._lock:
                self._pin(i, -1)
                self._evict()

    # ---- persistence -------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Write every entry (orbax prefix checkpoints) and the LRU order to a new folder.
        Atomic: written beside `path`, then renamed."""
        path = os.fspath(path)
        if os.path.exists(path):
            raise ValueError(f"{path!r} already exists; choose a new folder")
        entries = self.entries()  # LRU first: a load touches them in this order
        parent = os.path.dirname(os.path.abspath(path))
        tmp = tempfile.mkdtemp(prefix=".prefix_store-", dir=parent)
        try:
            for n, e in enumerate(entries):
                e.save(os.path.join(tmp, f"entry_{n:05d}"))
            with open(os.path.join(tmp, "store.json"), "w") as f:
                json.dump(dict(format="tinyloop-prefix-store", version=1, loops=self.loops,
                               cache_window=self.cache_window, max_entries=self.max_entries,
                               max_bytes=self.max_bytes, n_entries=len(entries)), f, indent=1)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, path: str, model) -> "PrefixStore":
        """A store saved by `save`, for `model` (entries of another model are refused)."""
        path = os.fspath(path)
        meta_file = os.path.join(path, "store.json")
        if not os.path.isfile(meta_file):
            raise ValueError(f"{path!r} is not a saved PrefixStore (no store.json)")
        with open(meta_file) as f:
            meta = json.load(f)
        if meta.get("format") != "tinyloop-prefix-store":
            raise ValueError(f"{meta_file} is not a PrefixStore record")
        store = cls(model, meta["max_entries"], meta["max_bytes"], meta["loops"], meta["cache_window"])
        for n in range(meta["n_entries"]):
            entry = PrefixCache.load(os.path.join(path, f"entry_{n:05d}"), model)
            if entry.loops != store.loops or entry.cache_window != store.cache_window:
                raise ValueError(f"entry_{n:05d} was built at loops={entry.loops}, window={entry.cache_window}")
            store._insert(entry)
        return store

