"""Jitted programs over dense segments: chunked prefill (a `KVCache`'s, `keep_state` prefixes),
a prefix's logits at another depth.

Programs take the segment they write (`own`) as a donated argument, so XLA updates its buffers
in place; read-only segments (`ro`, a shared prefix) are plain arguments and never written.
Static arguments are only shapes and depths (config, loops, window, output length), so a
workload of many prompt lengths compiles one program per capacity bucket, and the loop's
passes run under `fori_loop`, so no program grows with `loops`.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..model import transformer as tf
from ..model import exits
from ..model.cache import KVCache
from ..model.config import ModelConfig
from ..model.params import Params


def token_mask(rows, vocab_size: int) -> np.ndarray:
    """bool [N, V]: which ids occur in each row of token ids (for the repetition penalty). On the
    host, from the prompts the caller holds: in a program it is a scatter, which XLA:CPU runs
    (and compiles) as a loop over the tokens."""
    out = np.zeros((len(rows), vocab_size), bool)
    for i, r in enumerate(rows):
        out[i, np.asarray(r, np.int64)] = True
    return out


# ---- prefill ---------------------------------------------------------------------------------

class Fill(NamedTuple):
    """What `prefill` returns."""
    logits: Annotated[jax.Array, "float32[V]"]  # next-token logits after the last real token (the exit's pick)
    own: KVCache  # the segment with the chunk written
    depth_states: Annotated[jax.Array, "[n_pre + loops, D]"] | None  # the last token's stream after each pre block
    # and pass (keep_states)
    x: Annotated[jax.Array, "[T, D]"] | None  # every position's stream after the last pass (keep_x)


@partial(jax.jit, static_argnames=("cfg", "loops", "window", "keep_states", "keep_x"), donate_argnames=("own",))
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
            ro: tuple, own: KVCache, loops: int, window: int, exit: exits.Exit | None = None,
            seed: jax.Array | None = None, keep_states: bool = False, keep_x: bool = False) -> Fill:
    """Append a chunk (its first n_valid real, the rest bucket padding) to one segment `own` at
    absolute positions start_pos + i, attending also to the read-only segments `ro` (a prefix):
    tokens [T] int32, embedded here; or a stream [T, D] entering the first pass (own holding no
    pre layers: more passes of a prompt whose stream after its last pass that is, `Fill.x`).
    keep_states: the last token's stream after each pre block and pass; keep_x: every
    position's after the last pass. One token is a chunk of T = 1 (`functional.decode_step`)."""
    x0 = tf.embed(params, tokens, start_pos, cfg) if jnp.issubdtype(tokens.dtype, jnp.integer) else tokens
    out = tf.run_layers(params, cfg, x0, n_valid, start_pos, ro, own, loops, window, keep_states=keep_states,
                        exit=exit, seed=seed)
    return Fill(tf.last_logits(params, cfg, out.exit_x, n_valid), out.own, out.states if keep_states else None,
                out.x if keep_x else None)


# ---- prefix operations -----------------------------------------------------------------------

@partial(jax.jit, static_argnames=("cfg", "loops"))
def prefix_logits(params: Params, cfg: ModelConfig, depth_states: jax.Array, loops: int,
                  exit: exits.Exit | None = None) -> jax.Array:
    """A prompt's next-token logits [V] at depth `loops` from its last token's states
    [n_pre + passes, D] (`prefill_prefix`), with the early exit's pick among the passes."""
    n_pre = cfg.n_pre_blocks
    return tf.lm_head(params, cfg, exits.exit_stream(params, cfg, depth_states[n_pre:n_pre + loops], exit))

