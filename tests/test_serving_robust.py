"""The serving engine cannot be knocked over: bounded depths and memory (a request that finds no
free page waits, one that can never fit is refused), a `stats()` that other threads may call at
any time, a failed device step that fails its rows only, store entries loaded into pages with
nothing compiled after warmup, decode steps sized to the rows, and bad values refused at
`submit` with errors that name them."""

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
from tinyloop_jax.serving.plan import chunk_buckets
from tinyloop_jax.decoding.sampling import MAX_LOGIT_BIAS
from tinyloop_jax.decoding import compiled
from tinyloop_jax.serving.step import STOPS

ENGINE = dict(max_batch=4, prefill_chunk=16)  # the shapes of test_serving: shared programs
P = 16  # tokens per page


@pytest.fixture(scope="module")
def model():
    return tiny_model("fp32")


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def page_bytes(model, loops: int) -> int:
    """One page's bytes from the model's own cache arithmetic (not the engine's): P positions of
    every cache layer."""
    return model.cache_nbytes(P, loops) - 4 * P - 4  # less the dense segment's position record


def rows_bytes(model, rows: int = 4) -> int:
    """Request rows: seen (bool) and counts (int32) per token, the last token, the knobs (the
    logit bias's (id, value) pairs, the stop sequences at the engine's fixed S x L and a few
    scalars), the exit rule, the last loop state, the last L tokens emitted."""
    c = model.config()
    S, L = STOPS
    stops = 4 * (S * L + S) - 8 + 4 * L  # (the 64 bytes of scalars held a 1 x 1 stop spec before)
    return rows * (5 * c["vocab_size"] + 4 + 8 * MAX_LOGIT_BIAS + 64 + 24 + 4 * c["d_model"] + stops)


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


def test_a_request_whose_pages_cannot_fit_the_budget_is_refused_at_submit(model):
    budget = rows_bytes(model) + 2 * page_bytes(model, 3)  # the request rows and two pages
    with tl.Engine(model, **ENGINE, memory_budget=budget) as eng:
        with pytest.raises(MemoryBudgetError, match="memory_budget"):
            eng.submit(list(range(1, 30)), max_tokens=8)  # 37 positions: three pages
        assert eng.generate([1, 2, 3], max_tokens=3) == model.generate([1, 2, 3], max_tokens=3)  # one page fits
        assert isinstance(MemoryBudgetError("x"), RuntimeError)
        assert eng.stats()["requests"] == 1


def test_a_request_without_free_pages_waits_then_runs(model):
    """A pool of 6 pages: a request holding 4 of them leaves 2; the next needs 3, waits in the
    queue (never an out-of-memory), and runs once the first is done; pages cached by the first
    are evicted for it."""
    budget = rows_bytes(model) + 6 * page_bytes(model, 3)
    rng = np.random.default_rng(9)
    a, b = rng.integers(0, 128, 50), rng.integers(0, 128, 30)
    with tl.Engine(model, **ENGINE, memory_budget=budget) as eng:
        ha = eng.submit(a, max_tokens=12)  # 62 positions: 4 pages
        hb = eng.submit(b, max_tokens=12)  # 42 positions: 3 pages
        assert ha.result() == model.generate(a, max_tokens=12)
        assert hb.result() == model.generate(b, max_tokens=12)
        s = eng.stats()
        assert s["pages"][3]["total"] == 6 and s["memory_waits"] >= 1
        assert hb.first_token_at > ha.finished_at - 1e-3  # b started after a left


# ---- memory: lanes within one budget -----------------------------------------------------------

def sweep(eng, model, depths, results, errors):
    for loops in depths:
        p = [1 + loops, 2, 3, 4, 5]
        try:
            results[loops] = (eng.generate(p, max_tokens=3, loops=loops), model.generate(p, max_tokens=3, loops=loops))
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)


