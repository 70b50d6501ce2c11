"""The serving engine cannot be knocked over: bounded depths and memory, a `stats()` that other
threads may call at any time, a failed device step that fails its rows only, one bucketing rule
for store entries (no compile after warmup), a batch that shrinks as rows leave, and bad values
refused at `submit` with errors that name them."""

import gc
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import tiny_config, tiny_model

import tinyloop_jax as tl
from tinyloop_jax.serving import MemoryBudgetError
from tinyloop_jax.serving import programs as P

ENGINE = dict(max_batch=4, prefill_chunk=16, prefix_slots=2)  # the shapes of test_serving: shared programs


@pytest.fixture(scope="module")
def model():
    return tiny_model("fp32")


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def lane_need(model, loops: int, row_capacity: int) -> int:
    """A lane's least footprint, from the model's own cache arithmetic (not the engine's): its
    pool (2 slots of the context) and one row (its segment, seen and counts)."""
    c = model.config()
    return (model.cache_nbytes(2 * c["max_seq_len"], loops) + model.cache_nbytes(row_capacity, loops)
            + 5 * c["vocab_size"])


# ---- bad values ------------------------------------------------------------------------------

def test_depth_and_length_limits_are_value_errors(model):
    with tl.Engine(model, **ENGINE, max_loops=8) as eng:
        assert eng.max_loops == 8
        for bad, match in [(dict(loops=9), "loops=9.*max_loops=8"), (dict(loops=10**9), "1000000000"),
                           (dict(max_tokens=10**12), "1000000000000"), (dict(max_tokens=2**31), "2147483648")]:
            with pytest.raises(ValueError, match=match):
                eng.submit([1, 2, 3], **bad)
        assert eng.stats().get("requests", 0) == 0  # nothing was queued
        assert eng.generate([1, 2, 3], max_tokens=3, loops=8) == model.generate([1, 2, 3], max_tokens=3, loops=8)
    with pytest.raises(ValueError, match="1000000000000"):
        model.generate([1, 2, 3], max_tokens=10**12)
    with tl.Engine(model, **ENGINE) as eng:  # the default bound: 64, or 16 x the default depth
        assert eng.max_loops == max(64, 16 * model.config()["default_loops"])


def test_a_lane_that_cannot_fit_the_budget_is_refused_at_submit(model):
    need = lane_need(model, 3, 128)
    with tl.Engine(model, **ENGINE, memory_budget=need // 2) as eng:
        with pytest.raises(MemoryBudgetError, match="memory_budget"):
            eng.submit([1, 2, 3], max_tokens=3)
        assert isinstance(MemoryBudgetError("x"), RuntimeError)
        assert eng.stats().get("requests", 0) == 0


# ---- memory: lanes within one budget -----------------------------------------------------------

def sweep(eng, model, depths, results, errors):
    for loops in depths:
        p = [1 + loops, 2, 3, 4, 5]
        try:
            results[loops] = (eng.generate(p, max_tokens=3, loops=loops), model.generate(p, max_tokens=3, loops=loops))
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)


def test_a_depth_sweep_stays_within_the_memory_budget(model):
    """Lanes are made per depth and evicted (least recently used, idle) to stay within one budget
    shared by every lane's pool, rows and store; the engine's count agrees with the live arrays."""
    budget = int(2.5 * lane_need(model, 6, 128))  # two deep lanes, or a few shallow ones
    base = live_bytes()
    with tl.Engine(model, **ENGINE, memory_budget=budget) as eng:
        results, errors, peak = {}, [], []
        done = threading.Event()

        def watch():
            while not done.is_set():
                peak.append(eng.stats()["memory_bytes"])

        t = threading.Thread(target=watch)
        t.start()
        sweep(eng, model, [3, 4, 5, 6], results, errors)
        done.set()
        t.join()
        assert not errors, errors
        for got, want in results.values():
            assert got == want
        s = eng.stats()
        assert s["lanes_evicted"] >= 1 and s["lanes"] < 4
        assert max(peak) <= budget and s["memory_budget"] == budget
        assert live_bytes() - base <= budget  # the arrays really were freed


