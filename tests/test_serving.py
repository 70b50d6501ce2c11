"""The serving engine: continuous batching over page pools with shared prefixes equals
`model.generate`, request by request, whatever else is in flight."""

import threading
import time

import numpy as np
import pytest
from conftest import huginn_model, tiny_model
from tinyloop_jax.serving.step import STOPS

import tinyloop_jax as tl
from tinyloop_jax.serving import Cancelled, QueueFull, RequestTimeout


ENGINE = dict(max_batch=4, prefill_chunk=16)  # one set of shapes: the tests share programs


@pytest.fixture(scope="module")
def model():
    return tiny_model("fp32")


@pytest.fixture(scope="module")
def engine(model):
    # small chunks, so that prompts take several steps beside the decoding rows
    with tl.Engine(model, **ENGINE) as eng:
        assert eng.warmup() > 0
        yield eng


def workload(seed: int = 0, n: int = 24):
    """n requests over 3 shared system prompts + unique questions: mixed max_tokens, stop
    sequences, sampled rows with seeds, and a second depth."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 128, size) for size in (40, 23, 57)]
    out = []
    for i in range(n):
        prompt = np.concatenate([systems[i % 3], rng.integers(0, 128, 3 + i % 7)])
        kw = dict(max_tokens=int(rng.integers(3, 14)))
        if i % 4 == 1:
            kw.update(temperature=0.8, top_k=20, seed=100 + i)
        if i % 6 == 2:
            kw.update(loops=2)
        out.append((prompt, kw))
    return out


def with_stops(model, work):
    """Give every third request a stop sequence taken from its own greedy output, so it fires."""
    out = []
    for i, (p, kw) in enumerate(work):
        if i % 3 == 0 and kw["max_tokens"] > 6:
            ref = model.generate(p, **kw)[len(p):]
            kw = dict(kw, stop_sequences=[ref[3:5], [127, 126, 125]])
        out.append((p, kw))
    return out


def test_many_threads_equal_generate(model, engine):
    work = with_stops(model, workload())
    results = [None] * len(work)

    def client(k):
        for i in range(k, len(work), 8):
            p, kw = work[i]
            results[i] = engine.submit(p, **kw).result()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stopped = 0
    for (p, kw), got in zip(work, results):
        want = model.generate(p, **kw)
        assert got == want, (kw, got[len(p):], want[len(p):])
        stopped += "stop_sequences" in kw and len(got) - len(p) < kw["max_tokens"]
    assert stopped >= 2  # the stop sequences did end requests early
    s = engine.stats()
    assert s["prefix_hit_rate"] > 0.3 and s["prefix_tokens_reused"] > 0  # first arrivals of a prompt miss
    assert s["mean_batch_size"] > 1.5  # requests really shared steps
    assert s["running"] == 0 and s["queue_depth"] == 0
    assert s["pages"][3]["cached"] > 0  # the prompts' pages stay in the pool for later prompts


def test_join_mid_run(model, engine):
    """Requests submitted while a long one decodes join its batch and finish before it. (The tiny
    model decodes the long one in tens of milliseconds: it asks for the context's 90 positions
    left, so a test thread starved by a busy machine still submits the others well before its
    end — with 60 one cold CI run saw it end first.)"""
    rng = np.random.default_rng(1)
    long_prompt = rng.integers(0, 128, 30)
    long = engine.submit(long_prompt, max_tokens=90)
    stream = long.stream()
    [next(stream) for _ in range(3)]
    late = [(rng.integers(0, 128, 20 + 9 * i), dict(max_tokens=4)) for i in range(3)]
    handles = [engine.submit(p, **kw) for p, kw in late]
    assert long.result() == model.generate(long_prompt, max_tokens=90)
    for (p, kw), h in zip(late, handles):
        assert h.result() == model.generate(p, **kw)
        assert h.finished_at < long.finished_at  # joined its batch: did not wait for it


def test_cancel_and_timeout(model, engine):
    p = np.arange(10, 40)
    h = engine.submit(p, max_tokens=90)
    it = h.stream()
    first = [next(it) for _ in range(2)]
    h.cancel()
    rest = list(it)  # the stream ends
    with pytest.raises(Cancelled, match="cancelled"):
        h.result()
    assert h.finish_reason == "cancelled" and len(first) + len(rest) < 90
    t = engine.submit(p, max_tokens=90, timeout=1e-6)  # past its deadline before a step can run
    with pytest.raises(RequestTimeout, match="deadline"):
        t.result()
    assert engine.generate(p, max_tokens=5) == model.generate(p, max_tokens=5)  # still serving
    deadline = time.time() + 10
    while engine.stats()["running"] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats()["running"] == 0


def test_bad_request_fails_alone(model, engine):
    rng = np.random.default_rng(2)
    good = [(rng.integers(0, 128, 12), dict(max_tokens=6)) for _ in range(3)]
    handles = [engine.submit(p, **kw) for p, kw in good]
    for bad, match in [(dict(temperature=-1.0), "temperature"), (dict(max_tokens=0), "max_tokens"),
                       (dict(prompt=[5, 128]), r"prompt\[1\] = 128"), (dict(max_tokens=200), "max_seq_len"),
                       (dict(loops=0), "loops"), (dict(timeout=-1), "timeout")]:
        kw = dict(dict(prompt=[1, 2, 3], max_tokens=4), **bad)
        with pytest.raises((ValueError, RuntimeError), match=match):
            engine.submit(**kw)
    for (p, kw), h in zip(good, handles):
        assert h.result() == model.generate(p, **kw)


def test_queue_full(model):
    with tl.Engine(model, **dict(ENGINE, max_batch=1), max_queue=2) as eng:
        handles = []
        with pytest.raises(QueueFull, match="queue is full"):
            for _ in range(8):
                handles.append(eng.submit([1, 2, 3], max_tokens=100))
        assert 2 <= len(handles) <= 3 and eng.stats()["requests_rejected"] == 1
        for h in handles:
            h.cancel()
        assert eng.generate([4, 5, 6], max_tokens=3) == model.generate([4, 5, 6], max_tokens=3)


def test_async_face(model, engine):
    import asyncio

    async def main():
        hs = [engine.submit([7, 8, 9, i], max_tokens=5) for i in range(3)]
        streamed = [[t async for t in hs[0].astream()]]
        return streamed, await asyncio.gather(*(h.aresult() for h in hs))

    streamed, results = asyncio.run(main())
    for i, got in enumerate(results):
        assert got == model.generate([7, 8, 9, i], max_tokens=5)
    assert streamed[0] == results[0][4:]


def test_steps_mix_prompt_chunks_with_decode_rows_and_tables_follow_lengths(model):
    """A long prompt's chunks run in the same steps as the other rows' decode tokens; attention
    reads the rows' live pages: the native kernel whatever the table's length (one program for
    the whole context), the XLA reference tables as long as the step's longest row needs."""
    from tinyloop_jax.model import paged
    rng = np.random.default_rng(3)
    work = [(rng.integers(0, 128, 2), dict(max_tokens=14)),
            (rng.integers(0, 128, 12), dict(max_tokens=8)),
            (rng.integers(0, 128, 70), dict(max_tokens=5))]  # five chunks of 16
    with tl.Engine(model, **dict(ENGINE, max_batch=2)) as eng:
        handles = [eng.submit(p, **kw) for p, kw in work]
        for (p, kw), h in zip(work, handles):
            assert h.result() == model.generate(p, **kw)
        steps = [k for k in eng.programs if k[0] == "step"]
        assert any(bd > 0 and T > 0 for _, _, bd, T, _ in steps)  # chunks beside decode rows
        tables = {R for *_, R in steps}
        # 64 positions, then 128 for the long prompt; or the context's 8 pages (the kernel)
        assert tables == ({8} if paged.attention_kernel(model.weights.config) != "xla" else {4, 8})


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_engine_equals_generate_for_looped_families(family):
    """Ouro's layout (GQA, 2 loop blocks, sandwich norms, its exit pick) and Huginn's (injection,
    drawn initial states: each request's from its own seed, not 0), several requests in flight,
    one of them speculative."""
    from conftest import ouro_model
    model = ouro_model("int8") if family == "ouro" else huginn_model(3)
    rng = np.random.default_rng(11)
    system = rng.integers(0, 128, 37)
    work = [(np.concatenate([system, rng.integers(0, 128, 4 + i)]), dict(max_tokens=5 + i, seed=7 * i + 1))
            for i in range(4)]
    work[1][1].update(temperature=0.9, top_p=0.8)
    work[3][1].update(draft_loops=1, lookahead=2)  # self-speculative: drafts at one pass
    with tl.Engine(model, **ENGINE) as eng:
        first = eng.submit(work[0][0], **work[0][1])
        next(iter(first.stream()))  # its prompt is in the pages: the others read the system prompt there
        handles = [first] + [eng.submit(p, **kw) for p, kw in work[1:]]
        for (p, kw), h in zip(work, handles):
            assert h.result() == model.generate(p, **kw), kw
        # Huginn's K/V depend on the seed: only a request with the first's seed may read its pages
        hits = [h.prefix_tokens for h in handles]
        # (two full pages of the 37-token system prompt, or all of it once the first is done)
        assert all(k in (32, 37) for k in hits[1:]) if family == "ouro" else (hits[1:] == [0, 0, 0]), hits
        if family == "huginn":
            h = eng.submit(work[2][0], **dict(work[2][1], seed=work[0][1]["seed"]))
            assert h.result() == model.generate(work[2][0], **dict(work[2][1], seed=work[0][1]["seed"]))
            assert h.prefix_tokens == 37  # the system prompt: two pages and the first's partial third
    if family == "huginn":  # the seed reaches the initial states: another seed, other tokens
        p, kw = work[0]
        assert any(model.generate(p, **dict(kw, seed=s)) != model.generate(p, **kw) for s in (2, 3, 4))


