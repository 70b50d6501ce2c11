"""Parity on a GPU: the golden files' logits (Ouro's own code, `transformers`' Llama and GPT-2,
made on CPU in float32) recomputed on the GPU, in float32 at XLA's default matmul precision
(TF32 on NVIDIA matrix units) and at "highest", and in bfloat16; plus greedy tokens.

    python scripts/gpu_parity.py          # on a GPU machine (about a minute)
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.model import transformer as tf  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data")


def cases():
    g = dict(np.load(os.path.join(DATA, "ouro-tiny", "golden.npz")))
    yield "ouro-tiny", [(g[f"prompt_{i}"], g[f"logits_{i}"], g[f"greedy_{i}"]) for i in range(3)]
    g = dict(np.load(os.path.join(DATA, "llama-tiny", "golden.npz")))
    yield "llama-tiny", [(g[f"prompt_{n}"], g[f"logits_{n}"], None) for n in (9, 40)]
    g = dict(np.load(os.path.join(DATA, "gpt2-tiny", "golden.npz")))
    yield "gpt2-tiny", [(g[f"prompt_{n}"], g[f"logits_{n}"], None) for n in (7, 33, 100)]


def main():
    rows = []
    for name, items in cases():
        for dtype, precision in (("float32", "default"), ("bfloat16", "default")):
            m = tl.Model.from_pretrained(os.path.join(DATA, name), kv_mode="fp32", dtype=dtype)
            w = m.weights
            err, greedy = 0.0, []
            with jax.default_matmul_precision(precision):
                for prompt, logits, want in items:
                    got = tf.forward_seq(w.params, w.config, jnp.asarray(prompt), loops=w.config.default_loops)
                    err = max(err, float(np.abs(np.asarray(got, np.float32) - logits).max()))
                    if want is not None:
                        greedy.append(m.generate(prompt, max_tokens=len(want))[len(prompt):] == want.tolist())
            rows.append(f"| {name} | {dtype} | {precision} | {err:.1e} | "
                        f"{'-' if not greedy else f'{sum(greedy)}/{len(greedy)}'} |")
            print(rows[-1], flush=True)
    body = "\n".join([f"Command: `{_report.command()}` on {jax.devices()[0].device_kind}  ",
                      f"Machine: {_report.machine()}", "",
                      "| model | dtype | matmul precision | max abs logit diff vs golden | greedy identical |",
                      "|---|---|---|---|---|", *rows])
    print(body)
    _report.write_section("gpu_parity", body, path="ouro.md")


if __name__ == "__main__":
    main()