class SlowDict(dict):
    """A dict whose iteration pauses at every item: a thread iterating it while another adds to
    it fails at once (instead of once in a blue moon)."""

    def __iter__(self):
        for k in super().__iter__():  # live: raises if the dict changes meanwhile
            time.sleep(1e-3)
            yield k

    def values(self):
        return (self[k] for k in self)

    def items(self):
        return ((k, self[k]) for k in self)


def test_stats_is_safe_while_new_depths_arrive(model):
    """/metrics calls stats() from other threads while the loop thread adds lanes, rows and
    programs: hammered from 8 threads, it never raises (a reader iterating the lanes would be
    paused mid-way by SlowDict, and fail)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        with tl.Engine(model, **ENGINE) as eng:
            eng.scheduler.lanes = SlowDict()  # a reader that iterates the lanes is paused mid-way
            results, errors, done = {}, [], threading.Event()

            def hammer():
                while not done.is_set():
                    try:
                        s = eng.stats()
                        assert s["running"] >= 0 and s["lanes"] >= 0
                        len(eng.programs)
                    except Exception as e:  # noqa: BLE001 - reported by the test
                        errors.append(e)
                        return

            threads = [threading.Thread(target=hammer) for _ in range(8)]
            for t in threads:
                t.start()
            clients = [threading.Thread(target=sweep, args=(eng, model, range(k, 7, 3), results, errors))
                       for k in (1, 2, 3)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            done.set()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    for got, want in results.values():
        assert got == want


# ---- a failed step -----------------------------------------------------------------------------

@pytest.mark.parametrize("program", ["decode_step", "prefill_chunk", "prefill_slot", "load_slot"])
def test_a_step_failing_after_dispatch_fails_its_rows_only(model, monkeypatch, program):
    """The program runs (its donated buffers are gone), then raises: the rows it served fail, the
    lane's buffers are rebuilt (the pool too), and the next requests equal `generate`."""
    real, fired = getattr(P, program), []

    def once(*a, **kw):
        out = real(*a, **kw)
        if not fired:
            fired.append(True)
            raise RuntimeError("injected failure")
        return out

    rng = np.random.default_rng(7)
    # long prompts go into pool slots (load_slot, prefill_slot), short ones into their rows (prefill_chunk)
    prompts = [rng.integers(0, 128, 40), rng.integers(0, 128, 12), rng.integers(0, 128, 40)]
    with tl.Engine(model, **ENGINE) as eng:
        monkeypatch.setattr(P, program, once)
        first = [eng.submit(p, max_tokens=4) for p in prompts]
        outcomes = []
        for h in first:
            try:
                outcomes.append(h.result(timeout=120))
            except RuntimeError as e:
                outcomes.append(e)
        assert fired and any(isinstance(o, RuntimeError) and "injected" in str(o) for o in outcomes)
        for p, o in zip(prompts, outcomes):
            if not isinstance(o, Exception):
                assert o == model.generate(p, max_tokens=4)
        after = prompts + [rng.integers(0, 128, 12), rng.integers(0, 128, 40)]
        handles = [eng.submit(p, max_tokens=5) for p in after]
        for p, h in zip(after, handles):
            assert h.result(timeout=120) == model.generate(p, max_tokens=5)
        assert eng.stats()["step_failures"] >= 1


# ---- programs ----------------------------------------------------------------------------------

def test_a_user_store_with_unbucketed_entries_compiles_nothing_after_warmup():
    """A PrefixStore's entries take `cache.bucket` capacities (384 for a 300-token prompt, not a
    power of two); warmup covers them, so serving that store compiles nothing."""
    model = tl.Model.random(tiny_config(max_seq_len=512), seed=1)
    rng = np.random.default_rng(4)
    system = rng.integers(0, 128, 300)
    store = tl.PrefixStore(model)
    entry = store.prefix_for(system)
    assert entry.cache.capacity == 384
    with tl.Engine(model, max_batch=2, prefill_chunk=16, prefix_slots=2, store=store) as eng:
        assert eng.warmup() > 0
        for q in range(3):
            p = np.concatenate([system, rng.integers(0, 128, 3 + q)])
            h = eng.submit(p, max_tokens=4)
            assert h.result() == model.generate(p, max_tokens=4)
            assert h.prefix_tokens == 300
        assert eng.stats()["compiles_after_warmup"] == 0, eng.programs


