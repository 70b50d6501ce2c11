"""Each layer's cache sized by its window: Gemma 3 270M's prefix caches with its 15 local layers
held as rings of their window (512 positions: 512 slots) against every layer holding the whole
prompt (`TINYLOOP_LAYER_RINGS=0`, the other arm), side by side in one process.

    python scripts/bench_layer_windows.py      # writes the "layer-windows" section of docs/benchmarks.md

Per prompt length: the prefix's bytes, building it (`build_prefix_cache`), reading it with a
16-token suffix on the dense path (`next_token_logits_from_prefix`) and generating 16 tokens from
it on the paged path (`generate_from_prefix_cache`), medians; and the two arms' logits and tokens
compared (they must agree: a ring drops only positions no query can see).

Then the engine (`tl.Engine`, one memory budget for both arms): its pool (pages for every
layer, or pages for the global layers beside local slots for the local ones, which follow each
row's window), and a load of `--requests` prompts of `--prompt` tokens answered with `--answer`
greedy tokens each, all in flight together: tokens per second, and the same tokens in both arms.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--answer", type=int, default=200)
    args = ap.parse_args()
    import numpy as np

    import tinyloop_jax as tl
    from _report import command, machine, median_time, write_section

    model = tl.Model.from_pretrained(args.model, kv_mode="fp16")
    c = model.weights.config
    rng = np.random.default_rng(0)
    rows = []
    for n in map(int, args.lengths.split(",")):
        prompt = rng.integers(100, c.vocab_size - 100, n).astype(np.int32)
        suffix = rng.integers(100, c.vocab_size - 100, 16).astype(np.int32)
        arms = {}
        for arm, flag in (("whole", "0"), ("rings", "1")):
            os.environ["TINYLOOP_LAYER_RINGS"] = flag
            t0 = time.perf_counter()
            prefix = model.build_prefix_cache(prompt)
            first = time.perf_counter() - t0
            build = median_time(lambda: model.build_prefix_cache(prompt).cache.length.block_until_ready(),
                                args.repeats, warmup=0)
            read = median_time(lambda: model.next_token_logits_from_prefix(prefix, suffix), args.repeats)
            gen = median_time(lambda: model.generate_from_prefix_cache(prefix, suffix=suffix, max_tokens=16),
                              args.repeats)
            arms[arm] = dict(bytes=prefix.nbytes, first=first, build=build, read=read, gen=gen,
                             logits=model.next_token_logits_from_prefix(prefix, suffix),
                             tokens=model.generate_from_prefix_cache(prefix, suffix=suffix, max_tokens=16))
            print(n, arm, {k: v for k, v in arms[arm].items() if k not in ("logits", "tokens")}, flush=True)
        w, r = arms["whole"], arms["rings"]
        diff = float(np.max(np.abs(w["logits"] - r["logits"])))
        rows.append((n, w, r, diff, w["tokens"] == r["tokens"]))
    served = {}
    load = [rng.integers(100, c.vocab_size - 100, args.prompt).astype(np.int32) for _ in range(args.requests)]
    for arm, flag in (("whole", "0"), ("local", "1")):
        os.environ["TINYLOOP_LAYER_RINGS"] = flag
        with tl.Engine(model, max_batch=args.requests, memory_budget=args.budget_mib * 2**20) as eng:
            eng.submit(load[0][:40], max_tokens=4).result()  # the programs compiled before the clock
            t0 = time.perf_counter()
            tokens = [h.result() for h in [eng.submit(q, max_tokens=args.answer) for q in load]]
            wall = time.perf_counter() - t0
            st = eng.stats()
        pages = next(iter(st["pages"].values()))
        served[arm] = dict(wall=wall, tok_s=args.requests * args.answer / wall, pages=pages["total"],
                           slots=pages.get("local_slots"), reclaimed=pages.get("local_reclaimed"),
                           bytes=st["memory_bytes"], tokens=tokens)
        print(arm, {k: v for k, v in served[arm].items() if k != "tokens"}, flush=True)
    os.environ.pop("TINYLOOP_LAYER_RINGS")

    mib = lambda b: b / 2**20  # noqa: E731
    lines = [f"`{command()}` on {machine()}; {args.model}, fp16 KV, {c.n_pre_blocks + c.loop_blocks} layers "
             f"(windows {sorted(set(c.layer_windows))}); medians of {args.repeats}, seconds.", "",
             "| prompt | arm | prefix MiB | build s | suffix of 16, dense s | 16 tokens from it, paged s |",
             "|---|---|---|---|---|---|"]
    for n, w, r, diff, same in rows:
        for name, a in (("every layer whole", w), ("local layers as rings", r)):
            lines.append(f"| {n} | {name} | {mib(a['bytes']):.1f} | {a['build']:.2f} | {a['read']:.3f} | "
                         f"{a['gen']:.3f} |")
        lines.append(f"| {n} | rings / whole | {r['bytes'] / w['bytes']:.2f}x | {r['build'] / w['build']:.2f}x | "
                     f"{r['read'] / w['read']:.2f}x | {r['gen'] / w['gen']:.2f}x |")
    lines += [""] + [f"- {n} tokens: logits of the two arms differ by at most {diff:.2e}; 16 greedy tokens "
                     f"{'identical' if same else 'DIFFER'}" for n, w, r, diff, same in rows]
    P = 16
    w, lo = served["whole"], served["local"]
    lines += ["", f"The engine, `memory_budget` {args.budget_mib} MiB, {args.requests} requests of {args.prompt} "
              f"prompt tokens and {args.answer} greedy answer tokens, all in flight:", "",
              "| engine pool | pages (every layer / global layers) | local slots | tokens the pages hold | "
              "pool and rows MiB | answer tok/s |", "|---|---|---|---|---|---|",
              f"| every layer on pages | {w['pages']} | | {w['pages'] * P} | {mib(w['bytes']):.1f} | "
              f"{w['tok_s']:.1f} |",
              f"| local layers in slots (window) | {lo['pages']} | {lo['slots']} ({lo['reclaimed']} taken back from "
              f"idle pages) | {lo['pages'] * P} | {mib(lo['bytes']):.1f} | {lo['tok_s']:.1f} |",
              "", f"- answers of the two engine arms {'identical' if w['tokens'] == lo['tokens'] else 'DIFFER'}"]
    body = "## Each layer's cache sized by its window (issue 47)\n\n" + "\n".join(lines)
    print(body)
    if not args.no_write:
        print("wrote", write_section("layer-windows", body))


if __name__ == "__main__":
    main()
