"""K/V shared across passes (`kv_share`, issue 62): the read map against Huginn's own cache rule,
the sizes against the models' published figures, and `generate` on the compact store against a
naive store — every pass kept, each finished token's passes overwritten by what the mode reads
(the prompt after its prefill, each decoded token after its step), on the dense functional path
of the same weights with kv_share full."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from tinyloop_jax.model import kv_share as KS
from tinyloop_jax.serving import MemoryBudgetError


def huginn_reads(p: int, ran: int, stage: int) -> int | None:
    """Huginn's `compress-s{stage}` on one token's core layers, per block (its dict cache: each
    step's K/V stored at (step - 2) % stage + 2, a later step overwriting): the step a pass p
    lookup finds, stage counted in passes (None: nothing stored there)."""
    slots = {}
    for q in range(ran):
        slots[q % stage] = q
    return slots.get(p % stage)


def test_ring_reads_what_huginns_compressed_cache_holds():
    for m in (1, 2, 4):
        share = KS.parse("last" if m == 1 else f"ring:{m}")
        for loops in (4, 8):
            for ran in range(m, loops + 1):  # (every residue written: Huginn's cache finds them all)
                assert [share.source(p, ran) for p in range(loops)] == [huginn_reads(p, ran, m) for p in range(loops)]
    assert KS.parse("first").source(5, 8) == 0 and KS.parse("avg").source(5, 8) is None
    assert KS.parse("full").source(5, 8) == 5


def test_bad_modes_are_clear_errors():
    for bad in ("ring:0", "ring:x", "ring", "mean", 3):
        with pytest.raises(ValueError, match="kv_share="):
            KS.parse(bad)
    with pytest.raises(ValueError, match="divisible by 3"):
        KS.parse("ring:3").check(8)
    with pytest.raises(ValueError, match="kv_share="):
        tiny_config(kv_share="ring:0")
    with pytest.warns(UserWarning, match="trained for it"):
        tiny_config(kv_share="first")


def test_collapse_holds_what_each_pass_reads():
    rng = np.random.default_rng(0)
    stack = {"k": rng.normal(size=(8, 2, 3, 5, 4)).astype(np.float32),
             "v": rng.normal(size=(8, 2, 3, 5, 4)).astype(np.float32)}
    from tinyloop_jax.model.kv_modes import kv_mode

    fp32 = kv_mode("fp32")
    for name in ("last", "ring:2", "ring:4", "first"):
        share = KS.parse(name)
        got = KS.expand(KS.collapse(stack, share, 8, fp32), share, 8)
        for p in range(8):
            np.testing.assert_array_equal(got["k"][p], stack["k"][share.source(p, 8)])
    avg = KS.collapse(stack, KS.parse("avg"), 6, fp32)  # (the first 6 of 8 passes: a shallower call)
    np.testing.assert_allclose(np.asarray(avg["v"][0]), stack["v"][:6].mean(0), rtol=1e-6)


def test_bytes_per_token_match_the_models_published_figures():
    huginn = tl.ModelConfig(vocab_size=65536, d_model=5280, n_heads=55, n_pre_blocks=2, loop_blocks=4,
                            n_post_blocks=2, block="llama", kv_mode="fp16", default_loops=32)
    assert KS.bytes_per_token(huginn, 32, "full") == 132 * 2 * 5280 * 2  # 2.79 MB (the figure)
    assert KS.bytes_per_token(huginn, 32, "last") == 8 * 2 * 5280 * 2
    assert KS.bytes_per_token(huginn, 32, "ring:2") == 12 * 2 * 5280 * 2
    ouro = tl.ModelConfig(vocab_size=49152, d_model=2048, n_heads=16, n_pre_blocks=0, loop_blocks=24,
                          block="llama", kv_mode="fp16", default_loops=4)
    assert KS.bytes_per_token(ouro, 4, "full") == 768 * 1024  # 768 KiB at 4 loops (the figure)
    assert KS.bytes_per_token(ouro, 4, "avg") == 192 * 1024


# ---- generate on the compact store == the naive store -------------------------------------------

def naive(base: tl.Model, share: KS.Share, prompt: list, loops: int, n: int, window: int = 0) -> list[int]:
    """Greedy tokens by the dense functional path (kv_share full), each finished token's passes
    overwritten in the cache by what `share` reads (numpy: the stored arrays copied; avg: the
    mean of the passes' float32 K/V, re-encoded in the cache's mode)."""
    return naive_run(base, share, prompt, loops, n, window)[0]


def naive_run(base: tl.Model, share: KS.Share, prompt: list, loops: int, n: int,
              window: int = 0, grammar=None) -> tuple[list[int], np.ndarray]:
    """`naive`'s greedy tokens and the logits each was chosen from [n, V]; with a `tl.Grammar`,
    llguidance's own mask applied before each choice, until the grammar ends."""
    w = base.weights

    def rewrite(cache, positions):
        if share.full:
            return cache
        loop = {name: np.array(a) for name, a in cache.loop.items()}  # [L, k, KV, C, w] each stored array
        C = loop["k"].shape[3]
        for pos in positions:
            old = {name: a[:, :, :, pos % C].copy() for name, a in loop.items()}  # [L, k, KV, w]
            if share.kind == "avg":
                k, v = cache.kv_mode.unpack({name: a[:loops] for name, a in old.items()}, None)
                mean = cache.kv_mode.pack(None, np.asarray(k).mean(0), np.asarray(v).mean(0))
            for p in range(loops):
                for name, a in loop.items():
                    if share.kind == "avg":
                        a[p, :, :, pos % C] = np.asarray(mean[name])
                    elif share.kind == "first":
                        a[p, :, :, pos % C] = old[name][0]
                    else:  # ring:m: the latest pass run with the same residue
                        a[p, :, :, pos % C] = old[name][max(q for q in range(loops) if q % share.m == p % share.m)]
        return cache.replace(loop={name: jnp.asarray(a) for name, a in loop.items()})

    cache = F.empty_cache(w, len(prompt) + n, loops, cache_window=window)
    logits, cache = F.prefill(w, prompt, cache, loops=loops, cache_window=window)
    cache = rewrite(cache, range(len(prompt)))
    out, rows = [], []
    matcher = None if grammar is None else grammar.matcher()
    for i in range(n):
        rows.append(np.asarray(logits))
        if matcher is None:
            out.append(int(np.argmax(rows[-1])))
        else:
            from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

            masked, bits = rows[-1].astype(np.float32)[None].copy(), allocate_token_bitmask(1, len(rows[-1]))
            fill_next_token_bitmask(matcher, bits)
            apply_token_bitmask_inplace(masked, bits)
            out.append(int(np.argmax(masked[0])))
            assert matcher.consume_token(out[-1])
            if matcher.is_stopped():
                break
        if i < n - 1:
            logits, cache = F.decode_step(w, out[-1], cache, loops=loops, cache_window=window)
            cache = rewrite(cache, [len(prompt) + i])
    return out, np.stack(rows)


def shared(base: tl.Model, name: str) -> tl.Model:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("first": experimental)
        return tl.Model(base.weights.params, base.weights.config.replace(kv_share=name))


BASES = {}


def base_in(kv_mode: str) -> tl.Model:
    if kv_mode not in BASES:
        BASES[kv_mode] = tl.Model.random(tiny_config(kv_mode=kv_mode, default_loops=4), seed=5)
    return BASES[kv_mode]


@pytest.fixture(scope="module")
def base():
    return base_in("fp32")


PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 2, 2, 19, 101, 64, 7, 7, 33, 12, 90]]


