"""A sequence's log-probabilities under the model (`Model.score`, held-out bits per byte): each
position's log-softmax of the raw logits (no sampling knobs), read at the token after it. The
streams come from the step that prefills a prompt chunk (`step.step(targets=...)`), so scoring
runs the forward every other path runs, a chunk at a time over pages (`paged_decode.score`).
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

import jax
import jax.numpy as jnp

from ..model import transformer as tf
from ..model.config import ModelConfig
from ..model.params import Params


class Scores(NamedTuple):
    """What `Model.score` returns: row i is about token i, predicted from the tokens before it
    (row 0, which nothing predicts, holds zeros)."""
    logprobs: Annotated[jax.Array, "float32[T]"]  # log p(tokens[i] | tokens[:i])
    top_ids: Annotated[jax.Array, "int32[T, K]"]  # the K likeliest tokens at position i, likeliest first
    top_logprobs: Annotated[jax.Array, "float32[T, K]"]


# positions whose [V] log-probabilities exist at once (a 512-token chunk of a large vocabulary
# would otherwise hold T x V floats)
SCORE_BLOCK = 128


def chunk_scores(params: Params, cfg: ModelConfig, x: jax.Array, targets: jax.Array, top: int) -> Scores:
    """Streams x [b, T, D] (the ones the logits come from) scored at targets [b, T]: position j's
    log-probability of targets[j] and its `top` likeliest tokens, `SCORE_BLOCK` positions at a
    time. Returns `Scores` [b, T, ...], position j about targets[j] (not shifted)."""
    b, T, D = x.shape
    blocks = T // SCORE_BLOCK if T % SCORE_BLOCK == 0 else 1

    def block(args):
        xb, tb = args  # [b, t, D], [b, t]
        lp = jax.nn.log_softmax(tf.lm_head(params, cfg, xb), axis=-1)  # [b, t, V]
        chosen = jnp.take_along_axis(lp, tb[..., None], axis=-1)[..., 0]
        if top:
            top_lp, top_ids = jax.lax.top_k(lp, top)
        else:
            top_lp, top_ids = lp[..., :0], jnp.zeros(lp.shape[:-1] + (0,), jnp.int32)
        return chosen, top_ids.astype(jnp.int32), top_lp

    split = lambda a: jnp.moveaxis(a.reshape(b, blocks, T // blocks, *a.shape[2:]), 1, 0)  # noqa: E731
    out = jax.lax.map(block, (split(x), split(targets)))
    return Scores(*(jnp.moveaxis(a, 0, 1).reshape(b, T, *a.shape[3:]) for a in out))