def test_a_depth_sweep_stays_within_the_memory_budget(model):
    """Depths are made and evicted (least recently used, idle) to stay within one budget shared
    by every depth's pool, rows and store; the engine's count agrees with the live arrays."""
    budget = rows_bytes(model) + 8 * page_bytes(model, 6)  # a pool of 8 deep pages, or more shallow ones
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
        assert s["depths_evicted"] >= 1 and s["depths_held"] < 4
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
    """/metrics calls stats() from other threads while the loop thread adds depths, rows and
    programs (4 depths from 2 clients): hammered from 8 threads, it never raises (a reader
    iterating the depths would be paused mid-way by SlowDict, and fail)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        with tl.Engine(model, **ENGINE) as eng:
            eng.batcher.depths = SlowDict()  # a reader that iterates the depths is paused mid-way
            results, errors, done = {}, [], threading.Event()

            def hammer():
                while not done.is_set():
                    try:
                        s = eng.stats()
                        assert s["running"] >= 0 and s["depths_held"] >= 0
                        len(eng.programs)
                    except Exception as e:  # noqa: BLE001 - reported by the test
                        errors.append(e)
                        return

            threads = [threading.Thread(target=hammer) for _ in range(8)]
            for t in threads:
                t.start()
            clients = [threading.Thread(target=sweep, args=(eng, model, range(k, 5, 2), results, errors))
                       for k in (1, 2)]
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

@pytest.mark.parametrize("program", ["step", "admit", "load_segment"])
def test_a_step_failing_after_dispatch_fails_its_rows_only(model, monkeypatch, program):
    """The program runs (its donated buffers are gone), then raises: the rows it served fail, the
    depth's pool and rows are made anew, and the next requests equal `generate`."""
    real_programs, fired = compiled.programs, []

    def programs():
        made = real_programs()
        real = made[program]

        def once(*a, **kw):
            out = real(*a, **kw)  # dispatched: its donated buffers are gone
            if not fired:
                fired.append(True)
                raise RuntimeError("injected failure")
            return out
        return compiled.Programs(made, **{program: once})

    rng = np.random.default_rng(7)
    system = rng.integers(0, 128, 40)
    store = tl.PrefixStore(model)
    store.prefix_for(system)  # a store entry: loaded into pages (load_segment) by the first prompt on it
    prompts = [np.concatenate([system, [1, 2]]), rng.integers(0, 128, 12), rng.integers(0, 128, 40)]
    monkeypatch.setattr(compiled, "programs", programs)
    with tl.Engine(model, **ENGINE, store=store) as eng:
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

