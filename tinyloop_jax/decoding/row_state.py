"""`RowState`: what the sampling rule knows of each row, and the one rule that advances it.

Every token-emitting loop holds one, as `step.Requests.rows`: the engine's M request rows (a
step reads and writes them by slot) and a `Model` call's N rows (`step.requests_of`, in
order). A step runs `feed` (the row's last token, its input now, joins what the penalties
count), the model, then `choose` (the next token from the logits).
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .sampling import Knobs, select_tokens


@struct.dataclass
class RowState:
    seen: Annotated[jax.Array, "bool[N, V]"]  # the prompt's tokens and the emitted ones fed (repetition penalty)
    counts: Annotated[jax.Array, "int32[N, V]"]  # emitted tokens fed so far, per id (presence, frequency)
    last: Annotated[jax.Array, "int32[N]"]  # the last token chosen: the row's next input
    warm: Annotated[jax.Array, "[N, D]"] | None = None  # adaptive depth: the row's last loop state

    @classmethod
    def start(cls, seen: jax.Array, first: jax.Array, warm: jax.Array | None = None) -> "RowState":
        """Rows whose prompts are seen [N, V] and whose first tokens are first [N], nothing
        emitted yet (the counts made on the host: `step.requests_of` puts the rows on the device)."""
        return cls(seen, np.zeros(seen.shape, np.int32), first, warm)


def feed(rows: RowState, slot: jax.Array | None = None) -> RowState:
    """Each row's last token fed: it joins `seen` and `counts`. slot [b]: only those rows (the
    engine's request rows; out of range: none), one element each, in place."""
    if slot is not None:
        tok = jnp.take(rows.last, slot, mode="clip")
        return rows.replace(seen=rows.seen.at[slot, tok].set(True, mode="drop"),
                            counts=rows.counts.at[slot, tok].add(1, mode="drop"))
    # one-hots (elementwise), not scatters: on a mesh whose vocabulary axis is split, a scatter
    # would cost an all-reduce per step, and XLA:CPU runs one as a loop over the rows
    hot = jax.nn.one_hot(rows.last, rows.counts.shape[-1], dtype=jnp.int32)
    return rows.replace(seen=rows.seen | (hot > 0), counts=rows.counts + hot)


def choose(rows: RowState, logits: jax.Array, req: Knobs, step: jax.Array,
           slot: jax.Array | None = None) -> jax.Array:
    """Each row's next token [N] from its logits [N, V] (after `feed`), drawn with
    req.keys(step) (step [] or [N]); slot [b]: the rows of `rows` the logits [b, V] are for."""
    seen, counts = penalized(rows, slot)
    return select_tokens(logits, seen, req, step, counts)


def penalized(rows: RowState, slot: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """What the penalties read of each row (of rows `slot` [b]): (seen [b, V], counts [b, V]).
    `choose`'s, for a caller choosing several groups' tokens at once (`step.step`)."""
    if slot is None:
        return rows.seen, rows.counts
    return jnp.take(rows.seen, slot, axis=0, mode="clip"), jnp.take(rows.counts, slot, axis=0, mode="clip")
