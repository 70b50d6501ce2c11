"""Record the outputs of a fixed set of public calls, or compare them with a recording.

    python scripts/compare_outputs.py --write before.npz       # on one version of the code
    python scripts/compare_outputs.py --against before.npz     # on another: tokens must be identical

Calls (public API only, so any version of the code runs them): tiny random models in several KV
modes, depths and windows — next-token logits from scratch and through a prefix, greedy
`generate`, `generate_from_prefix_cache` with a suffix, the batched call, speculative greedy —
and the bundled model's greedy text. The comparison prints the largest logit difference and
every token mismatch; it exits 1 if any greedy token differs or a logit differs by more than
--atol.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

import tinyloop_jax as tl

TINY = dict(vocab_size=128, d_model=32, n_heads=4, n_pre_blocks=2, default_loops=3, max_seq_len=256)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, n).astype(np.int32)


def record() -> dict[str, np.ndarray]:
    out = {}
    for mode in ("fp32", "fp16", "int8", "int4", "int8-h", "int4-h"):
        model = tl.Model.random(tl.ModelConfig(**TINY, kv_mode=mode), seed=0)
        for loops, window in ((1, 0), (3, 6), (8, 0), (8, 9)):
            key = f"{mode}/L{loops}/W{window}"
            p = prompt(40, loops + window)
            out[key + "/logits"] = model.next_token_logits(p, loops=loops, cache_window=window)
            out[key + "/generate"] = np.array(model.generate(p, max_tokens=24, loops=loops, cache_window=window))
            prefix = model.build_prefix_cache(p[:30], loops=loops, cache_window=window)
            out[key + "/prefix_logits"] = model.next_token_logits_from_prefix(prefix, p[30:])
            out[key + "/from_prefix"] = np.array(model.generate_from_prefix_cache(prefix, suffix=p[30:], max_tokens=16))
            batch = model.generate_batch_from_prefix_cache(prefix, [p[30:], p[30:33], []], max_tokens=12)
            out[key + "/batch"] = np.concatenate([np.array(b) for b in batch])
            if loops > 1:
                out[key + "/speculative"] = np.array(model.generate(p, max_tokens=20, loops=loops, cache_window=window,
                                                                    draft_loops=1, lookahead=3))
        jax.clear_caches()  # older versions compile a program per depth: do not hold them all
    from tinyloop_jax.cli import BUNDLED
    bundled = tl.Model.load(BUNDLED, kv_mode="fp32")
    text = tl.ByteTokenizer().encode('The "with" statement\n********************\n\n')
    out["bundled/generate"] = np.array(bundled.generate(text, max_tokens=120))
    out["bundled/logits"] = bundled.next_token_logits(text)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write")
    ap.add_argument("--against")
    ap.add_argument("--atol", type=float, default=1e-5)
    args = ap.parse_args()
    got = record()
    if args.write:
        np.savez(args.write, **got)
        print(f"wrote {len(got)} outputs to {args.write}")
    if args.against:
        want = dict(np.load(args.against))
        bad, worst = [], 0.0
        for k, w in want.items():
            g = got[k]
            if "logits" in k:
                d = float(np.max(np.abs(g - w)))
                worst = max(worst, d)
                if d > args.atol:
                    bad.append(f"{k}: max |Δlogit| {d:.2e}")
            elif g.shape != w.shape or not np.array_equal(g, w):
                bad.append(f"{k}: tokens differ")
        print(f"{len(want)} outputs compared; largest logit difference {worst:.2e}; {len(bad)} mismatches")
        for b in bad:
            print("  " + b)
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