@pytest.mark.parametrize("name,loops", [("last", 1), ("last", 3), ("ring:2", 4), ("ring:4", 8), ("avg", 3),
                                        ("first", 3), ("avg", 8)])
def test_generate_on_the_compact_store_equals_the_naive_store(base, name, loops):
    model, n = shared(base, name), 12
    want = [naive(base, model.weights.config.share, p, loops, n) for p in PROMPTS]
    assert [model.generate(p, max_tokens=n, loops=loops)[len(p):] for p in PROMPTS] == want
    assert model.generate_batch(PROMPTS, max_tokens=n, loops=loops) == [p + t for p, t in zip(PROMPTS, want)]
    prefix = model.build_prefix_cache(PROMPTS[1][:6], loops=loops)  # (a prefix stays per pass)
    got = model.generate_from_prefix_cache(prefix, max_tokens=n, suffix=PROMPTS[1][6:])
    assert got[len(PROMPTS[1]):] == want[1]


@pytest.mark.parametrize("kv_mode,name,window", [("int8", "ring:2", 0), ("int4", "first", 0), ("int8", "avg", 0),
                                                 ("fp32", "last", 8), ("int4", "ring:2", 8)])
def test_the_compact_store_in_other_modes_and_under_a_window(kv_mode, name, window):
    b = base_in(kv_mode)
    model, n, loops = shared(b, name), 12, 4
    for p in PROMPTS:
        assert model.generate(p, max_tokens=n, loops=loops, cache_window=window)[len(p):] == naive(
            b, model.weights.config.share, p, loops, n, window)


