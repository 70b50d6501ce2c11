"""Where the engine's warmup goes, and what the ways to shorten it would cost a user (issue 59's
"every kind warm within 60 s"):

1. warmup with every kind (`Engine.warmup(adaptive=True, speculation=((1, 4),))`, an empty
   compilation cache): seconds per program kind, with how many programs of each;
2. fewer decode buckets (a step of N rows run in a program of 2N): `generate_batch`'s decode
   step at 1, 2, 4, 8, 16 rows on SmolLM2 as served;
3. one decode program for plain and adaptive rows (plain rows in the adaptive step, every
   pass): the adaptive program with every row's rule "every pass" against the plain one, on
   SmolLM2 at 1, 4 and 16 rows.

    python scripts/profile_warmup.py [--parts warmup,rows,adaptive] [--model smollm2] [--plain]

(--model: the warmup's model, default the bundled one; --plain: the default warmup only, as
`tinyloop serve` runs it. The resident memory after it is printed too.)
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def rss_kib() -> dict:
    """This process's resident memory now (VmRSS) and at its peak (VmHWM), KiB (/proc/self/status)."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f if ln.startswith(("VmRSS", "VmHWM")))}


def rss() -> str:
    return ", ".join(f"{k} {v / 2**20:.2f} GiB" for k, v in sorted(rss_kib().items()))


def warmup_by_kind(model: str | None = None, every: bool = True) -> None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tinyloop-xla-")
    from tinyloop_jax.cli import _load, persistent_compile_cache
    from tinyloop_jax.serving.engine import Engine

    persistent_compile_cache()
    eng = Engine(_load(model, None), max_batch=16, memory_budget=256 << 20)
    print(f"loaded: {rss()}")
    made, spent = collections.Counter(), collections.Counter()
    programs = eng.batcher.jits

    def timed(loops):  # the depth's programs, each compile timed and named by its kind
        class Timed:
            def __init__(self, name, fn):
                self.name, self.fn = name, fn

            def lower(self, *a, **kw):
                t0, low = time.perf_counter(), self.fn.lower(*a, **kw)
                kind = self.name + (" (adaptive)" if kw.get("adaptive") else " (speculative)" if kw.get("lookahead")
                                    else "")

                class Compiled:
                    def compile(_):
                        out = low.compile()
                        made[kind] += 1
                        spent[kind] += time.perf_counter() - t0
                        return out
                return Compiled()
        return {k: Timed(k, v) for k, v in programs(loops).items()}

    eng.batcher.jits = timed
    t0, c0 = time.perf_counter(), time.process_time()
    n = eng.warmup(adaptive=True, speculation=((1, 4),)) if every else eng.warmup()
    wall = time.perf_counter() - t0
    print(f"warmup, {'every kind' if every else 'plain'}, {model or 'bundled model'}: "
          f"{wall:.1f} s ({n} programs, {time.process_time() - c0:.1f} s of CPU); {rss()}")
    kb = rss_kib()  # (as metric lines: `bench.py ab profile-warmup` tabulates them)
    print(f"warmup: {wall:.1f} s\nresident after warmup: {kb['VmRSS'] / 2**20:.3f} GiB\n"
          f"peak resident during warmup: {kb['VmHWM'] / 2**20:.3f} GiB")
    for kind, s in spent.most_common():
        print(f"  {kind} x {made[kind]}: {s:.1f} s")


def step_ms(model, prompts, temperature: float, **kw) -> float:
    """ms per decode step of generate_batch over these prompts (33 tokens less 1, medians of 3)."""
    run = lambda k: model.generate_batch(prompts, max_tokens=k, temperature=temperature, **kw)  # noqa: E731
    run(34), run(2)
    times = []
    for _ in range(3):
        a = time.perf_counter(); run(2); b = time.perf_counter(); run(34); c = time.perf_counter()  # noqa: E702
        times.append(((c - b) - (b - a)) / 32)
    return 1e3 * float(np.median(times))


def rows_cost() -> None:
    import tinyloop_jax as tl
    model, rng = tl.Model.from_pretrained("smollm2"), np.random.default_rng(0)
    for t in (0.0, 0.8):
        for n in (1, 2, 4, 8, 16):
            ms = step_ms(model, [list(p) for p in rng.integers(100, 4000, (n, 200))], t)
            print(f"smollm2 decode step, {n} rows, t={t}: {ms:.2f} ms")


def adaptive_cost() -> None:
    import jax
    import tinyloop_jax as tl
    from tinyloop_jax.api import functional as F
    from tinyloop_jax.decoding.sampling import Knobs, SamplingParams
    from tinyloop_jax.model import adaptive as ad

    model, rng = tl.Model.from_pretrained("smollm2"), np.random.default_rng(0)
    w = model.weights

    class EveryPass:  # generate_batch's loop with the adaptive step, every row's rule "every pass"
        def generate_batch(self, prompts, max_tokens, temperature):
            req = Knobs.from_params([SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
                                     for i in range(len(prompts))])
            pol = jax.tree.map(lambda a: np.stack([a] * len(prompts)), ad.EVERY_PASS)
            return np.asarray(F.generate(w, list(prompts), req, adaptive=F.Adaptive(pol, True)).tokens)

    for n in (1, 4, 16):
        prompts = [list(p) for p in rng.integers(100, 4000, (n, 200))]
        for t in (0.0, 0.8):
            plain, every = step_ms(model, prompts, t), step_ms(EveryPass(), prompts, t)
            print(f"smollm2 {n} rows t={t}: plain step {plain:.2f} ms, adaptive step every pass {every:.2f} ms "
                  f"({every / plain:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="warmup,rows,adaptive")
    ap.add_argument("--model", default=None, help="the warmup's model (default: the bundled one)")
    ap.add_argument("--plain", action="store_true", help="the default warmup only (as tinyloop serve's)")
    ap.add_argument("--no-write", action="store_true", help="(prints only; accepted for bench.py ab)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if "warmup" in parts:
        warmup_by_kind(args.model, not args.plain)
    for name, fn in (("rows", rows_cost), ("adaptive", adaptive_cost)):
        if name in parts:
            fn()


if __name__ == "__main__":
    main()
