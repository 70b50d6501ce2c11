"""What each KV mode costs and saves: prefix bytes, decode speed, and next-token quality vs fp32.

    python scripts/bench_kv_modes.py            # ~3 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_kv_modes.py --quick    # a smoke run, nothing written

* bytes: a real 1024-token prefix on the benchmark model of bench_prefix_cache.py (n_pre 2,
  L 8, D 384), `PrefixCache.nbytes`; and the formula (`Model.cache_nbytes`) for the seed's
  example shape (D 2048, 16 heads, L 8).
* decode: batch-1 tokens/s serving from that 1024-token prefix (8-token suffix), per step =
  (t[33 tokens] - t[1 token]) / 32, median of 5.
* quality: the bundled trained model at its default depth over the whole held-out split
  (88 windows of 256 bytes): mean KL(fp32 || mode) of the next-token distribution, top-1
  agreement with fp32, bits/byte, and the per-byte perplexity change vs fp32.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.decoding import paged_decode  # noqa: E402
from tinyloop_jax.decoding import step as St  # noqa: E402
from tinyloop_jax.model import paged  # noqa: E402
from tinyloop_jax.model import page_pool
from tinyloop_jax.model import cache as kvc  # noqa: E402
from tinyloop_jax.decoding import programs as engine  # noqa: E402
from tinyloop_jax.model import transformer as tf  # noqa: E402
from tinyloop_jax.cli import BUNDLED  # noqa: E402
from tinyloop_jax.data import pydoc_split  # noqa: E402


@partial(jax.jit, static_argnames=("cfg", "loops"))
def _logp(params, cfg, seqs, loops):
    return jax.nn.log_softmax(jax.vmap(lambda s: tf.forward_seq(params, cfg, s, loops))(seqs)[:, :-1], axis=-1)


def quality(modes, max_bytes):
    """mode -> (mean KL vs fp32 [nats], top-1 agreement, bits/byte) on the bundled model."""
    base = tl.Model.load(BUNDLED)
    cfg0, params = base.weights.config, base.weights.params
    T = cfg0.max_seq_len
    val = pydoc_split()[1][:max_bytes].astype(np.int32)
    seqs = jnp.asarray(val[: len(val) // T * T].reshape(-1, T))
    ref = np.asarray(_logp(params, tl.ModelConfig(**dict(cfg0.to_dict(), kv_mode="fp32")), seqs, cfg0.default_loops))
    target = np.asarray(seqs[:, 1:])
    out = {}
    for mode in modes:
        lp = np.asarray(_logp(params, tl.ModelConfig(**dict(cfg0.to_dict(), kv_mode=mode)), seqs, cfg0.default_loops))
        kl = float(np.mean(np.sum(np.exp(ref) * (ref - lp), axis=-1)))
        top1 = float(np.mean(ref.argmax(-1) == lp.argmax(-1)))
        bpb = float(-np.mean(np.take_along_axis(lp, target[..., None], -1)) / np.log(2))
        out[mode] = (kl, top1, bpb)
    return out, seqs.size - seqs.shape[0]


def decode_speed(model, prompt, suffix, repeats):
    pre = model.build_prefix_cache(prompt)
    run = lambda n: model.generate_from_prefix_cache(pre, suffix=suffix, max_tokens=n)  # noqa: E731
    t33 = _report.median_time(lambda: run(33), repeats)
    t1 = _report.median_time(lambda: run(1), repeats)
    return 32 / (t33 - t1), pre.nbytes


def h_rebuild(model, prompt, suffix, repeats):
    """One h-mode request two ways, over the call's pages (`decoding.paged_decode`): (a) a pool
    of stored h, K/V rebuilt from h inside the decode loop's program at every step; (b) what
    Model does: a float32 K/V pool, the prefix rebuilt into it once per call
    (`engine.materialize`), the request's own K/V kept in float32. Returns times, bytes."""
    cfg, w = model.weights.config, model.weights
    loops, new = cfg.default_loops, 33
    pre = model.build_prefix_cache(prompt)
    req = tl.Knobs.make(1, max_tokens=new)
    lay = paged_decode.layout(len(prompt), len(suffix) + new, 1)

    def program(mode):
        empty = page_pool.empty(cfg, loops, lay.n_pages, kv_mode=mode)
        pool = paged_decode.load_prefix(w.params, cfg, empty, pre.cache, len(prompt), lay)
        seen = jnp.asarray(engine.token_mask([suffix], cfg.vocab_size)) | pre.seen
        state = St.requests_of(seen, req, d_model=cfg.d_model, dtype=cfg.compute_dtype)
        fill = paged_decode.prefill(w.params, cfg, pool, state, lay.tables, len(prompt), [suffix], pre.logits, loops, 0)
        rows = paged.Rows(lay.tables, np.int32([len(prompt) + len(suffix)]), np.int32([1]))
        return pool, rows, fill

    def run(mode):
        _, rows, fill = program(mode)
        out = paged_decode.decode(w.params, cfg, rows, fill, req, loops, 0, kvc.bucket(new, minimum=8))
        return np.asarray(out.tokens)[0, : int(out.n[0])].tolist()

    in_loop, per_call = partial(run, cfg.storage), partial(run, cfg.storage.working)
    assert in_loop() == per_call(), "the two h-mode paths emitted different tokens"
    t_loop, t_call = (_report.median_time(f, repeats) for f in (in_loop, per_call))
    mat = engine.materialize(w.params, cfg, pre.cache, passes=loops)
    temp = {}
    for name, mode in (("loop", cfg.storage), ("call", cfg.storage.working)):
        pool, rows, _ = program(mode)
        lowered = paged_decode.lower_decode(w.params, cfg, pool, rows, req, loops, kvc.bucket(new, minimum=8))
        temp[name] = lowered.compile().memory_analysis().temp_size_in_bytes
    return t_loop, t_call, pre.nbytes, mat.nbytes, temp


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action=_report.NoWrite)
    args = ap.parse_args()
    modes = list(tl.KV_MODES)
    P, D, repeats, max_bytes = (64, 64, 2, 2048) if args.quick else (1024, 384, 5, None)
    base = tl.ModelConfig(vocab_size=4096, d_model=D, n_heads=D // 64, n_pre_blocks=2, default_loops=8,
                          max_seq_len=2048, kv_mode="fp32")
    params = tl.Model.random(base, seed=0).weights.params
    rng = np.random.default_rng(0)
    prompt, suffix = rng.integers(0, 4096, P).astype(np.int32), rng.integers(0, 4096, 8).astype(np.int32)
    seed_shape = tl.ModelConfig(vocab_size=8, d_model=2048, n_heads=16, n_pre_blocks=2, default_loops=8,
                                max_seq_len=1024)
    speed, nbytes, formula = {}, {}, {}
    for i, mode in enumerate(modes):
        _report.progress(i, len(modes), f"decode {mode}")
        speed[mode], nbytes[mode] = decode_speed(tl.Model(params, tl.ModelConfig(**dict(base.to_dict(), kv_mode=mode))),
                                                 prompt, suffix, repeats)
        formula[mode] = kvc.cache_nbytes(mode, seed_shape.n_cache_layers(8), seed_shape.n_heads, 1024,
                                         seed_shape.head_dim)
    _report.progress(len(modes), len(modes), "quality")
    q, n_pred = quality(modes, max_bytes)
    twin = {"fp16-h": "fp16", "int8-h": "int8", "int4-h": "int4"}
    bpb32 = q["fp32"][2]
    lines = [
        "## KV modes: bytes, decode speed, quality vs fp32 (`scripts/bench_kv_modes.py`)",
        "",
        f"Command: `{_report.command()}`  ",
        f"Machine: {_report.machine()}  ",
        f"Bytes and decode: random model n_pre_blocks=2, loops=8, D={D}, {D // 64} heads, a {P}-token prefix "
        f"(real `PrefixCache.nbytes`, scales included), batch-1 decode with an 8-token suffix, median of {repeats}. "
        "Seed shape: the `Model.cache_nbytes` formula at 1024 tokens for D 2048, 16 heads, n_pre 2, L 8 "
        "(nothing allocated). "
        f"Quality: bundled model `{os.path.relpath(BUNDLED)}` at its default depth, teacher-forced over "
        f"{n_pred:,} held-out predicted bytes; KL(fp32 ‖ mode) in nats per position.",
        "",
        f"| mode | prefix MiB @{P} | vs K/V twin | seed shape MB @1024 | decode tok/s | mean KL vs fp32 | top-1 agree "
        "| bits/byte | perplexity Δ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        kl, top1, bpb = q[m]
        ratio = f"{nbytes[twin[m]] / nbytes[m]:.2f}× smaller than {twin[m]}" if m in twin else ""
        ppl = (2 ** (bpb - bpb32) - 1) * 100
        lines.append(f"| {m} | {nbytes[m] / 2**20:.2f} | {ratio} | {formula[m] / 1e6:.1f} | {speed[m]:.1f} | "
                     f"{kl:.2e} | {100 * top1:.2f}% | {bpb:.4f} | {ppl:+.3f}% |")
    lines += ["", "### h modes: when K/V are rebuilt", "",
              f"One request ({P}-token prefix, 8-token suffix, 32 greedy tokens) served two ways over the "
              "call's pages, same tokens checked. *in the loop*: a pool of stored h, K/V re-projected inside "
              "the decode loop's program at every step. *once per call* (what `Model` does): a float32 K/V "
              "pool, the prefix's K/V rebuilt into it once (`engine.materialize`), the request's own K/V kept "
              "in float32 while it runs. "
              "Scratch = XLA `memory_analysis()` temp of the decode program.", "",
              "| mode | prefix at rest MiB | in the loop ms | once per call ms | speedup | in-loop scratch MiB "
              "| per-call rebuilt prefix MiB | per-call scratch MiB |",
              "|---|---|---|---|---|---|---|---|"]
    for m in twin:
        _report.progress(0, 1, f"h rebuild {m}")
        tl_, tc, at_rest, mat, temp = h_rebuild(tl.Model(params, tl.ModelConfig(**dict(base.to_dict(), kv_mode=m))),
                                                prompt, suffix, repeats)
        lines.append(f"| {m} | {at_rest / 2**20:.2f} | {tl_ * 1e3:.0f} | {tc * 1e3:.0f} | {tl_ / tc:.2f}× | "
                     f"{temp['loop'] / 2**20:.1f} | {mat / 2**20:.1f} | {temp['call'] / 2**20:.1f} |")
    print("\n".join(lines))
    if not args.quick:
        print("wrote", _report.write_section("bench_kv_modes", "\n".join(lines)))


if __name__ == "__main__":
    main()
