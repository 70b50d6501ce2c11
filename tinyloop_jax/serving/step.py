"""The engine's device programs (`decoding.step`'s step body, jitted per depth: `programs`) and
the host arrays they take (`make_chunks`, `make_decodes`); a store entry's load into pages and a
page copy.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from ..decoding.step import (FILLER, STOPS, Chunks, Decodes, Emitted, Requests, admit, chunk_adaptive,  # noqa: F401
                             decode_steps, empty_rows, step)
from ..model import paged


load_entry = paged.load_segment
copy_pages = paged.copy_pages

JIT_OPTIONS = dict(load_entry=dict(donate_argnames=("pool",)), copy_pages=dict(donate_argnames=("pool",)),
                   chunk_adaptive=dict(static_argnames=("cfg", "loops"), donate_argnames=("pool", "state")),
                   decode_steps=dict(static_argnames=("cfg", "loops", "n_max", "window", "adaptive", "draft_loops",
                                                      "lookahead"), donate_argnames=("pool", "state")),
                   step=dict(static_argnames=("cfg", "loops"), donate_argnames=("pool", "state")),
                   admit=dict(donate_argnames=("state",)))


def programs() -> dict:
    """A new set of the engine's jitted programs (name -> program) over new function objects:
    JAX keeps a program's trace, lowering and executable in caches keyed (weakly) by the
    function, so what one set compiled is freed with it (a depth's programs hold megabytes)."""
    out = {}
    for name, opts in JIT_OPTIONS.items():
        fn = globals()[name]  # looked up now: a test may stand another in

        @functools.wraps(fn)
        def fresh(*args, fn=fn, **kwargs):
            return fn(*args, **kwargs)
        out[name] = jax.jit(fresh, **opts)
    return out


def make_chunks(tables: list, tokens: list, starts: list, slots: list, finals: list, T: int, R: int,
                rows: int, windows: list = ()) -> Chunks:
    """Host arrays of a chunk group padded to `rows` rows of T tokens and R page entries
    (windows: each row's cache_window, 0 for none)."""
    tok = np.zeros((rows, T), np.int32)
    for i, t in enumerate(tokens):
        tok[i, :len(t)] = t
    return Chunks(_rows(tables, starts, [len(t) for t in tokens], R, rows, windows), tok, _pad(slots, rows, FILLER),
                  np.asarray(list(finals) + [False] * (rows - len(finals)), bool))


def make_decodes(tables: list, starts: list, slots: list, steps: list, R: int, rows: int,
                 windows: list = (), left: list | None = None) -> Decodes:
    """Host arrays of a decode group padded to `rows` rows and R page entries (left: tokens each
    row may still emit, for `decode_steps`)."""
    return Decodes(_rows(tables, starts, [1] * len(tables), R, rows, windows), _pad(slots, rows, FILLER),
                   _pad(steps, rows, 0), None if left is None else _pad(left, rows, 0))


def _pad(values: list, rows: int, fill: int) -> np.ndarray:
    return np.asarray(list(values) + [fill] * (rows - len(values)), np.int32)


def _rows(tables: list, starts: list, n_new: list, R: int, rows: int, windows: list = ()) -> paged.Rows:
    table = np.zeros((rows, R), np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t[:R]
    return paged.Rows(table, _pad(starts, rows, 0), _pad(n_new, rows, 0), _pad(list(windows), rows, 0))
