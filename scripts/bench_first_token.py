"""The decode program with the first token chosen inside it (as before: [N, V] logits handed
in) against the first token handed in (`programs.first_tokens`, tokens [N]): HLO lines, lower
and compile seconds of the tiny test model's decode program, each way 4 times in one process,
alternating, medians (the suite's XLA flags; `jax.clear_caches()` before each).

    python scripts/bench_first_token.py fp32 int8-h
"""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.decoding import paged_decode as P  # noqa: E402


def decode_call(mode: str):
    """The arguments `generate` hands the decode program (caught by wrapping it)."""
    cfg = tl.ModelConfig(vocab_size=128, d_model=32, n_heads=4, n_pre_blocks=2, default_loops=3, max_seq_len=128,
                         kv_mode=mode)
    seen, real = {}, P.decode

    def spy(*a, **k):
        seen["call"] = (a, k)
        return real(*a, **k)
    P.decode = spy
    try:
        tl.Model.random(cfg, seed=0).generate(np.arange(10, dtype=np.int32), max_tokens=5)
    finally:
        P.decode = real
    return seen["call"], cfg


def main() -> None:
    for mode in sys.argv[1:] or ["fp32"]:
        (a, k), cfg = decode_call(mode)
        ways = {"logits in (before)": a[:4] + (jnp.zeros((a[4].shape[0], cfg.vocab_size), jnp.float32),) + a[5:],
                "tokens in (after)": a}
        res = {name: [] for name in ways}
        for _ in range(4):
            for name, args in ways.items():
                jax.clear_caches()
                t0 = time.perf_counter()
                low = P.decode.lower(*args, **k)
                t1 = time.perf_counter()
                text = low.compile().as_text()
                res[name].append((t1 - t0, time.perf_counter() - t1, text.count("\n")))
        for name, r in res.items():
            r = np.array(r)
            print(f"{mode:7s} {name:20s} lower {np.median(r[:, 0]):.3f} s  compile {np.median(r[:, 1]):.3f} s  "
                  f"HLO lines {int(r[0, 2])}")


if __name__ == "__main__":
    main()
