"""Rows that share a system prompt's pages (issue 46's cascade attention): the native paged
attention kernel for one layer, and the engine's whole 16-row decode step on SmolLM2, where 16
rows of 400 live tokens come in 4 groups sharing their first 320 (20 pages) and own the rest.
Run it in two trees back to back to compare (one line per run, medians):

    python scripts/bench_cascade.py --label after
    PYTHONPATH=/path/to/other/tree python scripts/bench_cascade.py --label before
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import tinyloop_jax as tl
from tinyloop_jax import native
from tinyloop_jax.model import page_pool
from tinyloop_jax.serving import step as S
from tinyloop_jax.decoding import compiled, step as St

ROWS, GROUPS, SHARED, OWN = 16, 4, 20, 5  # pages: 20 shared by each group's 4 rows, 5 a row's own


def tables() -> list:
    return [list(range((r % GROUPS) * SHARED, (r % GROUPS + 1) * SHARED))
            + list(range(GROUPS * SHARED + r * OWN, GROUPS * SHARED + (r + 1) * OWN)) for r in range(ROWS)]


def median_time(f, n: int) -> float:
    times = []
    for i in range(n):
        t = time.perf_counter()
        f(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernel_ms(P: int = page_pool.PAGE_SIZE) -> float:
    """One layer of SmolLM2's shape (9 query heads over 3 KV heads of 64, fp16 pages)."""
    rng, KV, H, hd = np.random.default_rng(0), 3, 9, 64
    n_pages = GROUPS * SHARED + ROWS * OWN
    k, v = (jnp.asarray(rng.normal(size=(KV, n_pages, P, hd)).astype(np.float16)) for _ in range(2))
    table = np.zeros((ROWS, 128), np.int32)
    for r, t in enumerate(tables()):
        table[r, :len(t)] = t
    start, n_new = np.full((ROWS,), (SHARED + OWN) * P - 1, np.int32), np.ones((ROWS,), np.int32)
    q = jnp.asarray(rng.normal(size=(ROWS, 1, H, hd)).astype(np.float32))
    f = jax.jit(lambda q, k, v, t, s, n: native.paged_attention(q, k, v, None, None, t, s, n, jnp.int32(0), "fp16",
                                                                  0, KV))
    args = (q, k, v, jnp.asarray(table), jnp.asarray(start), jnp.asarray(n_new))
    f(*args).block_until_ready()
    return median_time(lambda i: f(*args).block_until_ready(), 200) * 1e3


def step_ms(model) -> float:
    c, P = model.weights.config, page_pool.PAGE_SIZE
    loops = c.default_loops
    pool = jax.jit(lambda: page_pool.empty(c, loops, GROUPS * SHARED + ROWS * (OWN + 1), P))()
    state = St.empty_rows(ROWS, c.vocab_size, c.d_model, c.compute_dtype)
    program, R = compiled.programs().step, -(-c.max_seq_len // P)
    rows = [t + [GROUPS * SHARED + ROWS * OWN + r] for r, t in enumerate(tables())]
    box = [pool, state]

    def run(i):
        dec = S.make_decodes(rows, [(SHARED + OWN) * P + i % 14] * ROWS, list(range(ROWS)), [1] * ROWS, R, ROWS)
        _, tok, box[0], box[1] = program(model.weights.params, c, box[0], box[1], None, dec, loops=loops,
                                         exit=model.exit_for(loops))
        jax.block_until_ready(tok)
    for i in range(3):
        run(i)
    return median_time(run, 37) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--no-write", action="store_true", help="(it writes nothing; accepted for bench.py ab)")
    args = ap.parse_args()
    assert native.available(), "the native kernels do not run here"
    model = tl.Model.from_pretrained("smollm2")
    print(f"{args.label} | attention, one layer: {kernel_ms():.3f} ms | the 16-row decode step: "
          f"{step_ms(model):.1f} ms")


if __name__ == "__main__":
    main()
