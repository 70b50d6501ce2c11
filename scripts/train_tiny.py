"""Train the bundled looped byte-level model on Python's own `pydoc_data.topics`.

    pip install -e ".[train]"
    python scripts/train_tiny.py --out checkpoints/tinyloop-pydoc      # ~30 min on 2 CPUs

The loop depth is drawn per step, uniformly from 1..--max-loops, so one set of weights works
at every depth (or fixed: --fixed-loops, as Ouro trains its 4 loops; with --n-pre 0 and
--loop-blocks 2 the whole stack loops, Ouro's layout). Data order and init are seeded. Writes
the checkpoint (orbax), a loss log (train_log.tsv) and a model card (README.md) with held-out
bits-per-byte by loops.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.model import transformer as tf  # noqa: E402
from tinyloop_jax.data import pydoc_split  # noqa: E402
from tinyloop_jax.api.evaluate import bits_per_byte  # noqa: E402
from tinyloop_jax.model.init import gpt2_init  # noqa: E402


def make_step(cfg, optimizer):
    def loss_fn(params, seqs, loops):
        logits = jax.vmap(lambda s: tf.forward_seq(params, cfg, s, loops))(seqs[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()

    def step(params, opt_state, seqs, loops):
        loss, grads = jax.value_and_grad(loss_fn)(params, seqs, loops)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, static_argnums=3, donate_argnums=(0, 1))


def train(cfg, steps, batch, max_loops, lr, seed, log_path=None, progress=True, fixed_loops=None):
    """Returns (params, losses, seconds)."""
    train_bytes, _ = pydoc_split()
    rng = np.random.default_rng(seed)
    params = gpt2_init(cfg, seed)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10 + 1), steps, lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = optimizer.init(params)
    step = make_step(cfg, optimizer)
    T = cfg.max_seq_len
    losses, t0 = [], time.perf_counter()
    log = open(log_path, "w") if log_path else None
    if log:
        log.write("step\tloops\tloss_bits\tseconds\n")
    for i in range(steps):
        starts = rng.integers(0, len(train_bytes) - T - 1, batch)
        seqs = np.stack([train_bytes[s:s + T + 1] for s in starts]).astype(np.int32)
        loops = fixed_loops or int(rng.integers(1, max_loops + 1))
        params, opt_state, loss = step(params, opt_state, jnp.asarray(seqs), loops)
        loss = float(loss) / np.log(2)
        losses.append(loss)
        if log:
            log.write(f"{i}\t{loops}\t{loss:.4f}\t{time.perf_counter() - t0:.1f}\n")
            log.flush()
        if progress:
            avg = np.mean(losses[-50:])
            _report.progress(i + 1, steps, f"loss {avg:.3f} bits/byte (last 50), L={loops}")
    return params, losses, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="checkpoints/tinyloop-pydoc")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-pre", type=int, default=2)
    ap.add_argument("--loop-blocks", type=int, default=1)
    ap.add_argument("--fixed-loops", type=int, default=None, help="train at this depth only (default: uniform)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-loops", type=int, default=8)
    ap.add_argument("--default-loops", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cfg = tl.ModelConfig(vocab_size=tl.ByteTokenizer.vocab_size, d_model=args.d_model, n_heads=args.n_heads,
                         n_pre_blocks=args.n_pre, loop_blocks=args.loop_blocks, default_loops=args.default_loops,
                         max_seq_len=args.context, kv_mode="fp32")
    if os.path.exists(args.out):
        sys.exit(f"error: {args.out} exists; remove it or choose another --out")
    tmp_log = args.out.rstrip("/") + ".train_log.tsv"
    params, losses, secs = train(cfg, args.steps, args.batch, args.max_loops, args.lr, args.seed, tmp_log,
                                 fixed_loops=args.fixed_loops)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    model = tl.Model(params, cfg)
    model.save(args.out)
    os.replace(tmp_log, os.path.join(args.out, "train_log.tsv"))

    _, val = pydoc_split()
    rows = []
    for loops in (1, 2, 4, 8, 16):
        rows.append((loops, bits_per_byte(params, cfg, val, loops)))
        print(f"held-out bits/byte at loops={loops}: {rows[-1][1]:.3f}")
    card = [
        f"# {os.path.basename(args.out.rstrip('/'))}",
        "",
        "A small looped byte-level GPT-2-style model trained by `scripts/train_tiny.py`.",
        "",
        f"- Config: {cfg.to_dict()} ({n_params / 1e6:.2f} M parameters; {cfg.loop_blocks} loop block(s) shared "
        "by all iterations)",
        f"- Data: Python {sys.version.split()[0]}'s `pydoc_data.topics` (UTF-8 bytes), every 20th 2048-byte chunk "
        "held out (5%) — `tinyloop_jax.data.pydoc_split`",
        f"- Training: {args.steps} steps × batch {args.batch} × {args.context} bytes, loop depth "
        + (f"{args.fixed_loops} every step" if args.fixed_loops else f"uniform in 1..{args.max_loops} per step")
        + f", AdamW lr {args.lr} (warmup + cosine), grad clip 1.0, seed {args.seed}",
        f"- Time: {secs / 60:.1f} min on {_report.machine()}",
        f"- Final training loss (mean of last 50 steps): {np.mean(losses[-50:]):.3f} bits/byte",
        f"- Command: `{_report.command()}`",
        "",
        "Held-out bits per byte by loop depth (`tinyloop eval`):",
        "",
        "| loops | bits/byte |",
        "|---|---|",
    ] + [f"| {L} | {b:.3f} |" for L, b in rows]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(card) + "\n")
    print("\n".join(card))


if __name__ == "__main__":
    main()
