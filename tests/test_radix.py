"""The radix index and the LRU/pin order as plain data (no model, no JAX): matches are exact to
the token across chunk edges and equal a brute-force longest common prefix; removal forgets a
sequence and only it; recency order and pins decide eviction."""

import numpy as np
import pytest

from tinyloop_jax.api.radix import CHUNK, RadixIndex, Recency, common_length


def test_match_is_exact_to_the_token_across_chunk_edges():
    index = RadixIndex()
    base = list(range(100))
    index.insert("base", base)
    for k in (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 70, 99):
        query = base[:k] + [1000 + t for t in base[k:]]
        assert index.match(query) == ("base", k)
    assert index.match([1000 + t for t in base]) == (None, 0)
    assert index.match(base + [7, 8]) == ("base", 100)  # a longer query matches all of it
    assert index.match(base[:40]) == ("base", 40)  # a shorter one, inside a chunk
    assert index.match([]) == (None, 0)


def test_match_equals_brute_force_longest_common_prefix():
    rng = np.random.default_rng(0)
    heads = [rng.integers(0, 4, int(n)).tolist() for n in rng.integers(0, 80, 6)]
    seqs = {i: heads[i % 6] + rng.integers(0, 4, int(rng.integers(1, 70))).tolist() for i in range(40)}
    index = RadixIndex()
    for i, s in seqs.items():
        index.insert(i, s)
    for _ in range(200):
        q = heads[int(rng.integers(0, 6))] + rng.integers(0, 4, int(rng.integers(0, 90))).tolist()
        best = max(common_length(s, q) for s in seqs.values())
        key, k = index.match(q)
        assert k == best
        if best:
            assert common_length(seqs[key], q) == best
            assert index.holders(q[:k]) == {i for i, s in seqs.items() if common_length(s, q) >= k}


def test_match_prefers_the_highest_ranked_holder():
    index = RadixIndex()
    index.insert(1, [5, 6, 7])
    index.insert(2, [5, 6, 7, 8])
    index.insert(3, [5, 6, 7])  # an equal sequence under another key is its own entry
    assert index.match([5, 6, 7]) == (1, 3)  # default: the smallest key
    assert index.match([5, 6, 7], prefer=lambda k: k) == (3, 3)  # 1 and 3 end at the matched node
    assert index.match([5, 6, 7, 8, 9]) == (2, 4)
    assert index.holders([5, 6]) == {1, 2, 3} and index.holders([]) == {1, 2, 3}
    assert index.holders([5, 6, 7, 8]) == {2} and index.holders([6]) == set()


def test_remove_forgets_one_sequence_only():
    index = RadixIndex()
    long = list(range(3 * CHUNK))
    index.insert("a", long)
    index.insert("b", long[:CHUNK + 5])
    index.insert("c", long[:CHUNK + 5])
    index.remove("a")
    assert index.match(long) == ("b", CHUNK + 5) and len(index) == 2 and "a" not in index
    index.remove("b")
    assert index.match(long) == ("c", CHUNK + 5)
    index.remove("c")
    assert index.match(long) == (None, 0) and len(index) == 0
    index.insert("a", long)  # a key can come back after removal
    assert index.match(long) == ("a", 3 * CHUNK)
    with pytest.raises(ValueError, match="'a' is already"):
        index.insert("a", [1])
    with pytest.raises(ValueError, match="'zz' is not"):
        index.remove("zz")


def test_recency_orders_by_last_use_and_pins_block_eviction():
    lru = Recency()
    for k in "abc":
        lru.touch(k)
    lru.touch("a")
    assert list(lru) == ["b", "c", "a"] and lru.last_used("a") > lru.last_used("c")
    lru.pin("b", +1)
    lru.pin("b", +1)
    assert lru.pinned("b") and lru.oldest_unpinned() == "c"
    lru.pin("b", -1)
    assert lru.pinned("b")  # pins count
    lru.pin("b", -1)
    assert not lru.pinned("b") and lru.oldest_unpinned() == "b"
    with pytest.raises(ValueError, match="unpinned more often"):
        lru.pin("b", -1)
    lru.remove("b")
    assert list(lru) == ["c", "a"] and "b" not in lru and len(lru) == 2
    for k in "ca":
        lru.pin(k, +1)
    assert lru.oldest_unpinned() is None
