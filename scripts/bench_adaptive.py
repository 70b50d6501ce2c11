"""Adaptive depth: does decode time follow the passes actually run?

    python scripts/bench_adaptive.py            # ~15 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_adaptive.py --quick    # a smoke run on a small model, nothing written

A Huginn-shaped random model (d 1024, 16 heads, prelude / core / coda of 2 / 4 / 2 blocks, 32
steps, float32, fp32 KV). Greedy decoding of `--new` tokens after a 32-token prefix (built once, at
full depth) and one own token per row, batch 1 and batch 8 (rows of
`generate_batch_from_prefix_cache`):
  * controlled depths: exit_criterion="kl" with an exit threshold no KL reaches above (1e9) and
    min_steps = d - 1, so every decoded token exits after exactly d passes (one check, one
    coda run) — the same program for every d;
  * a real criterion (entropy-diff at two thresholds: on random weights the next-token
    distribution is near uniform, so KL, latent and argmax criteria never exit) at whatever
    depths it picks;
  * plain decoding (no criterion, every pass) as the baseline.
Decode time per token = (time of a call emitting `--new` tokens - time of a call emitting 1) /
(new - 1): the own token's prefill cancels. The settings are timed round-robin, `--repeats` rounds,
medians per setting (so the machine's drift hits every setting alike). The ideal speedup over 32 passes
counts blocks run per token: (2 + 4 * 32 + 2) / (2 + 4 * d + 2 * codas), where a logit criterion
runs the coda at every check (the reference's rule) and the rest run it once; the head is not
counted.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402


def huginn_config(quick: bool) -> tl.ModelConfig:
    d, heads, inter = (128, 4, 352) if quick else (1024, 16, 2816)
    return tl.ModelConfig(vocab_size=4096, d_model=d, n_heads=heads, block="llama", intermediate_size=inter,
                          n_pre_blocks=2, loop_blocks=4, n_post_blocks=2, default_loops=32, max_seq_len=256,
                          norm_placement="normed_residual", injection="concat_adapter", embed_scale=float(np.sqrt(d)),
                          norm_before_coda=True, rope_pairing="adjacent", attention_bias=True, kv_mode="fp32",
                          state_init_scale=0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--step-depths", action="store_true",
                    help="no timing: print, per setting at batch 8, mean passes per token and per step (the step "
                         "runs to its slowest row)")
    args = ap.parse_args()
    cfg = huginn_config(args.quick)
    model = tl.Model.random(cfg, seed=0)
    L = cfg.default_loops

    def blocks(depth: int, kw: dict) -> int:
        """Blocks one decoded token runs: prelude, 4 per pass, and the coda once per check of a
        logit criterion (they read the logits at every check), else once."""
        codas = 1
        if kw.get("exit_criterion") in ("kl", "entropy-diff", "argmax-stability"):
            m, every = kw.get("min_steps", 0), kw.get("check_every", 1)
            codas = max(1, sum(1 for i in range(depth) if i >= m and (i - m) % every == 0))
        return cfg.n_pre_blocks + cfg.loop_blocks * depth + cfg.n_post_blocks * codas
    rng = np.random.default_rng(0)
    prefix = model.build_prefix_cache(rng.integers(0, cfg.vocab_size, 32).astype(np.int32))
    suffixes = [[int(t)] for t in rng.integers(0, cfg.vocab_size, 8)]  # one own token per row

    def run(batch: int, n: int, **kw):
        if batch == 1:
            model.generate_from_prefix_cache(prefix, suffix=suffixes[0], max_tokens=n, **kw)
            return [model.last_depths] if model.last_depths else None
        model.generate_batch_from_prefix_cache(prefix, suffixes[:batch], max_tokens=n, **kw)
        return model.last_depths

    settings = [("every pass (no criterion)", {})]
    settings += [(f"kl, min_steps={d - 1} (exits after {d})", dict(exit_criterion="kl", exit_threshold=1e9,
                                                                   min_steps=d - 1)) for d in (32, 24, 16, 8, 4)]
    settings += [(f"entropy-diff < {t:g}", dict(exit_criterion="entropy-diff", exit_threshold=t)) for t in (1e-4, 1e-2)]
    if args.step_depths:
        for label, kw in settings:
            depths = np.array([d[1:] for d in run(8, args.new, **kw)]) if kw else np.full((8, args.new - 1), L)
            print(f"{label}: passes per token {depths.mean():.2f}, per step (slowest row) "
                  f"{depths.max(axis=0).mean():.2f}")
        return
    rows = []
    for batch in (1, 8):
        for _, kw in settings:  # compile and warm every setting first
            run(batch, args.new, **kw), run(batch, 1, **kw)
        times = {label: [] for label, _ in settings}
        for r in range(args.repeats):
            for i, (label, kw) in enumerate(settings):
                _report.progress(r * len(settings) + i, args.repeats * len(settings), f"batch {batch}: {label}")
                t_n = _report.median_time(lambda: run(batch, args.new, **kw), repeats=1, warmup=0)
                t_1 = _report.median_time(lambda: run(batch, 1, **kw), repeats=1, warmup=0)
                times[label].append((t_n - t_1) / (args.new - 1))
        base = float(np.median(times[settings[0][0]]))
        for label, kw in settings:
            depths = run(batch, args.new, **kw)
            per_token = [[L] * (args.new - 1)] if depths is None else [d[1:] for d in depths]
            mean = float(np.mean(per_token))
            sec = float(np.median(times[label]))
            ideal = blocks(L, {}) / float(np.mean([blocks(d, kw) for row in per_token for d in row]))
            speed = base / sec
            rows.append(f"| {batch} | {label} | {mean:.2f} | {batch / sec:.2f} | {sec * 1e3:.1f} | {speed:.2f}x | "
                        f"{ideal:.2f}x | {speed / ideal:.2f} |")
            print(rows[-1], file=sys.stderr)
    body = "\n".join([
        "## Adaptive depth: decode time against passes run (`scripts/bench_adaptive.py`)",
        "",
        f"Command: `{_report.command()}` on {_report.machine()}.",
        "",
        f"Huginn-shaped random model: d {cfg.d_model}, {cfg.n_heads} heads, MLP {cfg.intermediate_size}, "
        f"2 / 4 / 2 blocks, {L} steps, float32 weights and KV; a 32-token prefix (full depth) + 1 own token per row, "
        f"{args.new} greedy tokens; decode step time = (t({args.new} tokens) - t(1 token)) / {args.new - 1}, "
        f"settings timed round-robin, medians of {args.repeats} rounds. `passes/token`: mean passes run per "
        "decoded token (rows averaged). "
        "Speedup is against every pass (no criterion) at the same batch; ideal = blocks run at 32 passes / "
        "blocks run per token (prelude + 4 x passes + the coda, which a logit criterion runs at every check); "
        "`of ideal` = speedup / ideal.",
        "",
        "| batch | exit rule | passes/token | tokens/s | ms/step | speedup | ideal | of ideal |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    if args.quick:
        print(body)
        return
    print(f"wrote {_report.write_section('adaptive', body)}")


if __name__ == "__main__":
    main()