def test_a_user_store_is_read_through_pages_and_compiles_nothing_after_warmup():
    """A PrefixStore's entry (capacity 384 for a 300-token prompt) is loaded into pages once
    (warmup compiled its load, whole pages) and read by every prompt on it."""
    model = tl.Model.random(tiny_config(max_seq_len=512), seed=1)
    rng = np.random.default_rng(4)
    system = rng.integers(0, 128, 300)
    store = tl.PrefixStore(model)
    entry = store.prefix_for(system)
    assert entry.cache.capacity == 384
    before = np.asarray(entry.cache.loop["k"]).copy()
    with tl.Engine(model, max_batch=2, prefill_chunk=16, store=store) as eng:
        assert eng.warmup() > 0 and eng.store is store
        for q in range(3):
            p = np.concatenate([system, rng.integers(0, 128, 3 + q)])
            h = eng.submit(p, max_tokens=4)
            assert h.result() == model.generate(p, max_tokens=4)
            # the entry's full pages; then the first request's pages, to the token (its page copied)
            assert h.prefix_tokens == (300 // P * P if q == 0 else 300)
        s = eng.stats()
        assert s["compiles_after_warmup"] == 0, eng.programs
        assert s["prefix_pool_loads"] == 1  # loaded once, then read from the pool's pages
    np.testing.assert_array_equal(np.asarray(entry.cache.loop["k"]), before)  # the entry is never written


def test_warmup_of_every_kind_leaves_nothing_to_trace(monkeypatch):
    """After `warmup(adaptive=True, speculation=[(1, 3)])` the first plain, sampled, windowed,
    adaptive, exiting-in-prefill and speculative requests trace none of the engine's programs
    (JAX's own trace events, counted by program name: a persistent compilation cache cannot hide
    one), and each equals `generate`; a draft pair it was not asked for traces its round. The
    compiler's freed memory is handed back after the warmup and after that program."""
    from tinyloop_jax import settings

    model = tiny_model("fp32")
    trims = []
    monkeypatch.setattr(settings, "release_free_memory", lambda: trims.append(len(traced)))
    names = {fn.__name__ for fn, _ in compiled.JIT_OPTIONS.values()}  # (trace events name the function)
    traced = []

    def listen(event: str, secs: float, fun_name: str = "", **_) -> None:
        if event.endswith("jaxpr_trace_duration") and fun_name in names:
            traced.append(fun_name)

    p = np.arange(40, dtype=np.int32) * 7 % 128
    work = [dict(), dict(temperature=0.8, seed=2), dict(cache_window=8), dict(exit_criterion="kl", exit_threshold=1e-2),
            dict(exit_criterion="kl", exit_threshold=1e-2, exit_in_prefill=True), dict(draft_loops=1, lookahead=3)]
    want = [model.generate(p, max_tokens=6, **kw) for kw in work]
    with tl.Engine(model, max_batch=1, prefill_chunk=16) as eng:  # (one decode bucket: fewer programs)
        assert eng.warmup(adaptive=True, speculation=[(1, 3)]) > 0
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            for kw, w in zip(work, want):
                assert eng.submit(p, max_tokens=6, **kw).result() == w, kw
            assert traced == [] and eng.stats()["compiles_after_warmup"] == 0, (traced, eng.programs)
            eng.submit(p, max_tokens=4, draft_loops=2, lookahead=2).result()
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    assert traced == ["decode_steps"] and eng.stats()["compiles_after_warmup"] == 1
    assert trims == [0, 1], trims  # after the warmup (before the listener), after the new round
    with pytest.raises(ValueError, match="draft_loops=9 must not exceed"):
        tl.Engine(model).warmup(speculation=[(9, 2)])

def test_decode_steps_are_sized_to_the_rows(model):
    """Rows leave: the next steps decode the rows left in a smaller bucket, so one long request
    does not keep decoding a 4-row batch."""
    rng = np.random.default_rng(5)
    work = [(rng.integers(0, 128, 6), dict(max_tokens=40))] + [(rng.integers(0, 128, 6), dict(max_tokens=2))
                                                             for _ in range(3)]
    with tl.Engine(model, **ENGINE) as eng:
        handles = [eng.submit(p, **kw) for p, kw in work]
        for (p, kw), h in zip(work, handles):
            assert h.result() == model.generate(p, **kw)
        decode_rows = {k[2] for k in eng.programs if k[0] == "steps"}
        assert 1 in decode_rows and max(decode_rows) >= 2, eng.programs
        # (rows beside a prompt chunk are padded to the coarser chunk buckets: 2, then max_batch)
        assert {k[2] for k in eng.programs if k[0] == "step"} <= set(chunk_buckets(ENGINE["max_batch"])), eng.programs


# ---- counters ----------------------------------------------------------------------------------

def test_prefix_cache_and_pass_counters_per_depth(model):
    """In tokens, per depth, as vLLM counts them: every prompt token is a prefix-cache query, each
    one served from cached pages a hit; every position run is a token computed, at `loops`
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
    # b reads a's system prompt: two full pages, and 8 tokens of a's partial third page (copied)
    assert hb.prefix_tokens == 40 and ha.prefix_tokens == hc.prefix_tokens == 0
    d3, d2 = s["depths"][3], s["depths"][2]
    assert (d3["prefix_cache_queries"], d3["prefix_cache_hits"]) == (42 + 43, 40)
    assert d3["tokens_computed"] == (42 + 3) + (43 - 40 + 2) and d3["passes"] == 3 * d3["tokens_computed"]
    assert (d2["prefix_cache_queries"], d2["prefix_cache_hits"], d2["tokens_computed"]) == (10, 0, 10 + 1)
    assert s["prefix_cache_queries"] == 95 and s["prefix_cache_hits"] == 40
    assert s["passes_per_token"] == (3 * d3["tokens_computed"] + 2 * d2["tokens_computed"]) / (
        d3["tokens_computed"] + d2["tokens_computed"])


def test_the_auto_budget_scales_with_what_is_free(monkeypatch):
    """"auto": 80% of a GPU's free memory, a quarter of a CPU's at most 4 GiB, never below one
    2,048-token request at the default depth; an injected 64 GiB free grows it past the old
    256 MiB, and the engine says what it holds (capacity(), stats, /metrics)."""
    from tinyloop_jax.serving import engine as E
    from tinyloop_jax.serving.budget import auto_budget

    gib = 1 << 30
    assert auto_budget(80 * gib, "gpu", 1 << 20) == 64 * gib
    assert auto_budget(64 * gib, "cpu", 1 << 20) == 4 * gib and auto_budget(2 * gib, "cpu", 1 << 20) == gib // 2
    assert auto_budget(1 << 20, "cpu", 5 << 20) == 5 << 20  # (one request's floor)
    assert auto_budget(None, "cpu", 1 << 20) == 256 << 20
    monkeypatch.setattr(E, "free_bytes", lambda: 64 * gib)
    model = tl.Model.random(tiny_config(max_seq_len=4096), seed=0)
    with tl.Engine(model, max_batch=64) as eng:
        assert eng.memory_budget == 4 * gib > 256 << 20
        cap = eng.capacity()
        b = eng.budget
        assert cap["pages"] == b.pool_pages(3) == b.max_pages() and cap["tokens"] == cap["pages"] * 16
        assert cap["rows"] == 64 and eng.stats()["budget_tokens"] == cap["tokens"]
    monkeypatch.setattr(E, "free_bytes", lambda: 1 << 20)  # (nearly nothing free: still one request)
    with tl.Engine(model, max_batch=64) as eng:
        assert eng.capacity()["rows"] == 1 and eng.capacity()["row_tokens"] == 2048


def test_warmup_stops_with_a_clear_error_short_of_the_mapping_limit(monkeypatch):
    """Each compiled program takes hundreds of memory mappings and XLA:CPU's compiler dies past
    the kernel's vm.max_map_count: warmup refuses (a RuntimeError naming the limit) before
    compiling a program without room for it, and the engine still serves."""
    from tinyloop_jax import settings
    from tinyloop_jax.serving import plan

    room = settings.mapping_headroom()
    assert room is None or room > plan.MAPPINGS_A_PROGRAM  # this process (Linux: a number)
    model = tiny_model("fp32")
    with tl.Engine(model, max_batch=1, prefill_chunk=16) as eng:
        monkeypatch.setattr(settings, "mapping_headroom", lambda: plan.MAPPINGS_A_PROGRAM - 1)
        with pytest.raises(RuntimeError, match="vm.max_map_count"):
            eng.warmup()
        monkeypatch.undo()
        p = np.arange(12, dtype=np.int32) * 5 % 128
        assert eng.submit(p, max_tokens=4).result() == model.generate(p, max_tokens=4)

