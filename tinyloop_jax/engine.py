"""Jitted programs: chunked prefill and the on-device decode loop.

Both take the segment they write (`own`) as a donated argument, so XLA updates its buffers
in place; read-only segments (`ro`, a shared prefix) are plain arguments and never written.
Static arguments are only shapes and depths (config, loops, window, output length), so a
workload of many prompt lengths compiles one program per capacity bucket.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from . import cache as kvc
from . import model
from .cache import KVCache
from .config import ModelConfig
from .params import Params
from .sampling import SamplingParams, StopSpec, select_token, stop_hit


@partial(jax.jit, static_argnames=("cfg", "loops", "window"), donate_argnames=("own",))
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array,
               start_pos: jax.Array, ro: tuple, own: KVCache, loops: int, window: int):
    """Append tokens[:n_valid] (tokens [T_bucket] int32, bucket-padded) to `own`, at absolute
    positions start_pos + i (normally own.length; the functional layer lets a caller choose).
    Returns (next-token logits of the last real token [V] float32, new own)."""
    x, own = model.forward(params, cfg, tokens, n_valid, start_pos, ro, own, loops, window)
    last = jax.lax.dynamic_index_in_dim(x, n_valid - 1, axis=0, keepdims=False)
    return model.lm_head(params, last), own


@partial(jax.jit, static_argnames=("cfg", "loops", "window"), donate_argnames=("own",))
def prefill_states(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
                   own: KVCache, loops: int, window: int):
    """`prefill` (no read-only segments) that also returns the loop state: (logits [V], own,
    state [T, D] (the chunk's residual stream after the last layer, before the final LayerNorm),
    depth_states [n_layers, D] (the last real token's stream after each cache layer))."""
    x = model.embed(params, tokens, start_pos)
    x, x_ln, states, own = model.run_layers(params, cfg, x, n_valid, start_pos, (), own, 0,
                                            cfg.n_cache_layers(loops), window)
    last = jax.lax.dynamic_index_in_dim(x_ln, n_valid - 1, axis=0, keepdims=False)
    return model.lm_head(params, last), own, x, states


@partial(jax.jit, static_argnames=("cfg", "first", "last", "window"), donate_argnames=("own",))
def continue_depth(params: Params, cfg: ModelConfig, state: jax.Array, n_valid: jax.Array, own: KVCache,
                   first: int, last: int, window: int):
    """Run cache layers first..last-1 over a prompt whose stream entering layer `first` is
    state [T, D] (positions from 0): the extra loop iterations of a deeper prefix, nothing before
    them re-run. Returns (logits [V], own (those layers), state after them, depth_states)."""
    x, x_ln, states, own = model.run_layers(params, cfg, state, n_valid, jnp.int32(0), (), own, first, last, window)
    last_x = jax.lax.dynamic_index_in_dim(x_ln, n_valid - 1, axis=0, keepdims=False)
    return model.lm_head(params, last_x), own, x, states


@jax.jit
def logits_from_state(params: Params, cfg_eps: float, x: jax.Array) -> jax.Array:
    """One position's stream [D] -> next-token logits [V] (final LayerNorm + tied head)."""
    return model.lm_head(params, model.layer_norm(x, params.lnf_g, params.lnf_b, cfg_eps))


copy_prefix = jax.jit(kvc.copy_prefix, static_argnames=("capacity",))


@partial(jax.jit, static_argnames=("cfg",))
def materialize(params: Params, cfg: ModelConfig, seg: KVCache) -> KVCache:
    """A read-only segment with its K/V rebuilt/dequantized to float32 (see model.materialize)."""
    return model.materialize(params, cfg, seg)


@partial(jax.jit, static_argnames=("cfg", "loops", "window", "out_len"), donate_argnames=("own",))
def decode(params: Params, cfg: ModelConfig, ro: tuple, own: KVCache, first_logits: jax.Array,
           seen: jax.Array, sp: SamplingParams, stop: StopSpec, max_tokens: jax.Array,
           loops: int, window: int, out_len: int):
    """Emit up to max_tokens (<= out_len) tokens as one `lax.while_loop` on device.

    first_logits [V]: next-token logits after the prompt; seen [V] bool: tokens so far (for
    the repetition penalty). Token i is chosen from the logits that token i-1 produced, so a
    run of n tokens costs n-1 forward steps. Returns (out [out_len] int32, n_emitted, own).
    """
    out = jnp.full((out_len,), -1, jnp.int32)
    tok = select_token(first_logits, seen, sp, jnp.int32(0))
    out = out.at[0].set(tok)
    n = jnp.int32(1)
    done = stop_hit(out, n, stop) | (n >= max_tokens)

    def body(carry):
        n, own, tok, seen, out, _ = carry
        seen = seen.at[tok].set(True)
        x, own = model.forward(params, cfg, tok[None], jnp.int32(1), own.length, ro, own, loops, window)
        tok = select_token(model.lm_head(params, x[0]), seen, sp, n)
        out = out.at[n].set(tok)
        n = n + 1
        return n, own, tok, seen, out, stop_hit(out, n, stop) | (n >= max_tokens)

    n, own, _, _, out, _ = jax.lax.while_loop(lambda c: ~c[-1], body, (n, own, tok, seen, out, done))
    return out, n, own
