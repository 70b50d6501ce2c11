"""Why the blocks of a layer stack are unrolled, not scanned: compile time and step time of 30
SmolLM2-shaped blocks (d 576, fused q|k|v 960, SwiGLU 1536; attention left out) run 32 times at
batch 1 under `fori_loop`, written as a Python loop over 30 weight sets (unrolled) and as a
`lax.scan` over the same weights stacked [30, ...] (one block compiled).

    python scripts/bench_scan_blocks.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

L, D, F, Q, STEPS = 30, 576, 1536, 960, 32


def block(x, w):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w["n"]
    x = x + (h @ w["qkv"])[..., :D] @ w["o"]
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w["n"]
    gu = jnp.einsum("td,dkf->tkf", h, w["gu"])
    return x + (jax.nn.silu(gu[:, 0]) * gu[:, 1]) @ w["dn"]


@jax.jit
def unrolled(ws, x):
    def body(i, x):
        for w in ws:
            x = block(x, w)
        return x
    return jax.lax.fori_loop(0, STEPS, body, x)


@jax.jit
def scanned(ws, x):
    return jax.lax.fori_loop(0, STEPS, lambda i, x: jax.lax.scan(lambda x, w: (block(x, w), None), x, ws)[0], x)


def main():
    rng = np.random.default_rng(0)
    w = dict(qkv=rng.standard_normal((L, D, Q), np.float32) * 0.02, o=rng.standard_normal((L, D, D), np.float32) * 0.02,
             gu=rng.standard_normal((L, D, 2, F), np.float32) * 0.02,
             dn=rng.standard_normal((L, F, D), np.float32) * 0.02, n=np.ones((L, D), np.float32))
    stacked = jax.tree.map(jnp.asarray, w)
    each = [jax.tree.map(lambda a: jnp.asarray(a[i]), w) for i in range(L)]
    x = jnp.ones((1, D), jnp.float32)
    for name, f, ws in (("unrolled", unrolled, each), ("scanned", scanned, stacked)):
        t = time.perf_counter()
        compiled = f.lower(ws, x).compile()
        compile_s = time.perf_counter() - t
        compiled(ws, x).block_until_ready()
        times = []
        for _ in range(7):
            t = time.perf_counter()
            compiled(ws, x).block_until_ready()
            times.append((time.perf_counter() - t) / STEPS)
        print(f"{name}: compile {compile_s:.2f} s, step {sorted(times)[3] * 1e3:.1f} ms (median of 7)")


if __name__ == "__main__":
    main()
