"""8-bit activations against float32 ones: the native kernel's products over SmolLM2-135M's 120
block matrices (30 x [576, 960], [576, 576], [576, 3072], [1536, 576], packed as the file packs
them and in the other 32-value formats) and its head ([49152, 576] q8_0), at 1, 4 and 16 rows (a
decode step's batch), one arm after the other in one process (`Model(activations=...)`); and
SmolLM2's prompt processing (512 tokens) with each.

    python scripts/bench_activations.py       # writes the "activations" section of docs/benchmarks.md

"int8" rounds each row's inputs to 8 bits per 32 (`qarray.round_activations`) and, where the CPU
has AVX-512 VNNI, multiplies them by Q8_0 / Q4_0 / Q4_1 blocks as integers (qmatmul.cc,
`stream_vnni`). Each product feeds the next (its first K columns), as a decode step's do. Random
weights (`qpack.random`); medians of `--repeats` calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30
WIDTH = 1536


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", default="1,4,16")
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
        sys.exit("the native kernel is not available here (XLA:CPU on one device and a C++ compiler)")

    def timed(f, *a) -> float:
        jax.block_until_ready(f(*a))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    def chain(x, ws):
        for (k, _), w in zip(SHAPES, ws):
            y = qarray.matmul(x[:, :k], w)
            x = jnp.concatenate([y, x[:, y.shape[1]:]], axis=1) if y.shape[1] < WIDTH else y[:, :WIDTH]
        return x

    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    lines = [f"`{_report.command()}` on {_report.machine()}; VNNI: "
             f"{'yes' if 'avx512_vnni' in open('/proc/cpuinfo').read() else 'no'}. Milliseconds per call, "
             f"medians of {args.repeats}; the ratio is float32 / int8.", "",
             "| weights | rows | float32 activations, ms | 8-bit activations, ms | speedup |", "|---|---|---|---|---|"]
    # prompt processing on the real model first (a 512-token prompt through `build_prefix_cache`;
    # measured after the matrices' arms it read 891 against 1209-1220 tok/s alone: their
    # programs and weights still held)
    import tinyloop_jax as tl
    ids = rng.integers(100, 40000, 512).astype(np.int32)
    pp = {}
    for act in qarray.ACTIVATIONS:
        model = tl.Model.from_pretrained("smollm2", activations=act)
        pp[act] = 512 / (timed(lambda m=model: np.asarray(m.build_prefix_cache(ids).logits)) / 1e3)
        model = None
        jax.clear_caches()
    prefill_line = [f"SmolLM2-135M-Instruct as shipped, a 512-token prompt (`build_prefix_cache`): "
                    f"{pp['float32']:.0f} tok/s with float32 activations, {pp['int8']:.0f} with 8-bit ones "
                    f"({pp['int8'] / pp['float32']:.2f}x)."]
    print(prefill_line[0], flush=True)
    for fmt in ("q4_1", "q4_0", "q8_0", "head q8_0"):
        if fmt == "head q8_0":
            head = qarray.tile(qpack.random("q8_0", 576, 49152, seed=1, transposed=True))
            arms = {a: qarray.with_activations({"w": head}, a)["w"] for a in qarray.ACTIVATIONS}
            f = jax.jit(qarray.head)
            width = 576
        else:
            ws = [qarray.tile(qpack.random(fmt, k, n, seed=i)) for i, (k, n) in enumerate(SHAPES)]
            arms = {a: qarray.with_activations(ws, a) for a in qarray.ACTIVATIONS}
            f = jax.jit(chain)
            width = WIDTH
        for r in rows:
            x = jnp.asarray(rng.standard_normal((r, width)).astype(np.float32))
            ms = {a: timed(f, x, w) for a, w in arms.items()}
            label = fmt if fmt.startswith("head") else f"120 block matrices, {fmt}"
            lines.append(f"| {label} | {r} | {ms['float32']:.2f} | {ms['int8']:.2f} | "
                         f"{ms['float32'] / ms['int8']:.2f}x |")
            print(lines[-1], flush=True)
    lines += ["", *prefill_line]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print("wrote", _report.write_section(
            "activations", "## 8-bit activations: the packed products at 1 / 4 / 16 rows (issue 46)\n\n" + body))


if __name__ == "__main__":
    main()
