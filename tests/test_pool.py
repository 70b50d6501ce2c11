"""The serving engine's bookkeeping without a model (milliseconds): the prefix pool's match equals
a brute-force scan, its refs and LRU choose the slot to reuse; the lane's admission rules and
its prompt-token budget per iteration."""

import collections
from types import SimpleNamespace

import numpy as np
import pytest

from tinyloop_jax.serving.lane import (Lane, Limits, Row, batch_buckets, choose_prefix, compaction, decode_rows,
                                       entry_capacities, entry_capacity, fitted, place, prefill_turns, slot_buckets)
from tinyloop_jax.serving.pool import PrefixPool


def brute_match(slots, prompt, cap):
    """The engine's former linear matcher: per slot min(common prefix, length, cap), the lowest
    slot among the best, (-1, 0) for none."""
    best_g, best_k = -1, 0
    for g, (p, n) in enumerate(slots):
        if p is not None:
            m = min(len(p), len(prompt))
            diff = np.flatnonzero(p[:m] != prompt[:m])
            k = min(int(diff[0]) if diff.size else m, n, cap)
            if k > best_k:
                best_g, best_k = g, k
    return best_g, best_k


def test_match_equals_a_brute_force_scan():
    rng = np.random.default_rng(0)
    heads = [rng.integers(0, 3, int(n)) for n in (0, 5, 33, 64, 70)]
    for trial in range(30):
        pool, held = PrefixPool(6), []
        for g in range(6):
            if rng.random() < 0.2:  # an empty slot
                held.append((None, 0))
                continue
            p = np.concatenate([heads[int(rng.integers(0, 5))], rng.integers(0, 3, int(rng.integers(1, 60)))])
            n = int(rng.integers(1, len(p) + 1))  # a slot may hold fewer positions than its prompt
            pool.hold(g, p, n)
            held.append((p, n))
        for _ in range(20):
            q = np.concatenate([heads[int(rng.integers(0, 5))], rng.integers(0, 3, int(rng.integers(0, 80)))])
            cap = int(rng.integers(0, len(q) + 1))
            assert pool.match(q, cap) == brute_match(held, q, cap), (trial, cap)


def test_a_slot_being_filled_is_not_matched():
    pool = PrefixPool(2)
    a = np.arange(40)
    pool.hold(0, a, 40)
    assert pool.match(a, 39) == (0, 39)
    pool.clear(0)  # its owner row is prefilling a new prompt into it
    assert pool.match(a, 39) == (-1, 0) and pool[0].prompt is None and pool[0].length == 0
    pool.hold(1, a, 20, entry="e")  # a store entry longer than the slot: 20 positions held
    assert pool.match(a, 39) == (1, 20) and pool[1].entry == "e"
    pool.hold(1, a + 1, 40)  # a slot loaded anew forgets what it held
    assert pool.match(a, 39) == (-1, 0) and pool[1].entry is None
    assert pool.match(a + 1, 10) == (1, 10)  # cap: at least one token is left to prefill


def test_refs_and_lru_choose_the_slot_to_reuse():
    pool = PrefixPool(3)
    assert pool.lru_free() == 0  # never used: lowest first
    pool.acquire(0)
    assert pool.lru_free() == 1
    pool.acquire(1)
    pool.acquire(2)
    assert pool.lru_free() is None  # every slot is read
    pool.release(1)
    pool.release(2)
    assert pool.lru_free() == 1  # both free: the least recently used
    pool.acquire(1)
    pool.release(1)
    assert pool.lru_free() == 2
    pool.acquire(0)  # two readers
    pool.release(0)
    assert pool[0].refs == 1
    with pytest.raises(ValueError, match="slot 2 is released more often"):
        pool.release(2)
    pool.hold(0, np.arange(5), 5)
    pool.reset()
    assert all(s.refs == 0 and s.prompt is None for s in pool.slots) and pool.match(np.arange(5), 4) == (-1, 0)


LIMITS = Limits.of(max_batch=6, prefill_chunk=64, prefix_slots=2, context=512, prefix_capacity=None,
                   row_capacity=64, prefix_cache=True)


class Entry(SimpleNamespace):
    """A store entry as admission sees it: a prompt and a length."""

    def __init__(self, prompt):
        super().__init__(prompt=prompt)

    def __len__(self):
        return len(self.prompt)


def lane(rows=(), size=0, cap=0, slots=2):
    return Lane(3, store=None, exit=None, pool=PrefixPool(slots), state=None, size=size, cap=cap,
                rows={r.index: r for r in rows})


def row(i, prompt_len=10, fed=0, need=10, group=-1, limit=0, decoding=False, tokens=0, max_tokens=64, ahead=0):
    h = SimpleNamespace(prompt=np.zeros(prompt_len, np.int32), tokens=[0] * tokens,
                        params=SimpleNamespace(max_tokens=max_tokens))
    return Row(h, i, group, limit, fed, need, decoding=decoding, ahead=ahead)


