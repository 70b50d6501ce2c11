"""Bytes per device and collectives per decode step on meshes of 1, 2, 4 and 8 devices.

    python scripts/bench_mesh.py            # GPT-2-small and Ouro-1.4B shapes, ~5 min on 2 CPUs
    python scripts/bench_mesh.py --quick    # tiny shapes, nothing written

Runs with 8 fake CPU devices (set before JAX starts). Nothing is allocated at full size: the
weights and a call's page pool (a shared prefix's pages, the requests' own) are abstract arrays with the
shardings `tinyloop_jax.model.sharding` gives them, the decode loop (`paged_decode.lower_decode`) is
compiled for them, and
per-device bytes come from the shard shapes and the compiled program's `memory_analysis()`.
Collectives are counted in the compiled HLO. Fake devices share 2 cores, so no speed is claimed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.decoding import paged_decode  # noqa: E402
from tinyloop_jax.model import paged, sharding  # noqa: E402
from tinyloop_jax.model import page_pool
from tinyloop_jax.model.kv_modes import kv_mode as parse_kv_mode  # noqa: E402
from tinyloop_jax.model.params import Shape, param_shapes  # noqa: E402
from tinyloop_jax.decoding.sampling import Knobs  # noqa: E402

GPT2_SMALL = dict(vocab_size=50257, d_model=768, n_heads=12, n_pre_blocks=11, default_loops=1, max_seq_len=1024)
OURO_1_4B = dict(vocab_size=49152, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128, intermediate_size=5632,
                 n_pre_blocks=0, loop_blocks=24, default_loops=4, max_seq_len=4096, block="llama",
                 norm_placement="sandwich", pass_norm=True, early_exit_gate=True, tie_embeddings=False)
QUICK = {"gpt2-tiny": dict(GPT2_SMALL, vocab_size=512, d_model=64, n_heads=8, n_pre_blocks=1),
         "ouro-tiny": dict(OURO_1_4B, vocab_size=512, d_model=64, n_heads=8, n_kv_heads=8, head_dim=8,
                           intermediate_size=96, loop_blocks=2)}


def abstract(shape, dtype, spec, mesh):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def per_device(tree) -> int:
    """Bytes of one device's shards of abstract arrays."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


def total(tree) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def weights(cfg, mesh):
    shapes = param_shapes(cfg)
    dt = cfg.compute_dtype
    single = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s), dt), shapes, is_leaf=lambda x: isinstance(x, Shape))
    layout = jax.eval_shape(lambda p: sharding.pad_vocab(p, cfg, mesh), single)
    specs = sharding.param_specs(layout, cfg, mesh)
    return jax.tree.map(lambda a, s: abstract(a.shape, a.dtype, s, mesh), layout, specs)


def pool(cfg, mesh, kv_mode, n_pages, passes):
    """An abstract page pool placed as `page_pool.placed` places it: pages split by KV heads over
    'model' (h modes: replicated), whole on every 'data' group."""
    mode = parse_kv_mode(kv_mode)
    shapes = page_pool.page_shapes(mode, cfg.n_kv_heads, n_pages, page_pool.PAGE_SIZE, cfg.head_dim, cfg.d_model)

    def arr(shape, dtype, head_axis):
        return abstract(shape, dtype, sharding.cache_spec(shape, False, head_axis if mode.splits_heads else None,
                                                           mesh), mesh)
    layer = lambda: {n: arr(s, d, 0) for n, (s, d) in shapes.items()}  # noqa: E731
    return page_pool.PagedKV(pre=tuple(layer() for _ in range(cfg.n_pre_blocks)),
                         loop={n: arr((passes, cfg.loop_blocks) + s, d, 2) for n, (s, d) in shapes.items()},
                         kv_mode=mode, post=tuple(layer() for _ in range(cfg.n_post_blocks)))


def measure(name, shape, d, m, args):
    mesh = sharding.make_mesh(d, m)
    cfg = tl.ModelConfig(**shape, kv_mode=args.kv_mode, mesh=mesh)
    loops, n = cfg.default_loops, args.requests
    w = weights(cfg, mesh)
    lay = paged_decode.layout(args.prefix, args.own, n)
    pages = pool(cfg, mesh, args.kv_mode, lay.n_pages, loops)
    req = Knobs.make(n, max_tokens=args.own // 2)
    rows = paged.Rows(lay.tables, np.full((n,), args.prefix, np.int32), np.ones((n,), np.int32))
    lowered = paged_decode.lower_decode(w, cfg, pages, rows, req, loops, args.own // 2)
    compiled = lowered.compile()
    text = compiled.as_text()
    ops = Counter(re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", text))
    blocks = cfg.n_pre_blocks + cfg.loop_blocks + cfg.n_post_blocks
    mem = compiled.memory_analysis()
    return dict(model=name, mesh=f"{d}x{m}", weights=per_device(w), weights_total=total(w), pool=per_device(pages),
                pool_total=total(pages), temp=getattr(mem, "temp_size_in_bytes", 0),
                args_mem=getattr(mem, "argument_size_in_bytes", 0), all_reduce=ops["all-reduce"],
                all_gather=ops["all-gather"], other=ops["reduce-scatter"] + ops["all-to-all"], blocks=blocks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-mode", default="fp16")
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix slots")
    ap.add_argument("--own", type=int, default=128, help="own positions per request")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action=_report.NoWrite)
    args = ap.parse_args()
    assert jax.device_count() == 8, "needs 8 (fake) devices: JAX_NUM_CPU_DEVICES=8"
    models = QUICK if args.quick else {"gpt2-small": GPT2_SMALL, "ouro-1.4b": OURO_1_4B}
    rows = []
    for name, shape in models.items():
        for m in (1, 2, 4, 8):
            d = 1
            while shape.get("n_kv_heads", shape["n_heads"]) % m:  # heads 'model' cannot split: 8 devices as d x m
                d, m = d * 2, m // 2
            r = measure(name, shape, d, m, args)
            rows.append(r)
            print(r, flush=True)
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    lines = [f"Command: `{_report.command()}`  ", f"Machine: {_report.machine()} (8 fake CPU devices)  ",
             f"Mesh 'data' x 'model'; KV mode {args.kv_mode}; the call's page pool: a {args.prefix}-token "
             f"shared prefix's pages and {args.requests} requests' own pages for {args.own} positions each. Per "
             "device (MiB) and, in brackets, the share of the one-device size; collectives in the compiled decode "
             "loop over the pages (`blocks`: blocks in its program, the pass body holding the loop stack once).",
             "", "| model | mesh | weights | page pool | XLA temp | all-reduce | all-gather | blocks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = lambda k: f"{mib(r[k])} ({r[k] / r[k + '_total']:.0%})"  # noqa: E731
        lines.append(f"| {r['model']} | {r['mesh']} | {share('weights')} | {share('pool')} | "
                     f"{mib(r['temp'])} | {r['all_reduce']} | {r['all_gather']} | {r['blocks']} |")
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        _report.write_section("bench_mesh", text)


if __name__ == "__main__":
    main()
