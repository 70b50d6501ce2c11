"""Loop-native features on the bundled trained model: self-speculative decoding and
depth-flexible prefixes.

    python scripts/bench_loops.py            # ~3 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_loops.py --quick    # a smoke run, nothing written

Speculative: greedy decoding at depth L = 8 from held-out prompts (64 bytes, 128 new tokens),
plain vs `draft_loops=d, lookahead=k`; outputs checked identical; acceptance = drafts kept /
drafts made; tokens/s from the median wall time of the whole `generate` call.
Depth: time to get a depth-8 prefix of a 192-byte prompt by building it from scratch vs
`at_depth(8)` from a depth-4 prefix with kept state, and the shallower views.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.cli import BUNDLED  # noqa: E402
from tinyloop_jax.data import pydoc_split  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print the table only (an A/B run)")
    args = ap.parse_args()
    if args.quick:
        args.new, args.prompts = 16, 1
    repeats = 1 if args.quick else 3
    model = tl.Model.load(BUNDLED, kv_mode="fp32")
    val = pydoc_split()[1]
    prompts = [val[i * 2048: i * 2048 + 64].astype(np.int32) for i in range(args.prompts)]
    L = args.loops
    configs = [(d, k) for d in (1, 2, 4) for k in (2, 4)]
    plain = [model.generate(p, max_tokens=args.new, loops=L) for p in prompts]
    t_plain = _report.median_time(lambda: [model.generate(p, max_tokens=args.new, loops=L) for p in prompts], repeats)
    rows = []
    for i, (d, k) in enumerate(configs):
        _report.progress(i, len(configs), f"d={d} k={k}")
        drafted = accepted = 0
        for p, want in zip(prompts, plain):
            got = model.generate(p, max_tokens=args.new, loops=L, draft_loops=d, lookahead=k)
            assert got == want, f"speculative d={d} k={k} differs from plain greedy"
            drafted += model.last_speculation["drafted"]
            accepted += model.last_speculation["accepted"]
        t = _report.median_time(lambda: [model.generate(p, max_tokens=args.new, loops=L, draft_loops=d,  # noqa: B023
                                                        lookahead=k) for p in prompts], repeats)  # noqa: B023
        rows.append((d, k, accepted / drafted, t))
    _report.progress(len(configs), len(configs), "depth")

    prompt = val[4096: 4096 + 192].astype(np.int32)
    model.build_prefix_cache(prompt, loops=4, keep_state=True).at_depth(L)  # compile
    model.build_prefix_cache(prompt, loops=L)
    t_build = _report.median_time(lambda: model.build_prefix_cache(prompt, loops=L), repeats + 2)
    t_build4 = _report.median_time(lambda: model.build_prefix_cache(prompt, loops=4, keep_state=True), repeats + 2)
    shallow = model.build_prefix_cache(prompt, loops=4, keep_state=True)
    t_deeper = _report.median_time(lambda: shallow.at_depth(L), repeats + 2)
    deep = model.build_prefix_cache(prompt, loops=L)
    deep.at_depth(2)
    t_view = _report.median_time(lambda: deep.at_depth(2), repeats + 2)

    n_tok = args.new * len(prompts)
    lines = [
        "## Loop-native features: self-speculative decoding, depth-flexible prefixes (`scripts/bench_loops.py`)",
        "",
        f"Command: `{_report.command()}`  ",
        f"Machine: {_report.machine()}  ",
        f"Model: bundled `{os.path.relpath(BUNDLED)}` (fp32), depth L = {L}, greedy. {len(prompts)} held-out prompts "
        f"of 64 bytes, {args.new} new tokens each; every speculative output was checked identical to plain "
        f"greedy. Median of {repeats}.",
        "",
        "| draft depth d | lookahead k | acceptance | tok/s | vs plain |",
        "|---|---|---|---|---|",
        f"| plain (L={L}) | – | – | {n_tok / t_plain:.1f} | 1.00× |",
    ]
    for d, k, acc, t in rows:
        lines.append(f"| {d} | {k} | {100 * acc:.1f}% | {n_tok / t:.1f} | {t_plain / t:.2f}× |")
    lines += [
        "",
        f"Depth-flexible prefix of a 192-byte prompt: build at depth {L} from scratch {t_build * 1e3:.1f} ms; "
        f"build at depth 4 keeping state {t_build4 * 1e3:.1f} ms, then `at_depth({L})` {t_deeper * 1e3:.1f} ms "
        f"(runs passes 5..{L} only); `at_depth(2)` of the depth-{L} prefix {t_view * 1e3:.2f} ms (a view of the "
        "first passes of the same arrays, and one LayerNorm + head).",
    ]
    print("\n".join(lines))
    # metric lines (`scripts/bench.py ab` compares them)
    print(f"plain L={L}: {n_tok / t_plain:.1f} tok/s")
    for d, k, acc, t in rows:
        print(f"speculative d={d} k={k}: {n_tok / t:.1f} tok/s")
    print(f"at_depth({L}) from depth 4: {t_deeper * 1e3:.2f} ms")
    if not (args.quick or args.no_write):
        print("wrote", _report.write_section("bench_loops", "\n".join(lines)))


if __name__ == "__main__":
    main()
