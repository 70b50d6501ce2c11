"""The GPU check of the Pallas paged-attention kernel (`model/paged_pallas.py`): compile it for
real, compare it with the XLA reference (a gather of each row's pages, then attention), and time
both at SmolLM2's heads (9 query heads over 3 KV heads of 64) for rows x live tokens.

    python scripts/gpu_paged.py --write                # on a GPU machine (a minute or two)
    python scripts/gpu_paged.py --interpret --quick    # anywhere: the same checks, kernel interpreted

Each row's page table covers the whole context (2048 tokens): the kernel reads the live pages
only, the reference gathers and masks them all (what the XLA path does). Prints a markdown table;
`--write` puts it in docs/benchmarks.md (section gpu_paged).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

from tinyloop_jax.model import paged_pallas, quant  # noqa: E402
from tinyloop_jax.model.attention import attention  # noqa: E402

P, H, KV, HD, CONTEXT = 16, 9, 3, 64, 2048


def pool(key, fmt: str, n_pages: int):
    """Random K or V pages [KV, NP, P, w] in `fmt` and their scales (int formats) or None."""
    x = jax.random.normal(key, (KV, n_pages, P, HD), jnp.float32)
    if fmt in ("fp32", "fp16"):
        return x.astype(jnp.float32 if fmt == "fp32" else jnp.float16), None
    q, s = quant.quantize(x, 8 if fmt == "int8" else 4, HD)
    return (quant.pack_int4(q) if fmt == "int4" else q), s


def values(fmt: str, x, s):
    if fmt in ("fp32", "fp16"):
        return x.astype(jnp.float32)
    return quant.dequantize(quant.unpack_int4(x) if fmt == "int4" else x, s, HD)


@functools.partial(jax.jit, static_argnames=("fmt",))
def reference(q, k, v, ks, vs, table, start, n_new, fmt: str):
    """The XLA path: each row gathers its whole table's pages, masks past its length (q is
    pre-scaled for the kernel; `attention` scales)."""
    def row(q, pages, s, n):
        kr, vr = (values(fmt, jnp.take(a, pages, axis=1), None if sc is None else jnp.take(sc, pages, axis=1))
                  .reshape(KV, -1, HD) for a, sc in ((k, ks), (v, vs)))
        kp = jnp.arange(kr.shape[1])
        return attention(q.transpose(1, 0, 2) * HD ** 0.5, s + jnp.arange(q.shape[0]),
                         [(kr, vr, jnp.where(kp < s + n, kp, -1))], 0).transpose(1, 0, 2)
    return jax.vmap(row)(q, table, start, n_new)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="run the kernel in interpret mode (no GPU)")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = ap.parse_args()
    if jax.default_backend() != "gpu" and not args.interpret:
        sys.exit(f"backend is {jax.default_backend()!r}: this check needs a GPU (or --interpret)")
    rows_, lives, fmts = ((2,), (40,), ("fp16", "int4")) if args.quick else (
        (1, 16, 64), (64, 512, 2048), ("fp16", "int8", "int4"))
    repeats = 3 if args.quick else 30
    R = CONTEXT // P
    out = []
    for fmt in fmts:
        for b in rows_:
            n_pages = b * R + 1
            keys = jax.random.split(jax.random.key(b), 3)
            k, ks = pool(keys[0], fmt, n_pages)
            v, vs = pool(keys[1], fmt, n_pages)
            table = jnp.arange(b * R, dtype=jnp.int32).reshape(b, R)
            for live in lives:
                q = jax.random.normal(keys[2], (b, 1, H, HD), jnp.float32) * HD ** -0.5
                start, n_new = jnp.full((b,), live - 1, jnp.int32), jnp.ones((b,), jnp.int32)
                kern = jax.jit(lambda *a: paged_pallas.paged_attention(  # noqa: B023
                    *a, jnp.int32(0), fmt, 0, KV, interpret=args.interpret))  # noqa: B023
                a = (q, k, v, ks, vs, table, start, n_new)
                err = float(jnp.max(jnp.abs(kern(*a) - reference(*a, fmt=fmt))))
                t_k = _report.median_time(lambda: jax.block_until_ready(kern(*a)), repeats)  # noqa: B023
                t_r = _report.median_time(lambda: jax.block_until_ready(reference(*a, fmt=fmt)),  # noqa: B023
                                          repeats)
                out.append(f"| {fmt} | {b} | {live} | {err:.1e} | {t_k * 1e6:.1f} | {t_r * 1e6:.1f} | "
                           f"{t_r / t_k:.2f}x |")
                if not np.isfinite(err) or err > 1e-4:
                    print("\n".join(out))
                    sys.exit(f"kernel differs from the reference by {err:.2e} ({fmt}, {b} rows, {live} tokens)")
    body = "\n".join([
        "## Paged decode attention: the Pallas kernel vs the XLA gather",
        "",
        f"`{_report.command()}` on {jax.devices()[0].device_kind} ({_report.machine()})"
        f"{' — kernel INTERPRETED' if args.interpret else ''}. Median of {repeats} calls; one decode "
        f"token per row, {H} query heads over {KV} KV heads of {HD}, page tables of {CONTEXT} tokens.",
        "",
        "| pages | rows | live tokens | max abs err | kernel µs | XLA gather µs | speedup |",
        "|---|---|---|---|---|---|---|",
        *out,
    ])
    print(body)
    if args.write:
        print("wrote", _report.write_section("gpu_paged", body))


if __name__ == "__main__":
    main()