def test_engine_cache_window_equals_generate(model, engine):
    """cache_window per request, beside requests without one: each equals `generate` with the
    same window. Pages written under a window are read only by requests with that window (their
    K/V went through that attention)."""
    rng = np.random.default_rng(21)
    system = rng.integers(0, 128, 40)
    work = [(np.concatenate([system, rng.integers(0, 128, 3 + i)]), dict(max_tokens=9, cache_window=w))
            for i, w in enumerate([12, 0, 12, 20])]
    first = engine.submit(work[0][0], **work[0][1])
    assert first.result() == model.generate(work[0][0], **work[0][1])
    handles = [engine.submit(p, **kw) for p, kw in work[1:]]
    for (p, kw), h in zip(work[1:], handles):
        assert h.result() == model.generate(p, **kw), kw
    assert [h.prefix_tokens for h in handles] == [0, 40, 0]  # only the same window reads the first's pages
    with pytest.raises(ValueError, match="cache_window"):
        engine.submit([1, 2, 3], cache_window=-1)


def test_engine_speculative_decoding_equals_generate(model, engine):
    """draft_loops / lookahead as `generate`'s: drafts at a shallow depth over the request's own
    pages, verified at full depth in one chunk — greedy, the same tokens as plain decoding, with
    plain, windowed and sampled requests in flight (a stop sequence cutting a round exactly)."""
    rng = np.random.default_rng(31)
    system = rng.integers(0, 128, 35)
    work = [(np.concatenate([system, rng.integers(0, 128, 3 + i)]), kw) for i, kw in enumerate([
        dict(max_tokens=13, draft_loops=1, lookahead=3), dict(max_tokens=9),
        dict(max_tokens=11, draft_loops=2, lookahead=2), dict(max_tokens=10, draft_loops=1, lookahead=3,
                                                              cache_window=12),
        dict(max_tokens=8, draft_loops=1, lookahead=4, temperature=0.8, seed=5),
        dict(max_tokens=12, draft_loops=model.weights.config.default_loops, lookahead=3)])]
    ref = model.generate(work[0][0], **{k: v for k, v in work[0][1].items() if k not in ("draft_loops", "lookahead")})
    work.append((work[0][0], dict(work[0][1], stop_sequences=[ref[len(work[0][0]) + 5:][:2]])))
    handles = [engine.submit(p, **kw) for p, kw in work]
    for (p, kw), h in zip(work, handles):
        out = h.result()
        if kw.get("temperature"):
            assert len(out) == len(p) + kw["max_tokens"] and h.drafted > 0
            continue
        plain = {k: v for k, v in kw.items() if k not in ("draft_loops", "lookahead")}
        assert out == model.generate(p, **plain) == model.generate(p, **kw), kw
        if "draft_loops" in kw:
            assert h.drafted > 0 and 0 <= h.accepted <= h.drafted
    assert handles[-1].finish_reason == "stop" and len(handles[-1].tokens) < 13  # (equal to generate's, above)
    assert handles[5].accepted == handles[5].drafted > 0  # drafts at full depth: every one kept
    assert engine.stats()["speculative_rounds"] > 0
    with pytest.raises(ValueError, match="draft_loops=9 must not exceed"):
        engine.submit([1, 2, 3], draft_loops=9)
    with pytest.raises(ValueError, match="exit_criterion"):
        engine.submit([1, 2, 3], draft_loops=1, exit_criterion="kl", exit_threshold=1e-3)



