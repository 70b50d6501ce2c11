"""The seed's prefix-sharing table on this machine: NO_CACHE vs SHARED, and the asymptote.

    python scripts/bench_prefix_cache.py                 # full table, every KV mode (~15 min on 2 CPUs)
    python scripts/bench_prefix_cache.py --quick         # a smoke run

Each request = a distinct 8-token suffix + 32 greedy tokens on top of a shared prefix.
NO_CACHE prefills prefix + suffix from scratch for every request; SHARED builds the prefix
once and serves all N requests from it. Both at the same loop depth, same token counts.
Asymptote = (prefill + decode) / (prefill / N + decode), from the measured time to build the
prefix (prefill) and the measured mean SHARED per-request time (decode).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.model import cache as kvc  # noqa: E402


def run_arm(fn, n):
    t = time.perf_counter()
    outs = [fn(i) for i in range(n)]
    return time.perf_counter() - t, outs


def check_outputs(model, pre, prompt, a, b) -> bool:
    """SHARED (a) vs NO_CACHE (b) tokens of one request. Identical -> True. Otherwise the two
    paths' next-token logits where they part must agree within allclose(1e-3, 1e-2) — a near
    tie that a quantization boundary tipped (quantized modes) — else this raises."""
    if a == b:
        return True
    j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
    ctx = np.asarray(a[:j], np.int32)
    np.testing.assert_allclose(model.next_token_logits_from_prefix(pre, ctx[len(prompt):]),
                               model.next_token_logits(ctx), atol=1e-3, rtol=1e-2,
                               err_msg="SHARED and NO_CACHE differ beyond a near tie")
    return False


def store_workload(model, n_requests, n_prompts, new, budget, rng):
    """n_requests prompts = one of n_prompts system prompts (Zipf popularity, 256-512 tokens)
    + a unique 16-token question; NO_CACHE `generate` vs `PrefixStore.generate`."""
    V = model.config()["vocab_size"]
    systems = [rng.integers(0, V, int(rng.integers(256, 513))).astype(np.int32) for _ in range(n_prompts)]
    pop = 1.0 / np.arange(1, n_prompts + 1) ** 1.1
    picks = rng.choice(n_prompts, n_requests, p=pop / pop.sum())
    prompts = [np.concatenate([systems[j], rng.integers(0, V, 16).astype(np.int32)]) for j in picks]
    # compile what both arms use (one request per system prompt; a store pass over the first 40)
    for j in range(n_prompts):
        model.generate(np.concatenate([systems[j], prompts[0][-16:]]), max_tokens=new)
    warm = tl.PrefixStore(model, max_bytes=budget)
    for p in prompts[:40]:
        warm.generate(p, max_tokens=new)
    t_no, out_no = run_arm(lambda i: model.generate(prompts[i], max_tokens=new), n_requests)
    store = tl.PrefixStore(model, max_bytes=budget)
    t_st, out_st = run_arm(lambda i: store.generate(prompts[i], max_tokens=new), n_requests)
    same = sum(a == b for a, b in zip(out_st, out_no))
    return dict(t_no=t_no, t_st=t_st, stats=store.stats(), same=same, picks=np.bincount(picks, minlength=n_prompts),
                tokens=sum(len(p) for p in prompts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(tl.KV_MODES), help="the seed's 'backend' column")
    ap.add_argument("--prefix", default="500,1024")
    ap.add_argument("--n", default="10,50")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--suffix", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--store-requests", type=int, default=200)
    ap.add_argument("--store-mode", default="fp16")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, no docs written")
    ap.add_argument("--no-write", action=_report.NoWrite)
    args = ap.parse_args()
    if args.quick:
        args.prefix, args.n, args.d_model, args.store_requests = "64", "3", 64, 12

    modes = args.modes.split(",")
    prefixes = [int(x) for x in args.prefix.split(",")]
    ns = [int(x) for x in args.n.split(",")]
    base = tl.ModelConfig(vocab_size=4096, d_model=args.d_model, n_heads=args.d_model // 64, n_pre_blocks=2,
                          default_loops=args.loops, max_seq_len=2048, kv_mode="fp32")
    params = tl.Model.random(base, seed=0).weights.params
    rng = np.random.default_rng(0)
    rows, total, done = [], len(modes) * len(prefixes) * len(ns), 0
    alloc_note = ""
    for mode in modes:
        model = tl.Model(params, tl.ModelConfig(**dict(base.to_dict(), kv_mode=mode)))
        for P in prefixes:
            prompt = rng.integers(0, base.vocab_size, P).astype(np.int32)
            suffixes = [rng.integers(0, base.vocab_size, args.suffix).astype(np.int32) for _ in range(max(ns))]
            kw = dict(max_tokens=args.new, loops=args.loops)
            # warm up every program both arms use (compiles are not what we measure)
            pre = model.build_prefix_cache(prompt)
            model.generate_from_prefix_cache(pre, suffix=suffixes[0], max_tokens=args.new)
            model.generate(np.concatenate([prompt, suffixes[0]]), **kw)
            prefill = _report.median_time(lambda: model.build_prefix_cache(prompt), repeats=3, warmup=0)
            for N in ns:
                _report.progress(done, total, f"{mode} prefix={P} N={N}")
                model.generate_batch_from_prefix_cache(pre, suffixes[:N], max_tokens=args.new)  # compile
                t_no, out_no = run_arm(lambda i: model.generate(np.concatenate([prompt, suffixes[i]]), **kw), N)
                t0 = time.perf_counter()
                pre = model.build_prefix_cache(prompt, loops=args.loops)
                _, out_sh = run_arm(lambda i: model.generate_from_prefix_cache(pre, suffix=suffixes[i],
                                                                              max_tokens=args.new), N)
                t_sh = time.perf_counter() - t0
                t0 = time.perf_counter()
                pre_b = model.build_prefix_cache(prompt, loops=args.loops)
                out_b = model.generate_batch_from_prefix_cache(pre_b, suffixes[:N], max_tokens=args.new)
                t_b = time.perf_counter() - t0
                same = sum(check_outputs(model, pre, prompt, a, b) for a, b in zip(out_sh, out_no))
                same_b = sum(check_outputs(model, pre, prompt, a, b) for a, b in zip(out_b, out_sh))
                decode = (t_sh - prefill) / N
                asym = (prefill + decode) / (prefill / N + decode)
                speed = t_no / t_sh
                rows.append((mode, P, N, t_no * 1e3, t_sh * 1e3, t_b * 1e3, speed, t_no / t_b, t_sh / t_b, asym,
                             speed / asym, prefill * 1e3, decode * 1e3, pre.nbytes, same, same_b))
                done += 1
                if not alloc_note:
                    c = model.weights.config
                    own = kvc.cache_nbytes(mode, c.n_cache_layers(args.loops), c.n_heads,
                                           kvc.segment_capacity(args.suffix + args.new, 0), c.head_dim)
                    alloc_note = (f"Per request, SHARED allocates only its own segment: {own / 1024:.0f} KiB "
                                  f"({mode}, room for {args.suffix}+{args.new} tokens, bucketed to "
                                  f"{kvc.segment_capacity(args.suffix + args.new, 0)} slots) plus the "
                                  f"{args.new}-token output; the prefix ({pre.nbytes / 2**20:.1f} MiB at "
                                  f"{P} tokens) is passed read-only and never copied.")
    _report.progress(total, total, "store workload")
    smodel = tl.Model(params, tl.ModelConfig(**dict(base.to_dict(), kv_mode=args.store_mode)))
    budget = 64 << 20
    st = store_workload(smodel, args.store_requests, 8, 16, budget, rng)
    s = st["stats"]

    lines = [
        "## Prefix sharing: NO_CACHE vs SHARED (`scripts/bench_prefix_cache.py`)",
        "",
        f"Command: `{_report.command()}`  ",
        f"Machine: {_report.machine()}  ",
        f"Model: random weights, n_pre_blocks=2, loops={args.loops}, D={args.d_model}, "
        f"{base.n_heads} heads, vocab {base.vocab_size}. Each request: distinct {args.suffix}-token suffix "
        f"+ {args.new} greedy tokens. *identical outputs*: requests whose SHARED and NO_CACHE tokens are "
        "identical; where they part, the script checks that both paths' logits at that step agree within "
        "allclose(1e-3, 1e-2), i.e. a near tie tipped by a quantization boundary, not a wrong cache.",
        "",
        "| mode | prefix | N | NO_CACHE ms | SHARED ms | SHARED-BATCHED ms | SHARED speedup | BATCHED speedup "
        "| BATCHED / SHARED | asymptote (sequential) | SHARED share of asymptote | prefill ms | per-request ms "
        "| prefix MiB | identical SHARED / NO_CACHE | identical BATCHED / SHARED |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, P, N, tn, ts, tb, sp, spb, bs, asym, share, pf, dc, nb, same, same_b in rows:
        lines.append(f"| {m} | {P} | {N} | {tn:,.0f} | {ts:,.0f} | {tb:,.0f} | {sp:.2f}× | {spb:.2f}× | {bs:.2f}× | "
                     f"{asym:.2f}× | {100 * share:.0f}% | {pf:,.0f} | {dc:,.0f} | {nb / 2**20:.2f} | {same}/{N} | "
                     f"{same_b}/{N} |")
    lines += ["", alloc_note, "",
              "### PrefixStore workload",
              "",
              f"{args.store_requests} requests, each one of 8 system prompts (256–512 tokens, Zipf popularity "
              f"s=1.1: request counts {st['picks'].tolist()}) + a unique 16-token question, 16 greedy tokens, "
              f"{args.store_mode}, same model. NO_CACHE = `model.generate(prompt)` per request; store = "
              f"`PrefixStore(model, max_bytes={budget >> 20} MiB).generate(prompt)` (every full prompt is inserted; "
              "LRU by bytes).",
              "",
              "| arm | wall s | requests/s | hit rate | prompt tokens reused | prompt tokens prefilled | evictions "
              "| entries / MiB at end | identical outputs |",
              "|---|---|---|---|---|---|---|---|---|",
              f"| NO_CACHE | {st['t_no']:.1f} | {args.store_requests / st['t_no']:.2f} | – | 0 | "
              f"{st['tokens']:,} | – | – | – |",
              f"| PrefixStore | {st['t_st']:.1f} | {args.store_requests / st['t_st']:.2f} | "
              f"{100 * s['hits'] / (s['hits'] + s['misses']):.1f}% | {s['tokens_reused']:,} | "
              f"{s['tokens_prefilled']:,} | "
              f"{s['evictions']} | {s['entries']} / {s['bytes'] / 2**20:.1f} | {st['same']}/{args.store_requests} |",
              "",
              f"Store throughput vs NO_CACHE: **{st['t_no'] / st['t_st']:.2f}×**."]
    print("\n".join(lines))
    if not args.quick:
        print("wrote", _report.write_section("bench_prefix_cache", "\n".join(lines)))


if __name__ == "__main__":
    main()
