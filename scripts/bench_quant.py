"""Packed weights on XLA:CPU: `qarray.matmul` against float32 matrices, in the shape of a decode
step: SmolLM2-135M's 120 block matrices (30 x [576, 960], [576, 576], [576, 3072], [1536, 576]),
each product feeding the next, repeated by a `fori_loop` as a decode loop repeats its step.

    python scripts/bench_quant.py          # writes the "quant-matmul" section of docs/benchmarks.md

Arms: float32; each format through the native kernel (`qarray.matmul`'s default on XLA:CPU,
tinyloop_jax/native: the packed bytes read once per product, in the tiled layout a `Model` holds
them in, `qarray.tile`), through XLA with the whole matrix
dequantized per product (`x @ qarray.dense(w)`: loop-invariant, so XLA may hoist it out of the
loop), and (q4_1) in tiles of 512 KiB / 4 MiB of float32 tied to the step's input (`tile=n`:
dequantized inside every step). Reported per step
(T = 1 token: decode; T = 128: prompt processing), median of `--repeats`, and the first call
(compiling included).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30
STEPS = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import _report
    from tinyloop_jax import native
    from tinyloop_jax.model import qarray

    if not native.available():
        sys.exit("the native kernel is not available here (see tinyloop_jax/native)")

    rng = np.random.default_rng(0)
    floats = [jnp.asarray(rng.standard_normal(s).astype(np.float32) / 24) for s in SHAPES]

    def program(tile):
        @jax.jit
        def f(x, ws):
            def step(_, x):  # x [T, 1536]: each matrix reads the first K columns, the next its output
                y = x
                for w in ws:
                    h = y[:, :w.shape[0]]
                    p = h @ qarray.dense(w) if tile == "xla" else qarray.matmul(h, w, tile=tile)
                    y = jnp.concatenate([p, y], axis=-1)[:, :1536]
                return x + 1e-3 * y
            return jax.lax.fori_loop(0, STEPS, step, x)
        return f

    lines = [f"Command: `{_report.command()}`. Machine: {_report.machine()}. {len(SHAPES)} matrices a step, "
             f"{STEPS} steps per call; medians of {args.repeats}.", "",
             "| weights | MiB | T = 1: ms / step | vs float32 | T = 128: ms / step | vs float32 | first call s |",
             "|---|---|---|---|---|---|---|"]
    arms = [("float32", floats, None)]
    for fmt in ("q4_1", "q8_0"):
        packed = [qarray.quantize(w, fmt) for w in floats]
        arms += [(f"{fmt}, native kernel", [qarray.tile(w) for w in packed], None),  # as a Model holds them
                 (f"{fmt}, XLA: whole matrix dequantized", packed, "xla")]
        if fmt == "q4_1":
            arms += [(f"{fmt}, tiles of 512 KiB", packed, 1 << 17), (f"{fmt}, tiles of 4 MiB", packed, 1 << 20)]
    base = {}
    for name, ws, tile in arms:
        f, cells, first = program(tile), [], 0.0
        for t in (1, 128):
            x = jnp.ones((t, 1536), jnp.float32)
            start = time.perf_counter()
            f(x, ws).block_until_ready()
            first += time.perf_counter() - start
            sec = _report.median_time(lambda x=x: f(x, ws).block_until_ready(), args.repeats, warmup=0) / STEPS
            base.setdefault(t, sec)
            cells += [f"{sec * 1e3:.1f}", f"{base[t] / sec:.2f}x"]
        lines.append(f"| {name} | {sum(w.nbytes for w in ws) / 2**20:.1f} | " + " | ".join(cells) + f" | {first:.1f} |")
        print(lines[-1], flush=True)
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print("wrote", _report.write_section("quant-matmul", "## Packed weights: a decode step's matmuls on XLA:CPU "
                                             "(issue 23)\n\n" + body))


if __name__ == "__main__":
    main()
