"""Matmul precision: float32 models compute their matmuls in float32 on every backend."""

from __future__ import annotations

import functools

import jax


def exact(fn):
    """Run `fn(params, cfg, ...)` with float32 matmuls when the model computes in float32: XLA's
    default on GPUs is TF32 (10-bit mantissas), which moved Ouro's logits by 0.1 and changed
    greedy tokens on an H200 (scripts/gpu_parity.py). On CPU the programs compute the same."""
    @functools.wraps(fn)
    def wrapped(params, cfg, *args, **kwargs):
        if cfg.dtype != "float32":
            return fn(params, cfg, *args, **kwargs)
        with jax.default_matmul_precision("float32"):
            return fn(params, cfg, *args, **kwargs)
    return wrapped
