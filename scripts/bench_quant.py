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

    python scripts/bench_quant.py --set gemma3   # the "quant-matmul-gemma3" section (issue 47)

Gemma 3 270M's 18 layers of block matrices (q [640, 1024], k, v [640, 256], o [1024, 640],
gate, up [640, 2048], down [2048, 640]): float32; as its Q4_K_M file stores them (q, k, v,
gate, up Q5_0 (640 is no multiple of a K-quant's 256), o Q4_K, down Q4_K and every third
layer Q6_K, as llama.cpp's Q4_K_M picks); all q8_0; and each packed format alone on the
matrices its block fits (o and down: K = 1024, 2048). Random weights (`qpack.random`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30
GEMMA3 = [(640, 1024), (640, 256), (640, 256), (1024, 640), (640, 2048), (640, 2048), (2048, 640)] * 18
STEPS = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--set", choices=["smollm2", "gemma3"], default="smollm2")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import _report
    from tinyloop_jax import native
    from tinyloop_jax.model import qarray
    from tinyloop_jax.model import qpack

    if not native.available():
        sys.exit("the native kernel is not available here (see tinyloop_jax/native)")

    rng = np.random.default_rng(0)
    shapes = GEMMA3 if args.set == "gemma3" else SHAPES
    width = max(k for k, _ in shapes)
    floats = [jnp.asarray(rng.standard_normal(s).astype(np.float32) / 24) for s in shapes]

    def program(tile):
        @jax.jit
        def f(x, ws):
            def step(_, x):  # x [T, width]: each matrix reads the first K columns, the next its output
                y = x
                for w in ws:
                    h = y[:, :w.shape[0]]
                    p = h @ qarray.dense(w) if tile == "xla" else qarray.matmul(h, w, tile=tile)
                    y = jnp.concatenate([p, y], axis=-1)[:, :width]
                return x + 1e-3 * y
            return jax.lax.fori_loop(0, STEPS, step, x)
        return f

    lines = [f"Command: `{_report.command()}`. Machine: {_report.machine()}. {len(shapes)} matrices a step, "
             f"{STEPS} steps per call; medians of {args.repeats}.", "",
             "| weights | MiB | T = 1: ms / step | vs float32 | T = 128: ms / step | vs float32 | first call s |",
             "|---|---|---|---|---|---|---|"]
    arms = [("float32", floats, None)]
    if args.set == "gemma3":
        def fmt_of(i, k):  # llama.cpp's Q4_K_M for Gemma 3 270M: K-quants where 256 divides K
            layer, kind = divmod(i, 7)
            return "q5_0" if k == 640 else "q4_k" if kind == 3 or layer % 3 else "q6_k"
        mix = [qarray.tile(qpack.random(fmt_of(i, k), k, n, seed=i)) for i, (k, n) in enumerate(shapes)]
        arms += [("as Gemma 3 270M Q4_K_M stores them", mix, None),
                 ("q8_0", [qarray.tile(qpack.random("q8_0", k, n, seed=i)) for i, (k, n) in enumerate(shapes)], None)]
        shapes_k = [s for s in shapes if s[0] % 256 == 0]  # o and down
        lines2 = [f"Each format alone on the {len(shapes_k)} o and down matrices (K = 1024, 2048), native kernel:", "",
                  "| weights | MiB | T = 1: ms / step | vs float32 | T = 128: ms / step | vs float32 | first call s |",
                  "|---|---|---|---|---|---|---|"]
        sub = [("float32", [jnp.asarray(rng.standard_normal(s).astype(np.float32) / 24) for s in shapes_k], None)]
        sub += [(fmt, [qarray.tile(qpack.random(fmt, k, n, seed=i)) for i, (k, n) in enumerate(shapes_k)], None)
                for fmt in qarray.FORMATS]
        run_arms(program, sub, lines2, args.repeats, width)
        run_arms(program, arms, lines, args.repeats, width)
        body = "\n".join(lines + [""] + lines2)
        print(body)
        if not args.no_write:
            print("wrote", _report.write_section("quant-matmul-gemma3", "## Packed K-quants and Q5: Gemma 3 270M's "
                                                 "block matrices on XLA:CPU (issue 47)\n\n" + body))
        return
    for fmt in ("q4_1", "q8_0"):
        packed = [qpack.quantize(w, fmt) for w in floats]
        arms += [(f"{fmt}, native kernel", [qarray.tile(w) for w in packed], None),  # as a Model holds them
                 (f"{fmt}, XLA: whole matrix dequantized", packed, "xla")]
        if fmt == "q4_1":
            arms += [(f"{fmt}, tiles of 512 KiB", packed, 1 << 17), (f"{fmt}, tiles of 4 MiB", packed, 1 << 20)]
    run_arms(program, arms, lines, args.repeats, 1536)
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print("wrote", _report.write_section("quant-matmul", "## Packed weights: a decode step's matmuls on XLA:CPU "
                                             "(issue 23)\n\n" + body))


def run_arms(program, arms, lines, repeats, width):
    """Each arm's ms / step at T = 1 and 128 (and against the first arm), a table row each."""
    import jax.numpy as jnp

    import _report
    base = {}
    for name, ws, tile in arms:
        f, cells, first = program(tile), [], 0.0
        for t in (1, 128):
            x = jnp.ones((t, width), jnp.float32)
            start = time.perf_counter()
            f(x, ws).block_until_ready()
            first += time.perf_counter() - start
            sec = _report.median_time(lambda x=x: f(x, ws).block_until_ready(), repeats, warmup=0) / STEPS
            base.setdefault(t, sec)
            cells += [f"{sec * 1e3:.1f}", f"{base[t] / sec:.2f}x"]
        lines.append(f"| {name} | {sum(w.nbytes for w in ws) / 2**20:.1f} | " + " | ".join(cells) + f" | {first:.1f} |")
        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
