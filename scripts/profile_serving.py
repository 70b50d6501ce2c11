"""Where a served SmolLM2 decode step's time and the server's memory go (issue 46's "what limits
it"): the parts of a 16-row decode step timed alone, and the resident memory at each stage of a
server's start.

    python scripts/profile_serving.py            # writes the "profile_serving" section of docs/benchmarks.md

1. Time, medians in one process (SmolLM2-135M-Instruct as shipped: Q4_1 body, Q8_0 embedding
   as the head, fp16 pages): one layer's four packed matmuls and the head at 1, 4 and 16 rows
   (`qarray.matmul` / `qarray.head`, the native kernel), x 30 layers; the paged attention kernel
   for 16 rows of 400 live tokens (x 30 layers); the engine's token choice for 16 rows; and the
   engine's whole decode step at 1, 4 and 16 rows (400-token prompts), for the remainder.
2. Memory: VmRSS after importing JAX, loading the model, creating an `Engine`, compiling its
   step programs (`warmup`), and after dropping the engine and JAX's caches (what the programs
   held).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def rss() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--activations", default="float32", choices=["float32", "int8"],
                    help="what the packed weights multiply (`Model`'s activations)")
    args = ap.parse_args()
    mem = [("python", rss())]
    import jax
    import jax.numpy as jnp
    import numpy as np
    jnp.ones(3).block_until_ready()
    mem.append(("import jax (CPU client up)", rss()))

    import tinyloop_jax as tl
    from _report import command, machine, median_time, write_section
    from tinyloop_jax import native
    from tinyloop_jax.model import qarray
    from tinyloop_jax.serving import step as S
    from tinyloop_jax.decoding import step as St

    model = tl.Model.from_pretrained("smollm2", activations=args.activations)
    gc.collect()
    mem.append((f"+ the model ({model.nbytes / 2**20:.0f} MiB of weights)", rss()))
    c, p = model.weights.config, model.weights.params
    layers = c.n_cache_layers(c.default_loops)
    blk = (p.loop or p.pre)[0]

    def mm(w, M, K):
        x = jnp.ones((M, K), jnp.float32)
        f = jax.jit(lambda x, w: qarray.matmul(x, w))
        return median_time(lambda: f(x, w).block_until_ready(), 9)

    def dense(w, M, K):  # XLA's float32 dot over the same weight dequantized once
        x, f32 = jnp.ones((M, K), jnp.float32), jnp.asarray(w.dequantize()).reshape(K, -1)
        f = jax.jit(lambda x, w: x @ w)
        return median_time(lambda: f(x, f32).block_until_ready(), 9)

    names = ("w_qkv", "w_o", "w_gate_up", "w_down")
    width = lambda n: c.d_model if n != "w_down" else c.intermediate_size  # noqa: E731
    rows = {}
    for M in (1, 4, 16):
        layer = sum(mm(getattr(blk, n), M, width(n)) for n in names)
        f32 = sum(dense(getattr(blk, n), M, width(n)) for n in names)
        xh = jnp.ones((M, c.d_model), jnp.float32)
        fh = jax.jit(lambda x, w: qarray.head(x, w))
        rows[M] = dict(matmuls=layer * layers, f32=f32 * layers,
                       head=median_time(lambda: fh(xh, p.wte).block_until_ready(), 9))
    # attention: 16 rows of 400 live fp16 tokens, SmolLM2's heads
    b, L, P = 16, 400, 16
    KV, H, hd = c.n_kv_heads, c.n_heads, c.head_dim
    R = L // P + 1
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(KV, b * R, P, hd)), jnp.float16)
    q = jnp.asarray(rng.normal(size=(b, 1, H, hd)) * hd ** -0.5, jnp.float32)
    table = jnp.asarray(np.arange(b * R).reshape(b, R), jnp.int32)
    start, n_new = jnp.full((b,), L - 1, jnp.int32), jnp.ones((b,), jnp.int32)
    fa = jax.jit(lambda q, k, t, s, n: native.paged_attention(q, k, k, None, None, t, s, n, jnp.int32(0), "fp16", 0,
                                                              KV))
    attn = median_time(lambda: fa(q, k, table, start, n_new).block_until_ready(), 21) * layers
    # the token choice of 16 rows (greedy requests, penalties' arrays kept)
    state = St.empty_rows(b, c.vocab_size, c.d_model, c.compute_dtype)
    dec = S.make_decodes([[0]] * b, [10] * b, list(range(b)), [3] * b, 4, b)
    logits = jnp.asarray(rng.normal(size=(b, c.vocab_size)), jnp.float32)
    fc = jax.jit(S._next_tokens)
    choose = median_time(lambda: jax.block_until_ready(fc(state, dec, logits)), 21)

    # the engine's decode step: B requests of 400-token prompts, 64 tokens each
    engine = tl.Engine(model, max_batch=16)
    mem.append(("+ an Engine (max_batch 16; pages allocated on first use)", rss()))
    engine.warmup()
    gc.collect()
    mem.append(("+ its 17 step programs compiled (warmup)", rss()))
    step = {}
    for B in (1, 4, 16):
        prompts = [rng.integers(100, 40000, L).tolist() for _ in range(B)]

        def run(n):
            t = time.perf_counter()
            for h in [engine.submit(x, max_tokens=n) for x in prompts]:
                h.result()
            return time.perf_counter() - t
        run(2)
        step[B] = (np.median([run(65) for _ in range(3)]) - np.median([run(1) for _ in range(3)])) / 64
    mem.append(("+ serving 16 rows of 400 tokens (pages written)", rss()))
    engine.close()
    engine = None
    jax.clear_caches()
    gc.collect()
    mem.append(("after dropping the engine and JAX's caches", rss()))

    lines = ["## Where a served decode step and the server's memory go (issue 46, `scripts/profile_serving.py`)", "",
             f"`{command()}` on {machine()}; SmolLM2-135M-Instruct as shipped (Q4_1 body, Q8_0 head), fp16 pages, "
             f"{layers} layers. Parts timed alone (medians), in ms per decode step:", "",
             "| rows | packed matmuls (x30 layers) | the same, XLA float32 dot | head | attention, 400 tokens a row "
             "| token choice | the engine's whole step | the rest |", "|---|---|---|---|---|---|---|---|"]
    for M in (1, 4, 16):
        a = attn if M == 16 else float("nan")
        ch = choose if M == 16 else float("nan")
        known = rows[M]["matmuls"] + rows[M]["head"] + (a + ch if M == 16 else 0)
        lines.append(f"| {M} | {rows[M]['matmuls'] * 1e3:.1f} | {rows[M]['f32'] * 1e3:.1f} | "
                     f"{rows[M]['head'] * 1e3:.1f} | {a * 1e3:.1f} | {ch * 1e3:.1f} | {step[M] * 1e3:.1f} | "
                     f"{(step[M] - known) * 1e3:.1f}{'' if M == 16 else ' (with attention and choice)'} |")
    lines += ["", "Resident memory (VmRSS) in one process, GiB:", "", "| stage | RSS |", "|---|---|"]
    lines += [f"| {name} | {v:.2f} |" for name, v in mem]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("profile_serving", body)


if __name__ == "__main__":
    main()
