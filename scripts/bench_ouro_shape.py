"""Ouro-1.4B's shape with random weights: cache bytes per KV mode, compile time, batch-1 decode.

    python scripts/bench_ouro_shape.py             # ~10 min and ~12 GB of RAM on 2 CPUs
    python scripts/bench_ouro_shape.py --quick     # a small stand-in, nothing written
    python scripts/bench_ouro_shape.py --dtype bfloat16 --modes fp16,int4 --section bench_ouro_shape_gpu  # a GPU

Shape of Ouro-1.4B (its config.json): hidden 2048, 24 layers looped 4 times (96 cache layers),
16 heads of 128 (no grouping), intermediate 5632, vocab 49152, untied head. Reported:
  * KV cache bytes per token and of a 1024-token prefix in every mode (`Model.cache_nbytes`,
    the formula the tests check against built prefixes' `nbytes`);
  * first-call time of `generate` and XLA's compile seconds (float32 weights);
  * batch-1 decode tokens/s from a 128-token prefix, (t[N tokens] - t[1 token]) / (N - 1), next to the
    bandwidth bound: bytes a step must read (the loop stack's weights once per pass, the head,
    the KV cache) over the better of a large GEMV's and a large elementwise pass's bandwidth,
    measured in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402
from bench_decode import gemv_bandwidth  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.model import cache as kvc  # noqa: E402

OURO_1_4B = dict(vocab_size=49152, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128, intermediate_size=5632,
                 n_pre_blocks=0, loop_blocks=24, default_loops=4, max_seq_len=4096, block="llama",
                 norm_placement="sandwich", pass_norm=True, early_exit_gate=True, tie_embeddings=False,
                 rope_theta=1000000.0, layer_norm_eps=1e-6)
QUICK = dict(OURO_1_4B, vocab_size=4096, d_model=256, n_heads=4, n_kv_heads=4, head_dim=64, intermediate_size=512,
             loop_blocks=4)


def copy_bandwidth(mib: int = 1024) -> float:
    """Bytes/s (read + written) of y = 2x over a float32 array of `mib` MiB."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 2.0)
    return 2 * x.nbytes / _report.median_time(lambda: f(x).block_until_ready(), repeats=9, warmup=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="fp16", help="KV modes to time decode in")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=9, help="decode speed from t[new tokens] - t[1 token]")
    ap.add_argument("--dtype", default="float32", help="weights and compute: float32 | bfloat16")
    ap.add_argument("--section", default="bench_ouro_shape", help="docs section to write")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action=_report.NoWrite)
    args = ap.parse_args()
    shape = QUICK if args.quick else OURO_1_4B
    base = tl.ModelConfig(**shape, kv_mode="fp16", dtype=args.dtype)
    L = base.n_cache_layers(base.default_loops)

    lines = [f"Command: `{_report.command()}`  ", f"Machine: {_report.machine()}  ",
             f"Shape: hidden {base.d_model}, {base.loop_blocks} layers x {base.default_loops} passes = {L} cache "
             f"layers, {base.n_heads} heads / {base.n_kv_heads} KV heads of {base.head_dim}, vocab {base.vocab_size}",
             "", "| kv_mode | KV bytes per token | MB per token | 1024-token prefix, MiB |", "|---|---|---|---|"]
    for mode in tl.KV_MODES:
        per_tok = kvc.cache_nbytes(mode, L, base.n_kv_heads, 1, base.head_dim, base.d_model) - 8
        prefix = kvc.cache_nbytes(mode, L, base.n_kv_heads, 1024, base.head_dim, base.d_model)
        lines.append(f"| {mode} | {per_tok:,} | {per_tok / 1e6:.3f} | {prefix / 2**20:,.1f} |")

    # the ceiling: the better of a large GEMV and a large elementwise pass (a lone GEMV does not
    # saturate a GPU's memory; on this CPU the GEMV is the faster of the two)
    gemv, copy = gemv_bandwidth(), copy_bandwidth()
    bw = max(gemv, copy)
    compile_s = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compile_s.append(secs) if name.endswith("backend_compile_duration") else None)
    t = time.perf_counter()
    params = tl.Model.random(base, seed=0).weights.params
    print(f"random weights in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    n_weights = sum(a.size for a in jax.tree.leaves(params))
    stack = sum(a.size for a in jax.tree.leaves(params.loop))
    item = base.compute_dtype.itemsize
    lines += ["", f"Weights: {n_weights / 1e9:.2f} B parameters, {args.dtype} ({n_weights * item / 2**30:.1f} GiB) on "
              f"{jax.devices()[0].device_kind}; "
              f"bandwidth ceiling {bw / 1e9:.1f} GB/s (large GEMV {gemv / 1e9:.1f}, large elementwise pass "
              f"{copy / 1e9:.1f}).", "",
              "| kv_mode | first generate call, s | XLA compile s | decode tok/s | bound tok/s | share of bound |",
              "|---|---|---|---|---|---|"]
    prompt = (np.arange(args.prefix) * 7 % base.vocab_size).astype(np.int32)
    for mode in args.modes.split(","):
        model = tl.Model(params, base.replace(kv_mode=mode))
        compile_s.clear()
        t = time.perf_counter()
        model.generate(prompt, max_tokens=4)
        first, comp = time.perf_counter() - t, sum(compile_s)
        p = model.build_prefix_cache(prompt)
        t1 = _report.median_time(lambda: model.generate_from_prefix_cache(p, max_tokens=1), repeats=args.repeats)
        tn = _report.median_time(lambda: model.generate_from_prefix_cache(p, max_tokens=args.new),
                                 repeats=args.repeats)
        tok_s = (args.new - 1) / (tn - t1)
        kv = model.cache_nbytes(args.prefix + args.new // 2)
        step_bytes = (stack * base.default_loops + params.head.size + params.lnf_g.size) * item + kv
        bound = bw / step_bytes
        lines.append(f"| {mode} | {first:.1f} | {comp:.1f} | {tok_s:.3f} | {bound:.3f} | {tok_s / bound:.0%} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        _report.write_section(args.section, text)


if __name__ == "__main__":
    main()