def test_the_step_finds_the_stop_sequences(model, engine):
    """The token stop rule runs in the engine's step (`sampling.stop_match` over each row's last
    tokens): a stop on the first token, which sequence matched, none that starts in the prompt;
    each as `generate`'s; more than a row holds is a ValueError at submit."""
    p = np.random.default_rng(61).integers(0, 128, 21)
    ref = model.generate(p, max_tokens=8)[len(p):]
    cases = [([[ref[0]]], [ref[0]]),  # the first token (chosen in the prompt's last chunk)
             ([[127, 126], ref[2:4], [ref[3]]], ref[2:4]),  # the first listed of two that end there
             ([[int(p[-1]), ref[0]], ref[5:7]], ref[5:7])]  # one starts in the prompt: never matched
    for stops, matched in cases:
        h = engine.submit(p, max_tokens=8, stop_sequences=stops)
        assert h.result() == model.generate(p, max_tokens=8, stop_sequences=stops), stops
        assert h.finish_reason == "stop" and h.stop_matched == list(matched), (stops, h.stop_matched)
    S, L = STOPS
    with pytest.raises(ValueError, match=f"at most {S} sequences"):
        engine.submit(p, stop_sequences=[[i] for i in range(S + 1)])
    with pytest.raises(ValueError, match=f"at most {L} tokens"):
        engine.submit(p, stop_sequences=[[1] * (L + 1)])

