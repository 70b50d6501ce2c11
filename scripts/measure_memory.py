"""What the compiled decode and prefix programs allocate, from XLA's own memory analysis.

    python scripts/measure_memory.py

Shows that the decode loop updates its (donated) cache in place — scratch memory is a small
fraction of one cache copy — and that a request served from a prefix allocates only its own
segment, whatever the prefix length.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.model import cache as kvc  # noqa: E402
from tinyloop_jax.decoding import programs as engine  # noqa: E402


def decode_memory(model, prefix, own_capacity, loops, out_len=32):
    cfg = model.weights.config
    own = kvc.empty(cfg.kv_mode, cfg.n_pre_blocks, loops, cfg.n_heads, own_capacity, cfg.head_dim, batch=1)
    c = engine.decode.lower(model.weights.params, cfg, (prefix.cache,), own, jnp.zeros((1, cfg.vocab_size)),
                            jnp.zeros((1, cfg.vocab_size), bool), tl.Request.make(1, max_tokens=out_len),
                            loops=loops, window=0, out_len=out_len).compile()
    return c.memory_analysis(), own.nbytes


def main():
    loops = 8
    rows = []
    for mode in ("fp32", "fp16"):
        cfg = tl.ModelConfig(vocab_size=4096, d_model=384, n_heads=6, n_pre_blocks=2, default_loops=loops,
                             max_seq_len=4096, kv_mode=mode)
        model = tl.Model.random(cfg, seed=0)
        for P in (512, 2048):
            prefix = model.build_prefix_cache(np.arange(P) % cfg.vocab_size)
            for own_cap in (64, 1024):
                mem, own_bytes = decode_memory(model, prefix, own_cap, loops)
                rows.append((mode, P, prefix.nbytes, own_cap, own_bytes, mem.alias_size_in_bytes,
                             mem.temp_size_in_bytes))
                print(rows[-1])
    lines = [
        "## Decode memory: in-place cache updates, no prefix copies (`scripts/measure_memory.py`)",
        "",
        f"Command: `{_report.command()}`  ",
        f"Machine: {_report.machine()}  ",
        "Model: n_pre_blocks=2, loops=8, D=384, vocab 4096. Numbers are XLA's `memory_analysis()` of the "
        "compiled decode loop (`engine.decode`) serving a request from a prefix. *aliased* = donated own-segment "
        "bytes updated in place; *scratch* = everything else the program allocates.",
        "",
        "| kv_mode | prefix tokens | prefix MiB | own slots | own segment KiB | aliased KiB | scratch KiB "
        "| scratch / own segment |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, P, pb, cap, ob, al, tmp in rows:
        lines.append(f"| {mode} | {P} | {pb / 2**20:.1f} | {cap} | {ob / 1024:.0f} | {al / 1024:.0f} | "
                     f"{tmp / 1024:.0f} | {tmp / ob:.2f} |")
    lines += ["", "The prefix is an argument, never an output: it is not written and no stored copy of it is "
              "made, and the own segment is updated in place (aliased = its whole size). The loop's passes are "
              "stacked on one cache axis and run under `fori_loop`, so the program is the same at any depth; "
              "XLA:CPU cannot feed a dynamically indexed pass of a stacked array to a dot (its dot and reduction "
              "kernels take whole buffers), so it copies *one* pass of each segment into scratch before that "
              "pass's attention: scratch ≈ one prefix layer + one own layer (fp32: 1.5 MiB at 512 prefix tokens, "
              "6 MiB at 2048), reused by every pass and step — a constant, not a copy of the cache (before the "
              "passes were stacked, when every layer was unrolled into the program, it was 0.13–0.18 MiB). In "
              "fp16 mode the scratch is the float32 upcast of the K/V that attention reads: the pre blocks' and one "
              "pass's layers, 4.5–18 MiB here (before: every layer at once, 16–79 MiB for these rows)."]
    print("wrote", _report.write_section("measure_memory", "\n".join(lines)))


if __name__ == "__main__":
    main()
