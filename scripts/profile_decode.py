"""Where a batch-1 decode step of a real model goes, kept packed: each block matrix's product alone
(all layers, by field and format), the head, against XLA's float32 dot on the same weights, and
the whole step of `Model.generate`.

    python scripts/profile_decode.py --model gemma3-270m      # writes the "profile_decode-<model>" section

Parts are jitted alone and timed as medians (one row, the native kernel where it runs); the step is
(t(65 tokens) - t(1 token)) / 64 of `generate` after a prompt of 128 tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tinyloop_jax as tl
    from _report import command, machine, median_time, write_section
    from tinyloop_jax.model import qarray

    model = tl.Model.from_pretrained(args.model, kv_mode="fp16")
    c, p = model.weights.config, model.weights.params
    blocks = (*p.pre, *p.loop, *p.post)

    def packed_time(w, k):
        x = jnp.ones((1, k), jnp.float32)
        f = jax.jit(lambda x, w: qarray.matmul(x, w))
        return median_time(lambda: f(x, w).block_until_ready(), 15)

    def float_time(w, k):
        f32 = jnp.asarray(qarray.dense(w)).reshape(k, -1)
        x = jnp.ones((1, k), jnp.float32)
        f = jax.jit(lambda x, w: x @ w)
        return median_time(lambda: f(x, f32).block_until_ready(), 15)

    def formats(w):
        if qarray.is_fused(w):
            return "+".join(q.fmt for q in w.parts)
        return w.fmt if qarray.is_quant(w) else str(w.dtype)

    parts = defaultdict(lambda: [0.0, 0.0, 0, set(), 0])  # field -> packed s, float s, weights, formats, bytes
    for blk in blocks:
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            w = getattr(blk, name)
            k = w.shape[0]
            row = parts[name]
            row[0] += packed_time(w, k)
            row[1] += float_time(w, k)
            row[2] += int(np.prod(w.shape))
            row[3].add(formats(w))
            row[4] += w.nbytes
    head = p.wte if p.head is None else p.head
    xh = jnp.ones((1, c.d_model), jnp.float32)
    fh = jax.jit(lambda x, w: qarray.head(x, w))
    head_t = median_time(lambda: fh(xh, head).block_until_ready(), 15)
    fhf = jax.jit(lambda x, w: jnp.einsum("td,vd->tv", x, w))
    f32h = [jnp.asarray(qarray.dense(head))]
    head_f = median_time(lambda: fhf(xh, f32h[0]).block_until_ready(), 15)
    f32h.clear()  # a float32 copy of the head is large: gone before the step is timed
    prompt = np.random.default_rng(0).integers(100, c.vocab_size // 2, 128).astype(np.int32)
    prefix = model.build_prefix_cache(prompt)

    def run(n):
        return median_time(lambda: model.generate_from_prefix_cache(prefix, max_tokens=n), 5)
    step = (run(65) - run(1)) / 64

    lines = [f"## Where a decode step goes: {args.model} (`scripts/profile_decode.py`)", "",
             f"`{command()}` on {machine()}; batch 1, kept packed, fp16 KV, {len(blocks)} layers; each part jitted "
             "alone, medians, ms per decode step.", "",
             "| part | formats | weights (M) | MiB | packed ms | XLA float32 dot ms |", "|---|---|---|---|---|---|"]
    known = 0.0
    for name, (pt, ft, n, fmts, nb) in parts.items():
        lines.append(f"| {name} (all layers) | {', '.join(sorted(fmts))} | {n / 1e6:.1f} | {nb / 2**20:.1f} | "
                     f"{pt * 1e3:.2f} | {ft * 1e3:.2f} |")
        known += pt
    lines.append(f"| head | {formats(head)} | {np.prod(head.shape) / 1e6:.1f} | {head.nbytes / 2**20:.1f} | "
                 f"{head_t * 1e3:.2f} | {head_f * 1e3:.2f} |")
    known += head_t
    lines += [f"| the whole step (`generate`, after 128 tokens) | | | | {step * 1e3:.2f} ({1 / step:.1f} tok/s) | |",
              f"| the rest (attention, norms, activations, the token's choice) | | | | "
              f"{(step - known) * 1e3:.2f} | |", "",
              "Each part timed alone is a call of its own (its dispatch, some 20-40 us, counted 18 times per "
              "field), so the parts overstate their share and the rest is a lower bound."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(f"profile_decode-{args.model}", body)


if __name__ == "__main__":
    main()
