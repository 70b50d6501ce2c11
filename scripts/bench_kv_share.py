"""What `kv_share` saves and what it costs (issue 62): bytes a token, what one budget holds,
decode speed, and next-token quality token by token.

    python scripts/bench_kv_share.py             # ~6 min on 2 CPUs; writes docs/benchmarks.md and docs/quality.md
    python scripts/bench_kv_share.py --quick     # a smoke run, nothing written
    python scripts/bench_kv_share.py --engine    # the engine part alone (~5 min), its section written
    python scripts/bench_kv_share.py --ouro checkpoints/tinyloop-ouro4   # a second looped model's quality

* bytes: a finished token's K/V per mode against loops 1..32 for the bundled model and, from
  their published configs, Huginn-0125 (3.5B: prelude 2, core 4, coda 2, d 5280, bf16) and
  Ouro-1.4B (24 looped layers, d 2048, bf16); what a 1 GiB budget holds (tokens; rows of the
  bundled model's whole 256-token context).
* decode: `generate_batch` on the bundled model at its default depth (6), greedy, 64 new tokens
  after a 64-byte prompt, at batch 1 and at the rows each mode's decode pages fit in the budget
  that holds 4 full-mode rows of the whole context (tokens/s, median of 3).
* quality: the bundled model token by token through the decode path — a 64-byte held-out
  prompt prefilled (every pass, as a prompt is), then each next held-out byte fed as a decode
  step — the cache kept naively (every pass, each finished token's passes overwritten by what
  the mode reads: `generate` on the compact store equals this store, tests/test_kv_share.py);
  bits/byte, KL(full || mode) per position, top-1 agreement with full, and whether a 32-token
  greedy continuation equals full's; 95% intervals by bootstrap over the windows.
* engine (`--engine`): one `tl.Engine` a mode at one memory budget (4 full-mode rows of the
  whole context): its pages, pass slots and the whole-context rows they hold; 24 requests at
  once (64 held-out bytes, 128 new tokens), greedy and sampled (temperature 0.8), tokens/s
  (median of 3 rounds after a round that compiles) and the mean rows a decode step ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.api import functional as F  # noqa: E402
from tinyloop_jax.cli import BUNDLED  # noqa: E402
from tinyloop_jax.data import pydoc_split  # noqa: E402
from tinyloop_jax.model import kv_share as KS  # noqa: E402

MODES = ("full", "last", "ring:2", "avg", "first")
HUGINN = tl.ModelConfig(vocab_size=65536, d_model=5280, n_heads=55, n_pre_blocks=2, loop_blocks=4, n_post_blocks=2,
                        block="llama", kv_mode="fp16", default_loops=32)  # (fp16: bf16's bytes)
OURO = tl.ModelConfig(vocab_size=49152, d_model=2048, n_heads=16, n_pre_blocks=0, loop_blocks=24, block="llama",
                      kv_mode="fp16", default_loops=4)


def fits(share: str, loops: int) -> bool:
    try:
        KS.parse(share).check(loops)
        return True
    except ValueError:
        return False


def each_mode(model, loops: int, modes=MODES):
    """(mode, the model under it) for each of `modes` that serves `loops` ("first" warns: quiet here)."""
    import warnings

    c = model.weights.config
    for m in modes:
        if fits(m, loops):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield m, tl.Model(model.weights.params, c.replace(kv_share=m))


def bytes_table(cfg, name: str, loops_list) -> list[str]:
    rows = [f"| {name} | " + " | ".join(str(n) for n in loops_list) + " |", "|---" * (len(loops_list) + 1) + "|"]
    for m in MODES:
        cells = [f"{KS.bytes_per_token(cfg, n, m) / 1024:,.1f}" if fits(m, n) else "-" for n in loops_list]
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return rows


@partial(jax.jit, static_argnames=("share", "loops"), donate_argnames=("loop",))
def settle(loop: dict, slot, share: KS.Share, loops: int) -> dict:
    """The naive store: position `slot` of every pass overwritten by what pass p reads."""
    if share.kind == "avg":
        mean = {n: a[:loops, :, :, slot].astype(jnp.float32).mean(0) for n, a in loop.items()}  # (fp32 caches)
        return {n: a.at[:loops, :, :, slot].set(jnp.broadcast_to(mean[n], a[:loops, :, :, slot].shape).astype(a.dtype))
                for n, a in loop.items()}
    take = np.array([share.source(p, loops) for p in range(loops)])
    return {n: a.at[:loops, :, :, slot].set(a[take, :, :, slot]) for n, a in loop.items()}


def run_window(w, share: KS.Share, loops: int, prompt: np.ndarray, follow: np.ndarray, greedy: int):
    """(log-probabilities [len(follow), V] of each next byte, fed token by token; the greedy
    continuation of `greedy` tokens after the prompt)."""
    def start():
        cache = F.empty_cache(w, len(prompt) + max(len(follow), greedy) + 1, loops)
        logits, cache = F.prefill(w, prompt, cache, loops=loops)
        if not share.full:
            for pos in range(len(prompt)):
                cache = cache.replace(loop=settle(cache.loop, jnp.int32(pos), share, loops))
        return logits, cache

    def step(logits, cache, token, pos):
        logits, cache = F.decode_step(w, int(token), cache, loops=loops)
        if not share.full:
            cache = cache.replace(loop=settle(cache.loop, jnp.int32(pos), share, loops))
        return logits, cache

    logits, cache = start()
    out = []
    for i, t in enumerate(follow):
        out.append(np.asarray(jax.nn.log_softmax(logits)))
        if i < len(follow) - 1:
            logits, cache = step(logits, cache, t, len(prompt) + i)
    logits, cache = start()
    gen = []
    for i in range(greedy):
        gen.append(int(np.argmax(np.asarray(logits))))
        if i < greedy - 1:
            logits, cache = step(logits, cache, gen[-1], len(prompt) + i)
    return np.stack(out), gen


def boot(x: np.ndarray, rng, n: int = 2000) -> tuple[float, float]:
    means = [x[rng.integers(0, len(x), len(x))].mean() for _ in range(n)]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def quality(model, loops_list, windows: int, prompt_len: int, follow_len: int, greedy: int) -> list[str]:
    import warnings

    w = model.weights
    val = pydoc_split()[1].astype(np.int32)
    step = len(val) // windows
    starts = [i * step for i in range(windows)]
    rng = np.random.default_rng(0)
    rows = ["| loops | mode | bits/byte [95%] | KL vs full (nats) [95%] | top-1 = full | greedy 32 = full |",
            "|---|---|---|---|---|---|"]
    for loops in loops_list:
        ref = None
        for m in MODES:
            if not fits(m, loops):
                continue
            share = KS.parse(m)
            bits, kls, top1, same = [], [], [], []
            for i, s in enumerate(starts):
                prompt, follow = val[s:s + prompt_len], val[s + prompt_len:s + prompt_len + follow_len]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    lp, gen = run_window(w, share, loops, prompt, follow, greedy)
                if m == "full":
                    ref = {} if ref is None else ref
                    ref[i] = (lp, gen)
                rlp, rgen = ref[i]
                bits.append(-lp[np.arange(len(follow)), follow].mean() / np.log(2))
                kls.append(np.sum(np.exp(rlp) * (rlp - lp), axis=-1).mean())
                top1.append(np.mean(rlp.argmax(-1) == lp.argmax(-1)))
                same.append(gen == rgen)
            b, k = np.array(bits), np.array(kls)
            bl, bh = boot(b, rng)
            kl, kh = boot(k, rng)
            rows.append(f"| {loops} | {m} | {b.mean():.3f} [{bl:.3f}, {bh:.3f}] | {k.mean():.4f} "
                        f"[{kl:.4f}, {kh:.4f}] | {100 * np.mean(top1):.1f}% | {sum(same)}/{len(same)} |")
            print(rows[-1], flush=True)
    return rows


def decode_speed(model, repeats: int) -> list[str]:
    c = model.weights.config
    loops, ctx, new = c.default_loops, c.max_seq_len, 64
    budget = 4 * ctx * KS.bytes_per_token(c, loops, "full")
    val = pydoc_split()[1].astype(np.int32)
    rows = ["| mode | bytes a token | rows the budget fits | tok/s at 1 row | tok/s at those rows |",
            "|---|---|---|---|---|"]
    for m, mm in each_mode(model, loops):
        bpt = KS.bytes_per_token(c, loops, m)
        n = min(64, budget // (ctx * bpt))
        speeds = []
        for rows_n in (1, n):
            prompts = [val[i * 97:i * 97 + 64].tolist() for i in range(rows_n)]
            mm.generate_batch(prompts, max_tokens=new, loops=loops)  # (compiles)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                mm.generate_batch(prompts, max_tokens=new, loops=loops)
                ts.append(time.perf_counter() - t0)
            speeds.append(rows_n * new / float(np.median(ts)))
        rows.append(f"| {m} | {bpt:,} | {n} | {speeds[0]:.0f} | {speeds[1]:.0f} |")
        print(rows[-1], flush=True)
    return rows, budget


def engine_table(model, repeats: int, n_requests: int = 24, new: int = 128) -> tuple[list[str], int]:
    """Each mode's engine at the budget of 4 full-mode rows of the whole context."""
    c = model.weights.config
    loops, P = c.default_loops, 16
    val = pydoc_split()[1].astype(np.int32)
    prompts = [val[i * 97:i * 97 + 64].tolist() for i in range(n_requests)]
    budget = None
    rows = ["| mode | pages (KiB each) | pass slots (KiB each) | whole-context rows the pages hold | "
            "tok/s greedy | tok/s t=0.8 | mean rows a step (greedy) |", "|---|---|---|---|---|---|---|"]
    for m, mm in each_mode(model, loops, ("full", "last", "ring:2", "avg")):
        if budget is None:  # (the full mode's: 4 rows of the whole context beside the request rows)
            with tl.Engine(mm, max_batch=n_requests, memory_budget=None) as probe:
                b = probe.budget
                budget = b.rows_nbytes() + 4 * -(-c.max_seq_len // P) * b.page_nbytes(loops)
        with tl.Engine(mm, max_batch=n_requests, memory_budget=budget, prefill_chunk=64) as engine:
            b = engine.budget
            n = b.pool_pages(loops)
            speeds, mean_rows = [], 0.0
            for temperature in (0.0, 0.8):
                def one_round():
                    hs = [engine.submit(p, max_tokens=new, loops=loops, temperature=temperature, seed=i)
                          for i, p in enumerate(prompts)]
                    for h in hs:
                        h.result()
                one_round()  # (compiles)
                before = engine.stats()
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    one_round()
                    ts.append(time.perf_counter() - t0)
                after = engine.stats()
                speeds.append(n_requests * new / float(np.median(ts)))
                if temperature == 0.0:
                    steps = after["decode_steps"] - before["decode_steps"]
                    mean_rows = (after["batch_rows"] - before["batch_rows"]) / max(steps, 1)
            slots = b.prompt_slots(n)
        whole = n // -(-c.max_seq_len // P)
        rows.append(f"| {m} | {n} ({b.page_nbytes(loops) / 1024:.1f}) | "
                    f"{'-' if slots is None else f'{slots} ({b.pass_nbytes(loops) / 1024:.1f})'} | {whole} | "
                    f"{speeds[0]:.0f} | {speeds[1]:.0f} | {mean_rows:.1f} |")
        print(rows[-1], flush=True)
        print(f"engine {m} greedy: {speeds[0]:.1f} tok/s", flush=True)
    return rows, budget


def engine_section(model, repeats: int) -> None:
    c = model.weights.config
    rows, budget = engine_table(model, repeats)
    head = _report.heading("KV shared across loops: the engine (`scripts/bench_kv_share.py --engine`)")
    body = "\n".join(head + [
        f"One `tl.Engine` a mode, the bundled model at its default depth {c.default_loops}, memory_budget = "
        f"{budget / 2**20:.2f} MiB (4 full-mode rows of the whole {c.max_seq_len}-position context beside 24 "
        "request rows). A compact mode keeps every page's loop layers compact and prompts in flight (and "
        "cached prefixes) at every pass in pass slots, a quarter as many as pages. 24 requests at once, each "
        "64 held-out bytes and 128 new tokens (no stop), greedy and sampled (temperature 0.8, top_k 50): "
        "tokens/s, median of 5 rounds after one that compiles; the mean rows a decode step ran (greedy).",
        "", *rows, ""])
    print(_report.write_section("KV shared across loops: the engine", body))


def exits_table(model, loops: int, windows: int, prompt_len: int, n: int, threshold: float) -> list[str]:
    """Adaptive exits (exit_criterion kl) on each mode's compact store (`generate`, which equals
    the naive store with exits: tests/test_kv_share.py): passes per token and the greedy tokens
    against full's with the same exits."""

    val = pydoc_split()[1].astype(np.int32)
    starts = [i * (len(val) // windows) for i in range(windows)]
    kw = dict(max_tokens=n, loops=loops, exit_criterion="kl", exit_threshold=threshold)
    rows = [f"| mode | passes a token (of {loops}) | tokens = full's (all {n}) | first difference at (mean) |",
            "|---|---|---|---|"]
    ref = None
    for m, mm in each_mode(model, loops):
        got, passes = [], []
        for s in starts:
            prompt = val[s:s + prompt_len].tolist()
            got.append(mm.generate(prompt, **kw)[prompt_len:])
            passes += mm.last_passes
        ref = got if ref is None else ref
        first = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), n) for g, r in zip(got, ref)]
        rows.append(f"| {m} | {np.mean(passes):.2f} | {sum(g == r for g, r in zip(got, ref))}/{len(got)} | "
                    f"{np.mean(first):.1f} |")
        print(rows[-1], flush=True)
    return rows