@pytest.mark.parametrize("overlap", [True, False])
def test_several_decode_steps_per_dispatch_equal_generate(model, overlap):
    """With nothing to admit the engine runs `decode_steps` steps in one program: stop sequences
    and max_tokens that fall inside such a burst cut exactly (the surplus is discarded), and
    requests submitted meanwhile join at the next dispatch."""
    rng = np.random.default_rng(41)
    work = [(rng.integers(0, 128, 9 + i), dict(max_tokens=m)) for i, m in enumerate((11, 6, 13))]
    ref = model.generate(work[0][0], **work[0][1])
    work[0][1]["stop_sequences"] = [ref[len(work[0][0]) + 5:][:2]]  # fires in the middle of a burst
    with tl.Engine(model, **ENGINE, decode_steps=4, overlap=overlap) as eng:
        first = eng.submit(*work[0][:1], **work[0][1])
        next(iter(first.stream()))
        handles = [first] + [eng.submit(p, **kw) for p, kw in work[1:]]
        for (p, kw), h in zip(work, handles):
            assert h.result() == model.generate(p, **kw), kw
        assert any(k[0] == "steps" for k in eng.programs)
    assert handles[0].finish_reason == "stop" and len(handles[0].tokens) < 11
    with pytest.raises(ValueError, match="decode_steps"):
        tl.Engine(model, decode_steps=0)


