"""`RowState`'s rule, the one both the `Model` path's decode loops (all rows) and the engine's
request rows (rows by slot) run: `feed` then `choose`, checked against a numpy loop, the two
addressing modes against each other."""

import jax.numpy as jnp
import numpy as np

from tinyloop_jax.decoding import row_state as R
from tinyloop_jax.decoding.sampling import Knobs

M, V = 5, 11
FILLER = 1 << 30


def random_rows(seed: int) -> R.RowState:
    rng = np.random.default_rng(seed)
    return R.RowState(jnp.asarray(rng.random((M, V)) < 0.3), jnp.asarray(rng.integers(0, 3, (M, V)), jnp.int32),
                      jnp.asarray(rng.integers(0, V, M), jnp.int32))


def test_feed_adds_each_rows_last_token():
    rows = random_rows(0)
    seen, counts, last = (np.array(a) for a in (rows.seen, rows.counts, rows.last))
    for i in range(M):  # the reference: one row at a time
        seen[i, last[i]] = True
        counts[i, last[i]] += 1
    fed = R.feed(rows)
    np.testing.assert_array_equal(np.asarray(fed.seen), seen)
    np.testing.assert_array_equal(np.asarray(fed.counts), counts)


def test_by_slot_equals_the_rows_taken():
    """Rows 3 and 1 by slot (a filler slot beside them writes nothing) == those rows fed and
    chosen on their own; the other rows are untouched."""
    rows, slot, pick = random_rows(1), jnp.asarray([3, 1, FILLER], jnp.int32), np.array([3, 1])
    knobs = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, V)), jnp.float32)
    by_slot = R.feed(rows, slot)
    taken = R.feed(R.RowState(rows.seen[pick], rows.counts[pick], rows.last[pick]))
    rest = np.array([0, 2, 4])
    for got, want, before in ((by_slot.seen, taken.seen, rows.seen), (by_slot.counts, taken.counts, rows.counts)):
        np.testing.assert_array_equal(np.asarray(got)[pick], np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got)[rest], np.asarray(before)[rest])
    tok = R.choose(by_slot, logits, Knobs.make(3, **knobs), jnp.int32(1), slot)
    want = R.choose(taken, logits[:2], Knobs.make(2, **knobs), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(tok)[:2], np.asarray(want))