@pytest.mark.parametrize("name", ["last", "avg"])
def test_structured_output_on_the_compact_store(name):
    """A grammar's masks over the compact store's decode steps (the host loop: forward and choice
    apart) == the naive store with llguidance's own mask."""
    b = tl.Model.random(tiny_config(vocab_size=260, kv_mode="fp32", default_loops=4), seed=2)
    g = tl.Grammar.of({"type": "regex", "regex": "[0-9]{2,3}(-[a-f]{2})?"}, tl.ByteTokenizer(), 260)
    prompt = [int(c) for c in b"The answer: "]
    model = shared(b, name)
    got = model.generate(prompt, max_tokens=10, loops=4, response_format=g)[len(prompt):]
    assert got == naive_run(b, model.weights.config.share, prompt, 4, 10, grammar=g)[0]


@pytest.mark.parametrize("name", ["last", "ring:2", "avg", "first"])
def test_adaptive_depth_that_never_exits_equals_the_fixed_depth(base, name):
    """The adaptive step on a compact store (each row's last pass kept, its skipped passes filled,
    then collapsed) with every pass run == the fixed-depth step (== the naive store, above)."""
    model, loops = shared(base, name), 4
    for p in PROMPTS:
        fixed = model.generate(p, max_tokens=10, loops=loops)
        assert model.generate(p, max_tokens=10, loops=loops, exit_criterion="kl", min_steps=loops) == fixed
        assert model.last_passes == [loops] * 10


@pytest.mark.parametrize("name", ["last", "ring:2", "avg"])
def test_adaptive_rows_of_a_batch_equal_each_alone(base, name):
    """Rows exiting at different passes in one batch (an exited row's slots keep being written
    while the others run: its last pass is kept and its skipped passes filled) == each alone."""
    model, loops = shared(base, name), 8
    kw = dict(max_tokens=10, loops=loops, exit_criterion="kl", exit_threshold=1e-2)
    batch = model.generate_batch(PROMPTS, **kw)
    assert batch == [model.generate(p, **kw) for p in PROMPTS]
    passes = [model.generate(p, **kw) and model.last_passes for p in PROMPTS]
    assert len({tuple(x) for x in passes}) > 1 and min(map(min, passes)) < loops  # (the rows exit apart)


@pytest.mark.parametrize("criterion,threshold", [("entropy-diff", 0.05), ("latent-diff", 0.2), ("cosine", 0.05),
                                                 ("argmax-stability", 1), ("gate", 0.7)])