def test_submit_takes_the_request_as_two_values(model, engine):
    """`Engine.submit(params=SamplingParams, plan=DepthPlan)` and `Engine.submit(Request)` equal the
    keywords; the engine's per-depth exit pick refuses a plan that asks for another."""
    p = np.arange(20, dtype=np.int32) * 3 % 128
    params = tl.SamplingParams(max_tokens=6, temperature=0.7, seed=9)
    plan = tl.Speculative(loops=2, draft_loops=1, lookahead=2)
    assert engine.submit(p, params=params, plan=plan).result() == \
        engine.submit(p, max_tokens=6, temperature=0.7, seed=9, loops=2, draft_loops=1, lookahead=2).result()
    assert engine.submit(p, params=tl.SamplingParams(max_tokens=5)).result() == model.generate(p, max_tokens=5)
    assert engine.submit(tl.Request(p, params, plan)).result() == engine.submit(p, params=params, plan=plan).result()
    with pytest.raises(ValueError, match="inside the Request or as keywords"):
        engine.submit(tl.Request(p, params), loops=2)
    with pytest.raises(ValueError, match="exit_at_step"):
        engine.submit(p, plan=tl.Fixed(exit_at_step=1))
    with pytest.raises(ValueError, match="pass seed inside the SamplingParams"):
        engine.submit(p, seed=1, params=params)


def test_a_repeat_of_a_prompt_copies_its_partial_last_page(model):
    """A prompt's partial last page is shareable once its last chunk runs: a request with the same
    prompt admitted while the first decodes (as `n > 1` siblings are) reads every token of it but
    the last (its full pages in place, the partial one copied before it writes), and one after
    the first finished reads the page it wrote on; all equal `generate`."""
    p = (np.arange(37, dtype=np.int32) * 5) % 128
    with tl.Engine(model, **ENGINE) as eng:
        first = eng.submit(p, max_tokens=12)
        next(iter(first.stream()))
        second = eng.submit(p, max_tokens=9, temperature=0.7, seed=4)
        assert second.result() == model.generate(p, max_tokens=9, temperature=0.7, seed=4)
        assert first.result() == model.generate(p, max_tokens=12)
        third = eng.submit(first.result()[:45], max_tokens=5)
        assert third.result() == model.generate(first.result()[:45], max_tokens=5)
    assert second.prefix_tokens == 36 and third.prefix_tokens == 44


def test_requests_arriving_together_read_the_first_ones_pages(model, engine):
    """Requests submitted together over one long system prompt: the first prefills it, the
    others wait for its pages to be written and read them (instead of each prefilling the
    prompt again); an unrelated request behind them is served too; all equal `generate`."""
    rng = np.random.default_rng(53)
    system = rng.integers(0, 128, 70)  # 4 full pages, 5 chunks of 16
    work = [np.concatenate([system, rng.integers(0, 128, 3 + i)]) for i in range(3)] + [rng.integers(0, 128, 20)]
    waits = engine.stats().get("prefix_waits", 0)
    with engine._cv:  # queued together: the engine admits none before all are in (else it may have
        handles = [engine.submit(p, max_tokens=6) for p in work]  # written the pages before the rest came)
    for p, h in zip(work, handles):
        assert h.result() == model.generate(p, max_tokens=6)
    assert handles[0].prefix_tokens == 0 and all(h.prefix_tokens >= 64 for h in handles[1:3])
    assert handles[3].prefix_tokens == 0 and engine.stats().get("prefix_waits", 0) > waits


def test_a_burst_reaches_an_async_reader_as_one_list():
    """The tokens of a burst of decode steps are emitted without waking the readers, then woken
    once: `achunks()` (what the server streams, one event per list) gets them as one list."""
    import asyncio

    from tinyloop_jax.serving.handles import Handle

    h = Handle(tl.Request(np.asarray([1, 2], np.int32), tl.SamplingParams(max_tokens=5)))

    async def read():
        got = []
        async for new in h.achunks():
            got.append(list(new))
            if len(got) == 1:  # the engine's next burst, while this reader waits
                threading.Thread(target=burst).start()
        return got

    def burst():
        time.sleep(0.1)  # the reader waits to be woken
        for t in (7, 8, 9):
            h.emit(t, wake=False)
            time.sleep(0.05)  # a woken reader would take each token alone
        h.wake()
        h.finish("length")

    h.emit(5)
    assert asyncio.run(read()) == [[5], [7, 8, 9]]
    assert h.result() == [1, 2, 5, 7, 8, 9]
