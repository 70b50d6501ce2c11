"""A user's speed, this checkout's code against another checkout's: SmolLM2 (float32, the
default XLA flags) prefilling prompts into a prefix cache, a short suffix over a long prefix,
and decoding greedy and sampled, each tree in its own fresh processes, alternating, medians.

    python scripts/bench_code_ab.py --tree /path/to/other/checkout [--runs 3]

Each run is a new process (its first calls compile; the timed calls after that do not), with
the tree's tinyloop_jax first on the path. Prefill: `build_prefix_cache` of 64, 512 and 1,536
tokens; reuse: `generate_from_prefix_cache` with a 16-token suffix and 1 new token over the
1,536-token prefix; decode: 64 new tokens after a 64-token prompt, greedy and sampled
(temperature 0.8, top_p 0.9), as tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, statistics, sys, time
import numpy as np
import tinyloop_jax as tl
m = tl.Model.from_pretrained("smollm2", kv_mode="fp32", dtype="float32", quantize_weights="float")
rng = np.random.default_rng(0)
ids = rng.integers(100, 40000, 1600).astype(np.int32)
out = {}
def timed(key, f, reps=5):
    f()  # compiles
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    out[key] = statistics.median(ts)
for n in (64, 512, 1536):
    timed(f"prefill {n} s", lambda n=n: np.asarray(m.build_prefix_cache(ids[:n]).logits))
long = m.build_prefix_cache(ids[:1536])
timed("16-token suffix over 1536 s", lambda: m.generate_from_prefix_cache(long, suffix=ids[1536:1552], max_tokens=1))
for name, kw in (("greedy", {}), ("sampled", dict(temperature=0.8, top_p=0.9, seed=1))):
    timed(f"decode {name} s", lambda kw=kw: m.generate(ids[:64], max_tokens=64, **kw), reps=3)
    out[f"decode {name} tok/s"] = 63 / out.pop(f"decode {name} s")
print(json.dumps(out))
"""


def run_once(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("XLA_FLAGS", None)  # a user's defaults
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", required=True, help="the other checkout (its tinyloop_jax is imported)")
    ap.add_argument("--runs", type=int, default=3, help="runs per tree (alternating)")
    args = ap.parse_args()
    trees = {"this checkout": ROOT, args.tree: args.tree}
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            rows[name].append(run_once(tree))
    keys = list(rows["this checkout"][0])
    print(f"{args.runs} runs per tree, alternating; medians")
    print("| measure | " + " | ".join(trees) + " | ratio |\n|---|" + "---|" * (len(trees) + 1))
    for k in keys:
        a, b = (statistics.median(r[k] for r in rows[name]) for name in trees)
        print(f"| {k} | {a:.4g} | {b:.4g} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