def ouro_section(path: str, quick: bool) -> None:
    """The quality table and exits on a second looped model trained at a fixed depth (Ouro-like)."""
    model = tl.Model.load(path)
    c = model.weights.config
    q = quality(model, [c.default_loops], 2 if quick else 8, 64, 16 if quick else 128, 8 if quick else 32)
    ex = exits_table(model, c.default_loops, 2 if quick else 8, 64, 32, 0.05)
    if quick:
        return
    body = "\n".join(_report.heading("KV shared across loops, token by token: an Ouro-like model "
                                     "(`scripts/bench_kv_share.py --ouro`)") + [
        f"`{path}`: trained by `scripts/train_tiny.py` at a fixed depth of {c.default_loops} with the whole "
        f"stack looped ({c.loop_blocks} blocks, no pre or coda blocks, d {c.d_model}; its model card has the "
        "command), as Ouro trains its 4 loops. The same measurement as the bundled model's table: 8 held-out "
        "windows, 64 bytes prompted (every pass), 128 bytes fed one at a time through the decode path, a "
        "32-token greedy continuation; 95% intervals by bootstrap over the windows.", "", *q, "",
        "Adaptive exits (`exit_criterion=\"kl\"`, threshold 0.05) on each mode's compact store, 32 greedy "
        "tokens after each window's 64 bytes: passes run a token, and the tokens against full's with the same "
        "exits.", "", *ex, ""])
    print(_report.write_section("KV shared across loops: an Ouro-like model", body, "quality.md"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engine", action="store_true", help="the engine part alone (its section written)")
    ap.add_argument("--ouro", default=None, metavar="PATH",
                    help="the quality and exits tables of a second looped model (trained at a fixed depth) alone")
    ap.add_argument("--no-write", action=_report.NoWrite)
    args = ap.parse_args()
    if args.ouro:
        ouro_section(args.ouro, args.quick)
        return
    model = tl.Model.load(BUNDLED)
    c = model.weights.config
    if args.engine:
        engine_section(model, 5)
        return
    loops_list = [1, 2, 4, 8, 16, 32]
    gib = 2 ** 30
    sizes = ["| model (loops) | mode | bytes a token | tokens in 1 GiB | whole-context rows in 1 GiB |",
             "|---|---|---|---|---|"]
    for name, cfg, loops, ctx in (("bundled (6)", c, 6, c.max_seq_len), ("Huginn-0125 (32)", HUGINN, 32, 4096),
                                  ("Ouro-1.4B (4)", OURO, 4, 4096)):
        for m in MODES:
            if fits(m, loops):
                b = KS.bytes_per_token(cfg, loops, m)
                sizes.append(f"| {name} | {m} | {b:,} | {gib // b:,} | {gib // (b * ctx):,} (of {ctx}) |")
    tables = (bytes_table(c, "bundled: KiB a token at loops", loops_list) + [""]
              + bytes_table(HUGINN, "Huginn-0125: KiB a token at loops", loops_list) + [""]
              + bytes_table(OURO, "Ouro-1.4B: KiB a token at loops", [1, 2, 4, 8]))
    print("\n".join(tables + [""] + sizes), flush=True)
    speed, budget = decode_speed(model, 1 if args.quick else 3)
    q = quality(model, [2, 4] if args.quick else [1, 2, 4, 6, 8, 16], 2 if args.quick else 8, 64,
                16 if args.quick else 128, 8 if args.quick else 32)
    if args.quick:
        return
    head = _report.heading("KV shared across loops (`scripts/bench_kv_share.py`)")
    body = "\n".join(head + [
        "Bytes a finished token holds (its K/V in the model's mode; pre and coda blocks one layer each, "
        "the loop blocks `slots(loops)` each: full = loops, ring:m = m, last / avg / first = 1; "
        "'-' where m does not divide the loops):", "", *tables, "", *sizes, "",
        f"Decode (`generate_batch`, the bundled model at its default depth {c.default_loops}, greedy, 64 new "
        f"tokens after 64 held-out bytes, median of 3): at one row, and at the rows whose whole context "
        f"({c.max_seq_len} positions) each mode's decode pages fit in the budget of 4 full-mode rows "
        f"({budget / 2**20:.1f} MiB; capped at 64). The prompts' prefill holds every pass while it runs "
        f"(the call's pool is collapsed after it).", "", *speed, ""])
    print(_report.write_section("KV shared across loops", body))
    qbody = "\n".join(_report.heading("KV shared across loops, token by token (`scripts/bench_kv_share.py`)") + [
        "The bundled model; 8 held-out windows of the validation split: 64 bytes prompted (every pass), "
        "then 128 bytes fed one at a time through the decode path; a 32-token greedy continuation "
        "after the same prompts. The cache is the naive store `generate`'s compact store equals "
        "(tests/test_kv_share.py). 95% intervals: bootstrap over the windows.", "", *q, ""])
    print(_report.write_section("KV shared across loops", qbody, "quality.md"))


if __name__ == "__main__":
    main()
