"""The GPU check of the int4 decode-attention kernel: compile it for real, compare it with the
jnp reference, and time it against dequantize-then-attend.

    python scripts/gpu_check.py                        # on a GPU machine (about a minute)
    python scripts/gpu_check.py --interpret --quick    # anywhere: the same checks, kernel interpreted

For each shape: max |kernel - reference| of the normalized output (must be < 1e-4), then the
median time of (a) the kernel reading packed int4 K/V and (b) the reference, which dequantizes
K/V to float32 in memory and then attends — what a runtime without the kernel does. Prints a
markdown table; `--write` puts it in docs/benchmarks.md (section gpu_check).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

from tinyloop_jax.model import int4_attention as ia
from tinyloop_jax.model import quant  # noqa: E402


def segment(key, H, C, hd, n_valid, KV=None):
    """A query for H heads and packed K/V of KV heads (grouped-query attention when KV < H)."""
    kk, kv, kq = jax.random.split(key, 3)

    def packed(k):
        q, s = quant.quantize(jax.random.normal(k, (KV or H, C, hd), jnp.float32), 4, hd)
        return quant.pack_int4(q), s
    k, ks = packed(kk)
    v, vs = packed(kv)
    pos = jnp.where(jnp.arange(C) < n_valid, jnp.arange(C), -1).astype(jnp.int32)
    q = jax.random.normal(kq, (H, hd), jnp.float32) * hd ** -0.5
    return q, jnp.int32(n_valid - 1), k, ks, v, vs, pos


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="run the kernel in interpret mode (no GPU)")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = ap.parse_args()
    backend = jax.default_backend()
    if backend != "gpu" and not args.interpret:
        sys.exit(f"backend is {backend!r}: this check needs a GPU (or --interpret to run the kernel interpreted)")

    # (query heads, KV heads, slots, head_dim, valid slots, window)
    shapes = [(4, 4, 100, 32, 77, 0), (4, 4, 256, 32, 256, 17), (4, 2, 100, 32, 77, 0)] if args.quick else [
        (12, 12, 1024, 64, 1000, 0),       # GPT-2-small heads
        (16, 16, 1024, 128, 1000, 0),      # the seed's D = 2048; Ouro-1.4B's heads
        (16, 16, 8192, 128, 8000, 0),
        (16, 16, 32768, 128, 32000, 0),
        (16, 16, 32768, 128, 32000, 4096),  # sliding window
        (32, 8, 8192, 128, 8000, 0),       # grouped-query attention (Llama-3-8B's heads)
    ]
    repeats = 3 if args.quick else 50
    ref = jax.jit(ia.int4_attention_ref, static_argnames=("window",))
    rows = []
    for i, (H, KV, C, hd, n, window) in enumerate(shapes):
        a = segment(jax.random.key(i), H, C, hd, n, KV)
        kern = jax.jit(functools.partial(ia.int4_attention_pallas, window=window, interpret=args.interpret))
        r = ref(*a, window=window)
        o, _, l = kern(*a)
        o_ref = r[0] / r[2][:, None]
        err = float(jnp.max(jnp.abs(o / l[:, None] - o_ref)))
        t_k = _report.median_time(lambda: jax.block_until_ready(kern(*a)), repeats)  # noqa: B023
        t_r = _report.median_time(lambda: jax.block_until_ready(ref(*a, window=window)), repeats)  # noqa: B023
        packed = sum(int(x.nbytes) for x in a[2:6])
        heads = str(H) if KV == H else f"{H}/{KV}"
        rows.append(f"| {heads} | {C} | {hd} | {window} | {packed / 2**20:.2f} | {err:.1e} | {t_k * 1e6:.1f} | "
                    f"{t_r * 1e6:.1f} | {t_r / t_k:.2f}x |")
        if err > 1e-4:
            print("\n".join(rows))
            sys.exit(f"kernel differs from the reference by {err:.2e} at H={H} C={C} hd={hd} window={window}")
    dev = jax.devices()[0].device_kind
    body = "\n".join([
        "## int4 decode attention: Pallas kernel vs dequantize-then-attend",
        "",
        f"`{_report.command()}` on {dev} ({_report.machine()}){' — kernel INTERPRETED' if args.interpret else ''}. "
        f"Median of {repeats} calls; one query token per head.",
        "",
        "| heads (q/kv) | slots | head_dim | window | packed K/V MiB | max abs err | kernel µs | dequant+attend µs "
        "| speedup |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if args.write:
        print("wrote", _report.write_section("gpu_check", body))


if __name__ == "__main__":
    main()