def test_each_exit_criterion_on_the_compact_store(base, criterion, threshold):
    """Every exit criterion (kl above) on a compact store under avg, the mode whose settle is
    the most work: rows of a batch exiting at different passes == each alone, and the engine's
    rows == `generate`'s (the gate on an Ouro-layout model, which has one)."""
    from conftest import OURO

    model, loops = shared(base, "avg"), 8
    if criterion == "gate":
        model, loops = tl.Model.random(tl.ModelConfig(**{**OURO, "kv_share": "avg"}), seed=0), 3
    kw = dict(max_tokens=10, loops=loops, exit_criterion=criterion, exit_threshold=threshold)
    alone = [model.generate(p, **kw) for p in PROMPTS]
    passes = [model.generate(p, **kw) and model.last_passes for p in PROMPTS]
    assert model.generate_batch(PROMPTS, **kw) == alone
    assert min(map(min, passes)) < loops and len({tuple(x) for x in passes}) > 1  # (they exit, apart)
    with tl.Engine(model, max_batch=2, prefill_chunk=16) as engine:
        assert [h.result() for h in [engine.submit(p, **kw) for p in PROMPTS]] == alone


def test_the_modes_change_what_later_tokens_read(base):
    """(so the equality above can fail: the naive store differs from kv_share full's tokens)"""
    n, loops = 16, 8
    full = [base.generate(p, max_tokens=n, loops=loops)[len(p):] for p in PROMPTS]
    assert full == [naive(base, KS.parse("full"), p, loops, n) for p in PROMPTS]
    for name in ("last", "avg"):
        assert [naive(base, KS.parse(name), p, loops, n) for p in PROMPTS] != full, name


def test_paths_without_a_compact_store_refuse_it(base):
    model = shared(base, "last")
    with pytest.raises(ValueError, match="speculative decoding with it is not served"):
        model.generate(PROMPTS[0], max_tokens=4, loops=3, draft_loops=1, lookahead=2)
    with tl.Engine(model) as engine:
        with pytest.raises(ValueError, match="speculative decoding with it is not served"):
            engine.submit(PROMPTS[0], max_tokens=4, loops=3, draft_loops=1, lookahead=2)
    with tl.Engine(shared(base, "ring:2")) as engine, pytest.raises(ValueError, match="divisible by 2"):
        engine.submit(PROMPTS[0], max_tokens=4, loops=3)
    with pytest.raises(ValueError, match="divisible by 2"):
        shared(base, "ring:2").generate(PROMPTS[0], max_tokens=4, loops=3)


def test_a_share_mismatch_on_a_prefix_load_names_it_and_checkpoints_keep_the_mode(base, tmp_path):
    prefix = base.build_prefix_cache(PROMPTS[0], loops=4)
    prefix.save(str(tmp_path / "p"))
    last = shared(base, "last")
    with pytest.raises(ValueError, match="kv_share='full', this model has kv_share='ring:1'"):
        tl.PrefixCache.load(str(tmp_path / "p"), last)
    last.save(str(tmp_path / "m"))
    back = tl.Model.load(str(tmp_path / "m"))
    assert back.weights.config.kv_share == "ring:1" and back.fingerprint == last.fingerprint != base.fingerprint
    assert back.generate(PROMPTS[0], max_tokens=6, loops=4) == last.generate(PROMPTS[0], max_tokens=6, loops=4)


def test_a_store_load_and_depth_views_serve_the_compact_store(base, tmp_path):
    """A PrefixStore (its entries per pass) saved and loaded, and a prefix viewed at another depth
    (shallower: a view; deeper: the missing passes from its kept state), decode on the compact
    store exactly as a call from scratch."""
    model, n = shared(base, "ring:2"), 8
    want = model.generate(PROMPTS[1], max_tokens=n, loops=4)
    store = tl.PrefixStore(model, loops=4)
    store.insert(model.build_prefix_cache(PROMPTS[1][:7], loops=4))
    assert store.generate(PROMPTS[1], max_tokens=n) == want
    store.save(str(tmp_path / "s"))
    back = tl.PrefixStore.load(str(tmp_path / "s"), model)
    assert back.generate(PROMPTS[1], max_tokens=n) == want and back.stats()["tokens_reused"] >= 7
    deep = model.build_prefix_cache(PROMPTS[0], loops=8, keep_state=True)
    for loops in (2, 4):  # (ring:2 needs an even depth)
        got = model.generate_from_prefix_cache(deep.at_depth(loops), max_tokens=n)
        assert got == model.generate(PROMPTS[0], max_tokens=n, loops=loops)
    shallow = model.build_prefix_cache(PROMPTS[0], loops=2, keep_state=True)
    assert model.generate_from_prefix_cache(shallow.at_depth(6), max_tokens=n) == model.generate(
        PROMPTS[0], max_tokens=n, loops=6)