def test_limits_and_buckets():
    assert (LIMITS.chunk, LIMITS.long_rest, LIMITS.prefix_capacity, LIMITS.row_capacity,
            LIMITS.max_capacity) == (64, 32, 512, 64, 512)
    assert LIMITS.chunk_sizes == [16, 32, 64]
    assert batch_buckets(16) == [1, 2, 4, 8, 16] and batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(1) == [1]
    assert [slot_buckets(8, n) for n in (1, 2, 3, 8)] == [1, 2, 8, 8]
    assert slot_buckets(4, 2) == 4  # a copy of half the pool costs more than reading it in place
    assert [entry_capacity(n) for n in (1, 16, 17, 100, 129, 300)] == [16, 16, 32, 128, 256, 384]  # cache.bucket
    assert entry_capacities(512) == [16, 32, 64, 128, 256, 384, 512]


def test_prefill_budget_is_one_chunk_of_padded_tokens_per_iteration():
    """Short prompt rests share an iteration; a long prompt takes one chunk per iteration and
    never more than the budget's worth (a padded chunk may overrun what is left of it)."""
    rows = [row(0, prompt_len=5), row(1, prompt_len=20, fed=10), row(2, prompt_len=7), row(3, prompt_len=200)]
    order = collections.deque(rows)
    iterations = []
    while order:
        turns = []
        for r, n in prefill_turns(order, LIMITS.chunk):
            turns.append((r.index, n))
            r.fed += n  # what the engine does with a chunk
            if r.fed == len(r.handle.prompt):
                order.popleft()
        iterations.append(turns)
    # 16 + 16 + 16 padded, then the long prompt's first chunk (64) overruns the rest of the budget
    assert iterations == [[(0, 5), (1, 10), (2, 7), (3, 64)], [(3, 64)], [(3, 64)], [(3, 8)]]
    # the budget counts padded tokens: five 5-token rests run 16-token programs, four fit
    short = collections.deque(row(i, prompt_len=5) for i in range(5))
    assert [(r.index, n) for r, n in take_turns(short)] == [(0, 5), (1, 5), (2, 5), (3, 5)]


def take_turns(order):
    out = []
    for r, n in prefill_turns(order, LIMITS.chunk):
        out.append((r, n))
        order.popleft()
    return out


def test_choose_prefix_prefers_the_pool_unless_the_store_holds_a_chunk_more():
    entry = object()
    assert choose_prefix((1, 30), (entry, 50), cap=100, chunk=16) == (-1, 50, entry)  # 20 more than a chunk
    assert choose_prefix((1, 30), (entry, 40), cap=100, chunk=16) == (1, 30, None)
    assert choose_prefix((-1, 0), (entry, 5), cap=100, chunk=16) == (-1, 5, entry)  # nothing pooled
    assert choose_prefix((-1, 0), (entry, 50), cap=20, chunk=16) == (-1, 20, entry)  # capped
    assert choose_prefix((0, 12), (None, 0), cap=20, chunk=16) == (0, 12, None)


def test_place_grows_the_batch_and_pools_long_prompts():
    # a short prompt on an empty lane: one row of row_capacity, no slot
    p = place(LIMITS, lane(), n=10, max_tokens=5, group=-1, limit=0, source=None)
    assert (p.group, p.owner, p.load, p.need, p.size, p.cap) == (-1, False, None, 15, 1, 64)
    # a full batch of 4 rows grows to the next bucket (6); a row needing more than row_capacity
    # moves the batch to the whole context
    full = lane([row(i) for i in range(4)], size=4, cap=64)
    p = place(LIMITS, full, n=30, max_tokens=40, group=-1, limit=0, source=None)
    assert (p.size, p.cap, p.need) == (6, 512, 70)
    # a long rest goes into the least recently used free slot, loaded with its cached prefix
    ln = lane([row(0, group=0)], size=1, cap=64)
    ln.pool.acquire(0)
    entry = Entry(np.arange(50))
    p = place(LIMITS, ln, n=100, max_tokens=5, group=-1, limit=50, source=entry)
    assert (p.group, p.limit, p.owner, p.load, p.need) == (1, 50, True, (1, entry, 50), 5)
    # ... from a pooled prefix (a slot-to-slot copy) ...
    p = place(LIMITS, ln, n=100, max_tokens=5, group=0, limit=40, source=None)
    assert (p.group, p.owner, p.load) == (1, True, (1, 0, 40))
    # ... and with no slot free it waits, unless its rest fits a row
    ln.pool.acquire(1)
    assert place(LIMITS, ln, n=100, max_tokens=5, group=0, limit=40, source=None) is None
    p = place(LIMITS, ln, n=70, max_tokens=5, group=0, limit=40, source=None)
    assert (p.group, p.limit, p.owner, p.load, p.need) == (0, 40, False, None, 35)
    # a cached prefix with a short rest is pooled for others to share
    ln.pool.release(1)
    p = place(LIMITS, ln, n=60, max_tokens=5, group=-1, limit=50, source=entry)
    assert (p.group, p.limit, p.load, p.shares, p.need) == (1, 50, (1, entry, 50), True, 15)


