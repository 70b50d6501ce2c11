"""The main job on a random-weights model: generate, then serve requests off one prefix.

    python scripts/demo.py [--prompt 256] [--requests 4] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tinyloop_jax as tl


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--loops", type=int, default=4)
    args = ap.parse_args()

    cfg = tl.ModelConfig(vocab_size=1024, d_model=256, n_heads=4, n_pre_blocks=2, default_loops=args.loops,
                         max_seq_len=1024)
    model = tl.Model.random(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt)
    print(f"model: {model.config()}")

    model.generate(prompt, max_tokens=args.max_tokens)  # compile once; timings below are warm
    out, ms = timed(lambda: model.generate(prompt, max_tokens=args.max_tokens))
    print(f"\ngenerate: {args.prompt}-token prompt + {len(out) - args.prompt} tokens in {ms:.1f} ms")
    print("  emitted:", out[args.prompt:])

    warm = model.build_prefix_cache(prompt)  # compile the prefix path too
    model.generate_from_prefix_cache(warm, suffix=rng.integers(0, cfg.vocab_size, 8), max_tokens=args.max_tokens)
    prefix, ms_prefix = timed(lambda: model.build_prefix_cache(prompt))
    print(f"\nbuild_prefix_cache: {ms_prefix:.1f} ms -> {prefix}")
    total = ms_prefix
    for i in range(args.requests):
        suffix = rng.integers(0, cfg.vocab_size, 8)
        out, ms = timed(lambda: model.generate_from_prefix_cache(prefix, suffix=suffix, max_tokens=args.max_tokens))
        total += ms
        same = out == model.generate(np.concatenate([prompt, suffix]), max_tokens=args.max_tokens)
        print(f"  request {i}: suffix {suffix.tolist()} -> {out[-args.max_tokens:][:8]}... "
              f"{ms:.1f} ms (equals a from-scratch generate: {same})")
    print(f"\nSHARED total for {args.requests} requests: {total:.1f} ms (prefix built once)")
    model.close()


if __name__ == "__main__":
    main()
