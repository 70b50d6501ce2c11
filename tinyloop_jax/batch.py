"""Jitted programs for N requests at once that share read-only segments (a prefix).

The single-request forward is `vmap`-ed over the request axis with the shared segments left
unbatched: in every attention layer the prefix part is one matmul of all N queries against
the single prefix copy (never replicated N times), each request's own segment is attended
per request, and the partial softmaxes are merged by log-sum-exp (`model.attention`) — the
Hydragen / FlashInfer "cascade" split.

    ro:  shared segments, arrays [..., C, ...] as for one request
    own: a KVCache whose arrays carry a leading request axis: layers [N, H, C, hd], pos [N, C],
         length [N]; ragged requests are bucket-padded and masked by n_valid [N]
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from . import model
from .cache import KVCache
from .config import ModelConfig
from .params import Params
from .sampling import SamplingParams, StopSpec, select_tokens, stop_hit


def _forward(params, cfg, tokens, n_valid, start_pos, ro, own, loops, window):
    one = lambda t, n, s, o: model.forward(params, cfg, t, n, s, ro, o, loops, window)  # noqa: E731
    return jax.vmap(one)(tokens, n_valid, start_pos, own)


@partial(jax.jit, static_argnames=("cfg", "loops", "window"), donate_argnames=("own",))
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
            ro: tuple, own: KVCache, loops: int, window: int):
    """tokens [N, T] (row i real up to n_valid[i]), start_pos [N] -> (logits [N, V] after each
    row's last real token (garbage where n_valid is 0), new own)."""
    x, own = _forward(params, cfg, tokens, n_valid, start_pos, ro, own, loops, window)
    last = x[jnp.arange(x.shape[0]), jnp.maximum(n_valid - 1, 0)]
    return model.lm_head(params, last), own


@partial(jax.jit, static_argnames=("cfg", "loops", "window", "out_len"), donate_argnames=("own",))
def decode(params: Params, cfg: ModelConfig, ro: tuple, own: KVCache, first_logits: jax.Array, seen: jax.Array,
           sp: SamplingParams, stop: StopSpec, max_tokens: jax.Array, loops: int, window: int, out_len: int):
    """Up to max_tokens tokens for each of N requests, one `lax.while_loop` on device.

    first_logits [N, V]; seen [N, V] bool; sp and stop carry a leading request axis. A request
    that hits a stop sequence emits nothing more; the loop ends when all are done or at
    max_tokens. Returns (out [N, out_len] int32, n_emitted [N], own)."""
    N = first_logits.shape[0]
    rows = jnp.arange(N)
    select = select_tokens
    hit = jax.vmap(stop_hit, in_axes=(0, None, 0))
    out = jnp.full((N, out_len), -1, jnp.int32)
    tok = select(first_logits, seen, sp, jnp.int32(0))
    out = out.at[:, 0].set(tok)
    n = jnp.int32(1)
    done = hit(out, n, stop) | (n >= max_tokens)
    count = jnp.ones((N,), jnp.int32)

    def body(carry):
        n, own, tok, seen, out, count, done = carry
        seen = seen.at[rows, tok].set(True)
        x, own = _forward(params, cfg, tok[:, None], jnp.ones((N,), jnp.int32), own.length, ro, own, loops, window)
        new = select(model.lm_head(params, x[:, 0]), seen, sp, n)
        out = out.at[:, n].set(jnp.where(done, -1, new))
        count = count + (~done).astype(jnp.int32)
        n = n + 1
        # a finished request keeps stepping (its output is masked) so the batch keeps one shape
        done = done | hit(out, n, stop) | (n >= max_tokens)
        return n, own, new, seen, out, count, done

    carry = jax.lax.while_loop(lambda c: ~jnp.all(c[-1]), body, (n, own, tok, seen, out, count, done))
    return carry[4], carry[5], carry[1]