def test_no_prefix_cache_prefills_whole_prompts():
    lim = Limits.of(6, 64, 2, 512, None, 64, prefix_cache=False)
    p = place(lim, lane(), n=100, max_tokens=5, group=-1, limit=0, source=None)
    assert (p.group, p.owner, p.load, p.need, p.cap) == (-1, False, None, 105, 512)


def test_fitted_shrinks_once_no_row_needs_the_context():
    wide = lane([row(0, need=100), row(1, need=20)], size=2, cap=512)
    assert fitted(LIMITS, wide) == (2, 512)
    del wide.rows[0]
    assert fitted(LIMITS, wide) == (1, 64)  # the context no more, and one row's bucket
    assert fitted(LIMITS, lane([row(1, need=20)], size=2, cap=64)) == (1, 64)
    assert fitted(LIMITS, lane(size=2, cap=512)) == (0, 0)  # no rows: released


def test_fitted_shrinks_to_the_rows_bucket_and_compaction_moves_them_to_the_front():
    rows = lane([row(i) for i in (0, 3, 4, 5, 7)], size=8, cap=64)
    assert fitted(LIMITS, rows) == (6, 64)  # buckets of 8 rows max: 1, 2, 4, 6
    for i in (0, 4, 7):
        del rows.rows[i]
    assert fitted(LIMITS, rows) == (2, 64)
    assert compaction(rows.rows, 4) == [3, 5, -1, -1] and compaction(rows.rows, 2) == [3, 5]


def test_a_store_hit_without_a_free_slot_counts_what_is_recomputed():
    ln = lane([row(0, group=0), row(1, group=1)], size=2, cap=64)
    ln.pool.acquire(0)
    ln.pool.acquire(1)
    entry = Entry(np.arange(50))
    p = place(LIMITS, ln, n=60, max_tokens=5, group=-1, limit=50, source=entry)  # short rest, no slot
    assert (p.group, p.limit, p.load, p.recomputed, p.need) == (-1, 0, None, 50, 65)
    p = place(LIMITS, ln, n=100, max_tokens=5, group=-1, limit=50, source=entry)  # long rest fitting a row
    assert (p.group, p.limit, p.owner, p.recomputed) == (-1, 0, False, 50)
    ln.pool.release(1)
    assert place(LIMITS, ln, n=60, max_tokens=5, group=-1, limit=50, source=entry).recomputed == 0


def test_decode_rows_read_a_copy_of_few_slots_or_the_whole_pool():
    rows = [row(0, group=5, limit=30, decoding=True, tokens=3), row(1, group=2, limit=12, decoding=True, tokens=1),
            row(2, decoding=True, tokens=7), row(3, group=6)]  # row 3 still prefilling
    d = decode_rows({r.index: r for r in rows}, size=4, slots=8)
    assert d.slot_ids.tolist() == [2, 5]  # two distinct slots of 8: a copy of them
    assert d.group.tolist() == [1, 0, -1, 0] and d.limit.tolist() == [30, 12, 0, 0]
    assert d.active.tolist() == [True, True, True, False] and d.steps.tolist() == [3, 1, 7, 0]
    rows.append(row(4, group=7, limit=3, decoding=True))
    d = decode_rows({r.index: r for r in rows}, size=8, slots=8)
    assert d.slot_ids.tolist() == list(range(8)) and d.group.tolist()[:5] == [5, 2, -1, 0, 7]  # all, in place
    idle = decode_rows({}, size=2, slots=8)
    assert idle.slot_ids.tolist() == [0] and not idle.active.any()


def test_decode_rows_count_the_tokens_still_in_flight():
    """A step dispatched before the last one was read: a row's unread token counts (its key
    index moves on), and a row that token takes to max_tokens sits the step out."""
    rows = [row(0, decoding=True, tokens=3, ahead=1), row(1, decoding=True, tokens=4, max_tokens=5, ahead=1),
            row(2, decoding=True, tokens=4, max_tokens=5)]
    d = decode_rows({r.index: r for r in rows}, size=4, slots=8)
    assert d.active.tolist() == [True, False, True, False] and d.steps.tolist()[:3] == [4, 0, 4]