# ---- the engine: prompts on pass slots, collapsed at their end --------------------------------------

LONG = [int(x) for x in np.random.default_rng(0).integers(1, 120, 70)]
ENGINE_PROMPTS = PROMPTS + [LONG, LONG[:40] + [3, 4, 5]]  # (the last shares 2 full pages with the one before)


@pytest.mark.parametrize("name,kv_mode", [("last", "fp32"), ("ring:2", "fp32"), ("avg", "fp32"), ("first", "fp32"),
                                          ("ring:2", "int8")])
def test_the_engine_on_pass_slots_equals_the_naive_store(name, kv_mode):
    """The engine's compact pool: prompts in 16-token chunks on pass slots (every pass), rows
    decoding beside them on the compact layers, each prompt's pages collapsed at its end; then
    every prompt again, reading the pool's cached pages (those that kept their pass slots) — the
    tokens of the naive store each time."""
    b = base_in(kv_mode)
    model, share = shared(b, name), KS.parse(name)
    want = [naive(b, share, p, 4, 10) for p in ENGINE_PROMPTS]
    with tl.Engine(model, prefill_chunk=16, max_batch=4) as engine:
        handles = [engine.submit(p, max_tokens=10, loops=4) for p in ENGINE_PROMPTS]
        assert [h.result()[len(p):] for h, p in zip(handles, ENGINE_PROMPTS)] == want
        again = []
        for p in ENGINE_PROMPTS:  # one after the other: the last reads the 2 pages it shares with the one before
            again.append(engine.submit(p, max_tokens=10, loops=4))
            again[-1].result()
        assert [h.result()[len(p):] for h, p in zip(again, ENGINE_PROMPTS)] == want
        assert again[3].prefix_tokens >= 32
        pages = engine.stats()["pages"][4]
        assert pages["pass_free"] + pages["pass_idle"] == pages["pass_slots"]  # (every row gave its slots back)


def test_pass_slots_taken_back_leave_the_pages_compact_and_prompts_recomputed(base):
    """A budget of few pass slots: later prompts take back the idle slots of earlier ones, whose
    pages then serve no prompt (they keep only compact layers) — a prompt sharing them is
    computed again, and every answer is still the naive store's. A prompt needing more pass slots
    than a budget holds is refused with the numbers."""
    model, share = shared(base, "last"), KS.parse("last")
    with tl.Engine(model, max_batch=4, memory_budget=None) as probe:
        b = probe.budget
        budget = b.rows_nbytes() + b.pages_nbytes(4, 24)  # 24 pages, 9 pass slots (one 128-token prompt's + 1)
        small = b.rows_nbytes() + b.pages_nbytes(4, 6)  # 6 pages, 6 pass slots
    others = [[int(x) for x in np.random.default_rng(s).integers(1, 120, 60)] for s in (1, 2)]
    order = [LONG] + others + [LONG[:40] + [3, 4, 5]]
    want = [naive(base, share, p, 4, 8) for p in order]
    with tl.Engine(model, prefill_chunk=16, max_batch=4, memory_budget=budget) as engine:
        assert engine.budget.pool_pages(4) == 24 and engine.budget.prompt_slots(24) == 9
        got = [engine.generate(p, max_tokens=8, loops=4)[len(p):] for p in order]
        s = engine.stats()
        assert got == want
        assert s["pages"][4]["pass_reclaimed"] > 0 and s["prefix_tokens_reused"] == 0  # (LONG's pages lost theirs)
    with tl.Engine(model, max_batch=4, memory_budget=small) as engine:
        with pytest.raises(MemoryBudgetError, match="needs 8 pass slots .* holds 6"):
            engine.submit(LONG + LONG[:40], max_tokens=4, loops=4)