def test_the_batch_shrinks_to_its_rows_bucket(model):
    """Rows leave: the batch moves to the smallest bucket holding the rows left (the others keep
    their tokens), so one long request does not keep decoding a 4-row batch."""
    rng = np.random.default_rng(5)
    work = [(rng.integers(0, 128, 6), dict(max_tokens=40))] + [(rng.integers(0, 128, 6), dict(max_tokens=2))
                                                             for _ in range(3)]
    with tl.Engine(model, **ENGINE) as eng:
        handles = [eng.submit(p, **kw) for p, kw in work]
        for (p, kw), h in zip(work, handles):
            assert h.result() == model.generate(p, **kw)
        shrunk = {(k[2], k[4]) for k in eng.programs if k[0] == "reshape" and k[4] < k[2]}
        assert shrunk, eng.programs
        assert any(k[0] == "decode" and k[2] == 1 for k in eng.programs)


def test_a_store_hit_without_a_free_slot_is_counted(model):
    """A prompt the store holds, arriving while every pool slot is read by a running row, is
    prefilled again (no wait): the tokens recomputed are counted, never silent."""
    rng = np.random.default_rng(6)
    a, b = rng.integers(0, 128, 40), rng.integers(0, 128, 40)
    with tl.Engine(model, **dict(ENGINE, prefix_slots=1)) as eng:
        assert eng.generate(a, max_tokens=2) == model.generate(a, max_tokens=2)  # a: in slot 0 and the store
        long = eng.submit(b, max_tokens=60)  # b: takes slot 0 and holds it
        next(iter(long.stream()))
        q = np.concatenate([a, [1, 2, 3]])
        h = eng.submit(q, max_tokens=3)
        assert h.result() == model.generate(q, max_tokens=3)
        s = eng.stats()
        assert not long.done and h.prefix_tokens == 0
        assert s["requests_prefix_no_slot"] == 1 and s["prefix_tokens_recomputed"] == 40
        long.cancel()


# ---- counters ----------------------------------------------------------------------------------

def test_prefix_cache_and_pass_counters_per_depth(model):
    """In tokens, per depth, as vLLM counts them: every prompt token is a prefix-cache query, each
    one served from a cached prefix a hit; every position run is a token computed, at `loops`
    passes each (a request's first token comes from its prompt's last position)."""
    rng = np.random.default_rng(8)
    system = rng.integers(0, 128, 40)
    a, b = np.concatenate([system, [1, 2]]), np.concatenate([system, [3, 4, 5]])
    with tl.Engine(model, **ENGINE) as eng:
        ha = eng.submit(a, max_tokens=4)
        ha.result()
        hb = eng.submit(b, max_tokens=3)
        hb.result()
        hc = eng.submit(b[:10], max_tokens=2, loops=2)
        hc.result()
        s = eng.stats()
    assert hb.prefix_tokens == 40 and ha.prefix_tokens == hc.prefix_tokens == 0  # b reads a's pooled system prompt
    d3, d2 = s["depths"][3], s["depths"][2]
    assert (d3["prefix_cache_queries"], d3["prefix_cache_hits"]) == (42 + 43, 40)
    assert d3["tokens_computed"] == (42 + 3) + (43 - 40 + 2) and d3["passes"] == 3 * d3["tokens_computed"]
    assert (d2["prefix_cache_queries"], d2["prefix_cache_hits"], d2["tokens_computed"]) == (10, 0, 10 + 1)
    assert s["prefix_cache_queries"] == 95 and s["prefix_cache_hits"] == 40
    assert s["passes_per_token"] == (3 * d3["tokens_computed"] + 2 * d2["tokens_computed"]) / (
        d3["tokens_computed"] + d2["tokens_computed"])
