"""PrefixStore: longest-prefix reuse (counting prefilled tokens), outputs equal a fresh
generate, LRU eviction by count and bytes, pins, threads, save/load."""

import threading

import numpy as np
import pytest

import tinyloop_jax as tl
from conftest import prompt_of, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("fp32")


def sys_prompt(n, seed):
    return prompt_of(n, seed=100 + seed)


def test_shared_tokens_are_not_prefilled_again(model):
    store = tl.PrefixStore(model, loops=2)
    a = np.concatenate([sys_prompt(40, 0), prompt_of(5, seed=1)])
    b = np.concatenate([sys_prompt(40, 0), prompt_of(7, seed=2)])
    assert a[40] != b[40]
    kw = dict(max_tokens=8)
    assert store.generate(a, **kw) == model.generate(a, loops=2, **kw)
    assert store.stats()["tokens_prefilled"] == 45 and store.stats()["misses"] == 1
    assert store.generate(b, **kw) == model.generate(b, loops=2, **kw)
    s = store.stats()
    assert (s["hits"], s["tokens_reused"], s["tokens_prefilled"]) == (1, 40, 45 + 7)
    # an exact repeat prefills nothing; a shorter prefix of an entry re-runs only its last token
    assert store.generate(b, **kw) == model.generate(b, loops=2, **kw)
    assert store.stats()["tokens_prefilled"] == 52
    short = b[:30]
    assert store.generate(short, **kw) == model.generate(short, loops=2, **kw)
    assert store.stats()["tokens_prefilled"] == 53 and store.stats()["tokens_reused"] == 40 + 47 + 29
    assert len(store) == 3 and store.stats()["bytes"] == sum(e.nbytes for e in store.entries())


def test_match_is_token_exact_across_chunk_boundaries(model):
    store = tl.PrefixStore(model, loops=1)
    base = prompt_of(100, seed=5)
    store.prefix_for(base)
    for k in (1, 31, 32, 33, 64, 70, 99):
        p = base.copy()
        p[k:] = (p[k:] + 1) % 128  # differs from position k on
        entry, matched = store.lookup(p)
        assert matched == k and entry is not None
    other = (base + 1) % 128
    assert store.lookup(other) == (None, 0)


@pytest.mark.parametrize("mode,window", [pytest.param("int8-h", 0, marks=pytest.mark.slow),
                                         pytest.param("int4", 0, marks=pytest.mark.slow), ("fp16", 6), ("fp32", 6)])
def test_extension_equals_fresh_generate_in_modes_and_windows(mode, window):
    model = tiny_model(mode)
    store = tl.PrefixStore(model, loops=2, cache_window=window)
    head = sys_prompt(30, 1)
    for q in range(3):
        p = np.concatenate([head, prompt_of(4 + q, seed=q)])
        assert store.generate(p, max_tokens=6) == model.generate(p, max_tokens=6, loops=2, cache_window=window)
    assert store.stats()["tokens_reused"] >= 2 * 30  # the shared head came from the store both times


def test_lru_eviction_by_count_and_bytes(model):
    store = tl.PrefixStore(model, max_entries=2, loops=1)
    p = [prompt_of(20, seed=s) for s in range(4)]
    store.prefix_for(p[0])
    store.prefix_for(p[1])
    store.prefix_for(p[0])  # touch: p[1] is now least recently used
    store.prefix_for(p[2])
    assert [e.prompt.tolist() for e in store.entries()] == [p[0].tolist(), p[2].tolist()]
    assert store.stats()["evictions"] == 1
    one = store.entries()[0].nbytes
    by_bytes = tl.PrefixStore(model, max_bytes=int(2.5 * one), loops=1)
    for q in p:
        by_bytes.prefix_for(q)
        assert by_bytes.stats()["bytes"] <= 2.5 * one
    assert [e.prompt.tolist() for e in by_bytes.entries()] == [p[2].tolist(), p[3].tolist()]


def test_entry_in_use_is_not_evicted(model):
    store = tl.PrefixStore(model, max_entries=1, loops=1)
    held, i = store._acquire(prompt_of(20, seed=1))  # pinned, as during a running call
    store.prefix_for(prompt_of(20, seed=2))  # over budget: the LRU entry is held, so the next one goes
    assert [e for e in store.entries()] == [held] and store.stats()["evictions"] == 1
    with store._lock:
        store._pin(i, -1)  # the call ends
    store.prefix_for(prompt_of(20, seed=3))
    assert len(store) == 1 and store.entries()[0] is not held and store.stats()["evictions"] == 2


def test_threads_give_serial_outputs(model):
    head = sys_prompt(24, 3)
    prompts = [np.concatenate([head, prompt_of(3 + i % 4, seed=i)]) for i in range(12)]
    serial = [model.generate(p, max_tokens=6, loops=2) for p in prompts]
    store = tl.PrefixStore(model, loops=2, max_entries=4)
    out = [None] * len(prompts)

    def work(j):
        for i in range(j, len(prompts), 3):
            out[i] = store.generate(prompts[i], max_tokens=6)
    threads = [threading.Thread(target=work, args=(j,)) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == serial and len(store) <= 4


def test_save_load_round_trip(model, tmp_path):
    store = tl.PrefixStore(model, max_entries=5, loops=2)
    prompts = [np.concatenate([sys_prompt(20, 4), prompt_of(3, seed=i)]) for i in range(3)]
    for p in prompts:
        store.generate(p, max_tokens=4)
    store.save(tmp_path / "s")
    with pytest.raises(ValueError, match="already exists"):
        store.save(tmp_path / "s")
    back = tl.PrefixStore.load(tmp_path / "s", model)
    assert [e.prompt.tolist() for e in back.entries()] == [e.prompt.tolist() for e in store.entries()]
    assert back.max_entries == 5 and back.loops == 2
    q = np.concatenate([sys_prompt(20, 4), prompt_of(6, seed=9)])
    assert back.generate(q, max_tokens=5) == model.generate(q, max_tokens=5, loops=2)
    assert back.stats()["tokens_reused"] == 20
    with pytest.raises(ValueError, match="not a saved PrefixStore"):
        tl.PrefixStore.load(tmp_path, model)


def test_store_generate_takes_sampling_params():
    """`PrefixStore.generate(params=SamplingParams(...))` equals the keywords."""
    model = tiny_model("fp32")
    store = tl.PrefixStore(model)
    p = prompt_of(30, seed=4)
    assert store.generate(p, params=tl.SamplingParams(max_tokens=5, temperature=0.6, seed=2)) == \
        store.generate(p, max_tokens=5, temperature=0.6, seed=2) == model.generate(p, max_tokens=5, temperature=0.6,
                                                                                      seed=2)