def test_a_compact_budget_holds_more_pages(base):
    """At one memory budget, a compact kv_share's depth holds more pages (the budget counts its
    compact layers on the pages and every pass on a quarter as many pass slots, at least one
    whole-context prompt's)."""
    budget = 1 << 20
    with tl.Engine(base, memory_budget=budget) as full, tl.Engine(shared(base, "last"), memory_budget=budget) as last:
        f, c = full.budget, last.budget
        room = budget - f.rows_nbytes()
        assert f.pool_pages(4) == room // f.page_nbytes(4)
        n = c.pool_pages(4)
        assert c.pass_nbytes(4) == c.page_nbytes(4, 4 * c.cfg.loop_blocks) and c.prompt_slots(n) == max(-(-n // 4), 9)
        assert c.pages_nbytes(4, n) <= room < c.pages_nbytes(4, n + 1) and c.depth_nbytes(4) <= budget
        assert n > 1.4 * f.pool_pages(4)  # (this tiny model: 2 pre blocks, 1 loop block; 6 layers a token -> 3)


@pytest.mark.parametrize("name", ["last", "avg"])
def test_the_engine_on_pass_slots_serves_exits_grammars_and_cancels(name):
    """Under a compact kv_share the engine's adaptive rows (exits while decoding; a prompt
    exiting as a whole on its pass slots) equal `generate`'s (== the naive store, above), a
    grammar's masks equal llguidance's over the naive store, and a prompt cancelled while it
    prefills gives its pass slots back."""
    b = tl.Model.random(tiny_config(vocab_size=260, kv_mode="fp32", default_loops=4), seed=2)
    model = shared(b, name)
    g = tl.Grammar.of({"type": "regex", "regex": "[0-9]{2,3}(-[a-f]{2})?"}, tl.ByteTokenizer(), 260)
    prompt = [int(c) for c in b"The answer: "]
    kl = dict(max_tokens=10, loops=4, exit_criterion="kl", exit_threshold=0.1)  # (exits at pass 2 of 4)
    with tl.Engine(model, prefill_chunk=16, max_batch=4) as engine:
        long = engine.submit(LONG * 1, max_tokens=20, loops=4)
        long.cancel()
        for kw in (kl, dict(kl, exit_in_prefill=True)):
            h = engine.submit(PROMPTS[1], **kw)
            assert h.result() == model.generate(PROMPTS[1], **kw) and h.passes == model.last_passes
            assert min(h.passes) < 4
        got = engine.generate(prompt, max_tokens=10, loops=4, response_format=g)[len(prompt):]
        assert got == naive_run(b, model.weights.config.share, prompt, 4, 10, grammar=g)[0]
        pages = engine.stats()["pages"][4]
        assert pages["pass_free"] + pages["pass_idle"] == pages["pass_slots"]


def test_the_engines_warmup_under_a_compact_mode_leaves_nothing_to_trace(base):
    """`warmup(adaptive=True)` under kv_share compiles the prompt's chunk programs on the swapped
    pool, the collapse program of each page-count bucket, the decode steps on the compact pool
    and the pool itself: plain, sampled, adaptive and exiting-in-prefill requests then trace none
    of the engine's programs (JAX's own trace events, by program name)."""
    import jax

    from tinyloop_jax.decoding import compiled

    model = shared(base, "avg")
    names = {fn.__name__ for fn, _ in compiled.JIT_OPTIONS.values()}
    traced = []

    def listen(event: str, secs: float, fun_name: str = "", **_) -> None:
        if event.endswith("jaxpr_trace_duration") and fun_name in names:
            traced.append(fun_name)

    work = [dict(), dict(temperature=0.8, seed=2), dict(exit_criterion="kl", exit_threshold=0.1),
            dict(exit_criterion="kl", exit_threshold=0.1, exit_in_prefill=True)]
    want = [model.generate(LONG, max_tokens=6, loops=4, **kw) for kw in work]
    with tl.Engine(model, max_batch=1, prefill_chunk=16) as engine:
        assert engine.warmup(loops=4, adaptive=True) > 0
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            assert [engine.generate(LONG, max_tokens=6, loops=4, **kw) for kw in work] == want
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
        assert traced == [] and engine.stats()["compiles_after_warmup"] == 0, (traced, engine.programs)
